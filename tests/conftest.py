"""Imports in the tests: everything by its path from the repository root. Test helpers are
``tests.<module>`` (``from tests.models import make_lm``) and the launch/ scripts are ``launch.<script>``
(``from launch import bench_executor``); both directories are namespace packages (no ``__init__.py``).

pytest's ``pythonpath = ["."]`` option (pyproject.toml) puts the repository root on ``sys.path`` however
pytest is started (``pytest``, ``python -m pytest``, from any directory). Test files that
also run as scripts run as modules from the root (``python -m tests.test_policy``), and tests that start a
script start it the same way (``python -m launch.gpu_check``, cwd the root).

Every test runs with one intra-op thread (``_one_intra_op_thread``): the tests' models are tiny, and on the
2-core machines CI uses a second thread costs more than it gives (the quick tier below took 5:07 with torch's
default threads and 4:48 with one, 2026-12-01); the multi-rank jobs start their ranks with ``OMP_NUM_THREADS=1``
already."""

import pytest

from tests.scenario_models import one_thread


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    with one_thread():
        yield


# NOTE [The multi-rank tier]
# Tests marked ``multirank`` start multi-rank jobs (torchrun-style process groups of 2-4 ranks, each importing
# torch and a framework): about 5 of the suite's 11 minutes on a 2-core machine (10:43 on a fresh clone,
# 2026-12-01, alone). The README's test command runs them with the rest; ``pytest -m "not multirank"`` is the
# quick run (about 6 minutes; 7:16 with the optional transformers tests, 2026-12-01, alone).


# NOTE [The extended tier]
# Tests marked ``extended`` are the longest jobs: the GPU check's two dry runs (every part of
# launch/gpu_check.py on the emulated device, about 3 minutes together on a 2-core machine) and the multi-rank
# fault jobs (ranks killed mid-iteration under torchrun, ranks started with different settings). They are left
# out of the default run, which must stay under 15 minutes on 2 cores, unless ``--extended`` is given (or
# CHAMELEON_EXTENDED=1): ``.ci/run`` runs the default tier, then ``pytest -q --extended -m extended``.
def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=False,
                     help="also run the tests marked extended (NOTE [The extended tier] in tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    import os

    if config.getoption("--extended") or os.environ.get("CHAMELEON_EXTENDED") == "1":
        return
    kept, left_out = [], []
    for item in items:
        (left_out if item.get_closest_marker("extended") is not None else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
