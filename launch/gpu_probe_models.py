"""Old path of ``launch.models.gpu_probe_models``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.gpu_probe_models ...`` runs the new module as it ran before, and ``import launch.gpu_probe_models`` gives the
new module itself. Use ``launch.models.gpu_probe_models``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.models.gpu_probe_models", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.models.gpu_probe_models")
