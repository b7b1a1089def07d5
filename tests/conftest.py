"""Imports in the tests: everything by its path from the repository root. Test helpers are
``tests.<module>`` (``from tests.models import make_lm``) and the launch/ scripts are ``launch.<script>``
(``from launch import bench_executor``); both directories are namespace packages (no ``__init__.py``).

pytest's ``pythonpath = ["."]`` option (pyproject.toml) puts the repository root on ``sys.path`` however
pytest is started (``pytest``, ``python -m pytest``, from any directory). Test files that
also run as scripts run as modules from the root (``python -m tests.test_policy``), and tests that start a
script start it the same way (``python -m launch.gpu_check``, cwd the root)."""


# NOTE [The multi-rank tier]
# Tests marked ``multirank`` start multi-rank jobs (torchrun-style process groups of 2-4 ranks, each importing
# torch and a framework): about 3 of the suite's 8 minutes on a 2-core machine. The README's test command runs
# them with the rest; ``pytest -m "not multirank"`` is the quick run (about 5 minutes).
