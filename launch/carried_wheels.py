"""Which of the carried packages in ``.whl/`` (``launch/gpu_wheels.sh``) a GPU image needs: those whose
distribution it lacks or holds in an older version (its own newer or equal ones are kept, not shadowed).

    python3 -m launch.carried_wheels .whl wheels   # the wheels to install, one path a line
    python3 -m launch.carried_wheels .whl sdists   # the source archives to build (DeepSpeed)

It runs before anything is installed, so it needs only the standard library (no ``packaging``): versions compare
by their release numbers.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

_SDIST = re.compile(r"^(?P<name>.+)-(?P<version>[0-9][^-]*)\.(tar\.gz|zip)$")


def canonicalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version (``2.13.0+cpu`` -> (2, 13, 0)); pre-release parts are ignored."""
    numbers = re.match(r"^\d+(\.\d+)*", version.split("+")[0])
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def name_and_version(path: Path) -> tuple[str, str]:
    """A wheel's or a source archive's distribution name and version, from its file name."""
    if path.name.endswith(".whl"):
        name, version = path.name.split("-")[:2]
        return canonicalize_name(name), version
    match = _SDIST.match(path.name)
    if match is None:
        raise ValueError(f"not a wheel or a source archive: {path.name}")
    return canonicalize_name(match["name"]), match["version"]


def needed(paths: list[Path]) -> list[Path]:
    """The files whose distribution is not installed, or installed older than the file."""
    chosen = []
    for path in paths:
        name, version = name_and_version(path)
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            chosen.append(path)
            continue
        if release(installed) < release(version):
            chosen.append(path)
    return chosen


def main(argv: list[str]) -> int:
    folder, kind = Path(argv[0]), argv[1]
    patterns = ("*.whl",) if kind == "wheels" else ("*.tar.gz", "*.zip")
    paths = sorted(p for pattern in patterns for p in folder.glob(pattern))
    for path in needed(paths):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
