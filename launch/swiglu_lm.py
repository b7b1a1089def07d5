"""Old path of ``launch.models.swiglu_lm``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.swiglu_lm ...`` runs the new module as it ran before, and ``import launch.swiglu_lm`` gives the
new module itself. Use ``launch.models.swiglu_lm``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.models.swiglu_lm", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.models.swiglu_lm")
