"""Imports in the tests: everything by its path from the repository root. Test helpers are
``tests.<module>`` (``from tests.models import make_lm``) and the launch/ scripts are ``launch.<room>.<script>``
(``from launch.bench import bench_executor``; README "``launch/``: the scripts, in rooms"); both directories are
namespace packages (no ``__init__.py``).

pytest's ``pythonpath = ["."]`` option (pyproject.toml) puts the repository root on ``sys.path`` however
pytest is started (``pytest``, ``python -m pytest``, from any directory). Test files that
also run as scripts run as modules from the root (``python -m tests.test_policy``), and tests that start a
script start it the same way (``python -m launch.gpu_check``, cwd the root).

Every test runs with one intra-op thread (``_one_intra_op_thread``): the tests' models are tiny, and on the
2-core machines CI uses a second thread costs more than it gives (the run without multi-rank jobs, then called
the quick tier, took 5:07 with torch's default threads and 4:48 with one, 2026-12-01); the multi-rank jobs start their ranks with ``OMP_NUM_THREADS=1``
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
# 2026-12-01, alone). Since 2026-12-02 they are part of the extended tier (below), which CI runs after the
# default run; ``pytest -m "not multirank"`` is the same as the default run.


# NOTE [The extended tier]
# The extended tier is every multi-rank job (``multirank``) and the tests marked ``extended``, the longest
# single-process jobs (the GPU check's dry run of its single-process parts). It is left out of the default run,
# which must stay under 15 minutes on 2 cores (with it the whole suite was 61% done after 15.5 minutes on a quiet
# 2-core machine, 2026-12-02), unless ``--extended`` is given (or CHAMELEON_EXTENDED=1): ``.ci/run`` runs the default tier,
# then ``pytest -q --extended -m "multirank or extended"``.
#
# NOTE [The test tiers]
# Three tiers, each picked by markers alone (``tests/tiers.py``):
# - quick (``pytest -q --quick``, under 4 minutes on 2 cores): the default tier without the tests marked
#   ``slow``, plus the tests marked ``quick``. It runs at least one test of every test module: at collection a
#   module the quick tier would leave with no test that runs without a GPU is an error (``quick_tier_gaps``),
#   checked whenever ``--quick`` is given and on every run of the whole suite (no paths given), so a new module
#   whose tests are all slow fails CI too. A module whose tests are all ``multirank`` marks one ``quick``.
# - default (``pytest -q``, the README's command, CI's first): every test but ``extended`` and ``multirank``.
# - extended (``pytest -q --extended -m "multirank or extended"``, CI's second).
# ``.ci/run`` runs the default tier, then the extended one: together every test once.
def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=False,
                     help="also run the tests marked extended (NOTE [The extended tier] in tests/conftest.py)")
    parser.addoption("--quick", action="store_true", default=False,
                     help="the quick tier: no slow, extended or multirank tests but those marked quick, at least one "
                          "test of every module (NOTE [The test tiers] in tests/conftest.py)")


def _check_quick_tier_covers_every_module(items) -> None:
    from tests.tiers import marker_names, quick_tier_gaps

    gaps = quick_tier_gaps((item.nodeid.split("::", 1)[0], marker_names(item)) for item in items)
    if gaps:
        raise pytest.UsageError(
            f"the quick tier runs no test of {', '.join(gaps)}: mark one test there quick, or one of its slow tests "
            "not slow (NOTE [The test tiers] in tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # (before -m and -k deselect: the check reads every collected test)
def pytest_collection_modifyitems(config, items):
    import os

    from tests.tiers import ci_tier, in_quick_tier, marker_names

    quick = config.getoption("--quick")
    extended = config.getoption("--extended") or os.environ.get("CHAMELEON_EXTENDED") == "1"
    if quick and extended:
        raise pytest.UsageError("--quick and --extended are two tiers: give one")
    if quick or config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        _check_quick_tier_covers_every_module(items)
    if extended:
        return
    kept, left_out = [], []
    for item in items:
        markers = marker_names(item)
        left = not in_quick_tier(markers) if quick else ci_tier(markers) == "extended"
        (left_out if left else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
