"""Imports in the tests: everything by its path from the repository root. Test helpers are
``tests.<module>`` (``from tests.models import make_lm``) and the launch/ scripts are ``launch.<script>``
(``from launch import bench_executor``); both directories are namespace packages (no ``__init__.py``).

This puts the repository root on ``sys.path`` however pytest is started (``pytest``, ``python -m pytest``,
from any directory). Test files that also run as scripts (``python tests/test_policy.py``) put it there
themselves, since no conftest is loaded then."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# NOTE [The multi-rank tier]
# Tests marked ``ranks`` start multi-rank jobs (torchrun-style process groups of 2-4 ranks, each importing
# torch and a framework): minutes on a 2-core machine. The default run (the README's test command) leaves
# them out, so that it stays a few minutes; ``.ci/run`` runs them after it (``pytest -m ranks``). A test
# file named on the command line runs whole, its multi-rank tests included, and so does any ``-m``
# expression that names the marker.
def pytest_collection_modifyitems(config, items):
    if "ranks" in (config.option.markexpr or ""):
        return
    named = {Path(arg.split("::")[0]).resolve() for arg in config.args if arg.split("::")[0].endswith(".py")}
    kept, left = [], []
    for item in items:
        (left if item.get_closest_marker("ranks") and Path(str(item.path)).resolve() not in named else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
