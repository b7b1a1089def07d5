"""Old path of ``launch.bench.gpu_probes``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.gpu_probes ...`` runs the new module as it ran before, and ``import launch.gpu_probes`` gives the
new module itself. Use ``launch.bench.gpu_probes``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.bench.gpu_probes", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.bench.gpu_probes")
