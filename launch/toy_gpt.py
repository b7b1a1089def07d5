"""Old path of ``launch.models.toy_gpt``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.toy_gpt ...`` runs the new module as it ran before, and ``import launch.toy_gpt`` gives the
new module itself. Use ``launch.models.toy_gpt``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.models.toy_gpt", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.models.toy_gpt")
