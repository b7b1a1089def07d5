"""Old path of ``launch.experiments.reproduce_paper``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.reproduce_paper ...`` runs the new module as it ran before, and ``import launch.reproduce_paper`` gives the
new module itself. Use ``launch.experiments.reproduce_paper``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.experiments.reproduce_paper", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.experiments.reproduce_paper")
