"""Old path of ``launch.experiments.scale_bound``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.scale_bound ...`` runs the new module as it ran before, and ``import launch.scale_bound`` gives the
new module itself. Use ``launch.experiments.scale_bound``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.experiments.scale_bound", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.experiments.scale_bound")
