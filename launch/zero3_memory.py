"""Old path of ``launch.experiments.zero3_memory``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.zero3_memory ...`` runs the new module as it ran before, and ``import launch.zero3_memory`` gives the
new module itself. Use ``launch.experiments.zero3_memory``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.experiments.zero3_memory", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.experiments.zero3_memory")
