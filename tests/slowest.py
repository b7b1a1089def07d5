"""The slowest tests of a ``pytest --durations=0`` run, with their tier, as the README's table.

    python -m tests.slowest LOG [COUNT]     # LOG: the output of pytest -q --extended --durations=0 (any tiers)

A test's time is the sum of its phases (set-up, call, tear-down: a module-scoped fixture's jobs count for
the first test that asks for them). Its tier is read from its markers (``tests/tiers.py``) by collecting the
suite in this process (``--extended``, nothing runs). Last line: the logged seconds of each tier's tests."""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.tiers import marker_names, tier_label

LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)$")


def durations_s(log_text: str) -> dict[str, float]:
    """Each test's seconds, its phases summed, from a ``--durations`` listing."""
    seconds: dict[str, float] = defaultdict(float)
    for line in log_text.splitlines():
        found = LINE.match(line)
        if found:
            seconds[found.group(3)] += float(found.group(1))
    return dict(seconds)


class _Markers:
    """A pytest plugin that keeps each collected test's marker names."""

    def __init__(self) -> None:
        self.by_nodeid: dict[str, frozenset[str]] = {}

    def pytest_collection_finish(self, session) -> None:
        self.by_nodeid = {item.nodeid: marker_names(item) for item in session.items}


def table(seconds: dict[str, float], markers: dict[str, frozenset[str]], count: int) -> str:
    """A markdown table of the ``count`` slowest tests: seconds, tier, test."""
    rows = ["| s | tier | test |", "|---:|---|---|"]
    for nodeid, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:count]:
        tier = tier_label(markers[nodeid]) if nodeid in markers else "(not collected now)"
        rows.append(f"| {s:.1f} | {tier} | `{nodeid}` |")
    return "\n".join(rows)


def tier_totals_s(seconds: dict[str, float], markers: dict[str, frozenset[str]]) -> dict[str, float]:
    """The logged seconds of each tier's tests (quick, default, extended; default holds quick's): tests'
    own phases only, without collection and start-up."""
    from tests.tiers import ci_tier, in_quick_tier

    totals = {"quick": 0.0, "default": 0.0, "extended": 0.0}
    for nodeid, s in seconds.items():
        if nodeid in markers:
            totals[ci_tier(markers[nodeid])] += s
            totals["quick"] += s if in_quick_tier(markers[nodeid]) else 0.0
    return totals


def main(argv: list[str]) -> int:
    seconds = durations_s(Path(argv[0]).read_text(errors="replace"))
    count = int(argv[1]) if len(argv) > 1 else 20
    plugin = _Markers()
    pytest.main(["-qq", "--collect-only", "--extended", "-p", "no:cacheprovider"], plugins=[plugin])
    sys.stdout.write(table(seconds, plugin.by_nodeid, count) + "\n")
    totals = tier_totals_s(seconds, plugin.by_nodeid)
    sys.stdout.write("tests' own seconds by tier: " + ", ".join(f"{k} {v:.0f} s" for k, v in totals.items()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
