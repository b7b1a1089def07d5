"""Old path of ``launch.experiments.scale_report``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.scale_report ...`` runs the new module as it ran before, and ``import launch.scale_report`` gives the
new module itself. Use ``launch.experiments.scale_report``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.experiments.scale_report", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.experiments.scale_report")
