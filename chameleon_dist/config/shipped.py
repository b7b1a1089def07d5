"""Where the data files shipped with the package are: ``CONFIGS_DIR``, the repository's ``configs/`` folder,
and the main job's default job file in it.

The package reaches it as ``chameleon_dist/configs``: in a checkout (and an editable install) that is a
link to ``../configs``; a wheel holds the files themselves (package data in ``pyproject.toml``). pip
installs packages unzipped, so the resource is a plain directory. The link is resolved, so in a checkout
paths (and messages naming them) read ``configs/...``.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

CONFIGS_DIR = Path(str(importlib.resources.files("chameleon_dist").joinpath("configs"))).resolve()
DEFAULT_JOB = CONFIGS_DIR / "jobs" / "train_gpt_cpu.yaml"  # chameleon-train's and chameleon-trace's defaults
