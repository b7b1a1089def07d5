"""Old path of ``launch.experiments.planner_calibration``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.planner_calibration ...`` runs the new module as it ran before, and ``import launch.planner_calibration`` gives the
new module itself. Use ``launch.experiments.planner_calibration``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.experiments.planner_calibration", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.experiments.planner_calibration")
