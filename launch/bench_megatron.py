"""Old path of ``launch.bench.bench_megatron``: an alias kept for one release after issue 38 (launch/ in rooms).

``python -m launch.bench_megatron ...`` runs the new module as it ran before, and ``import launch.bench_megatron`` gives the
new module itself. Use ``launch.bench.bench_megatron``: this file goes in the next release.
"""

import importlib
import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("launch.bench.bench_megatron", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("launch.bench.bench_megatron")
