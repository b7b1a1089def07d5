"""Old path of ``launch.bench.swap_variants``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.swap_variants ...`` runs the new module as it ran before, and ``import launch.swap_variants`` gives the
new module itself. Use ``launch.bench.swap_variants``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.bench.swap_variants", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.bench.swap_variants")
