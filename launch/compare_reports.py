"""Old path of ``launch.bench.compare_reports``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.compare_reports ...`` runs the new module as it ran before, and ``import launch.compare_reports`` gives the
new module itself. Use ``launch.bench.compare_reports``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.bench.compare_reports", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.bench.compare_reports")
