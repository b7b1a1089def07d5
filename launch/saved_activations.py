"""Old path of ``launch.bench.saved_activations``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.saved_activations ...`` runs the new module as it ran before, and ``import launch.saved_activations`` gives the
new module itself. Use ``launch.bench.saved_activations``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.bench.saved_activations", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.bench.saved_activations")
