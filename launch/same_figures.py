"""Old path of ``launch.bench.same_figures``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.same_figures ...`` runs the new module as it ran before, and ``import launch.same_figures`` gives the
new module itself. Use ``launch.bench.same_figures``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.bench.same_figures", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.bench.same_figures")
