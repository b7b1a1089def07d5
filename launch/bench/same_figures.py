"""Do two runs of a launch/ benchmark report the same figures? (Runs with a fixed ``--host-op-s`` must.)

    python -m launch.bench.same_figures runs/a.json runs/b.json

Compares the two JSON results value by value, exactly (floats too), leaving out what differs between any
two runs by design: the date, the machine block (load average), wall-clock times (every ``wall_s``, and
whatever lies under a key named ``wall_s``), the command line (the ``--json`` path) and the ``config``'s
``json`` path. Prints each difference with its path and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

IGNORED_KEYS = frozenset({"date", "machine", "wall_s", "command"})
IGNORED_PATHS = frozenset({("config", "json")})


def differences(a, b, path: tuple = ()) -> list[str]:
    """Where ``a`` and ``b`` differ (besides the ignored keys), one line each."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            where = (*path, key)
            if key in IGNORED_KEYS or where in IGNORED_PATHS:
                continue
            if key not in a or key not in b:
                out.append(f"{'/'.join(map(str, where))}: only in {'the second' if key not in a else 'the first'}")
            else:
                out.extend(differences(a[key], b[key], where))
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{'/'.join(map(str, path))}: {len(a)} items against {len(b)}"]
        return [line for i, (x, y) in enumerate(zip(a, b)) for line in differences(x, y, (*path, i))]
    if a != b or type(a) is not type(b):
        return [f"{'/'.join(map(str, path))}: {a!r} != {b!r}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    found = differences(json.loads(args.first.read_text()), json.loads(args.second.read_text()))
    for line in found[:200]:
        print(line)
    if len(found) > 200:
        print(f"... and {len(found) - 200} more")
    print(f"{len(found)} difference(s) between {args.first} and {args.second} (date, machine, wall times and the "
          "command left out)" if found else f"same figures: {args.first} and {args.second} agree exactly (date, "
          "machine, wall times and the command left out)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
