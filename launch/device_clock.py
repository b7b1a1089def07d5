"""Old path of ``launch.bench.device_clock``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.device_clock ...`` runs the new module as it ran before, and ``import launch.device_clock`` gives the
new module itself. Use ``launch.bench.device_clock``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.bench.device_clock", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.bench.device_clock")
