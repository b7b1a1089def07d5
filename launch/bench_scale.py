"""Old path of ``launch.experiments.bench_scale``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.bench_scale ...`` runs the new module as it ran before, and ``import launch.bench_scale`` gives the
new module itself. Use ``launch.experiments.bench_scale``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.experiments.bench_scale", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.experiments.bench_scale")
