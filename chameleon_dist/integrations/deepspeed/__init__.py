"""DeepSpeed integration: ``initialize`` (``engine.py``), a drop-in for ``deepspeed.initialize`` that installs the
runtime from the config's ``"chameleon"`` block. Importing this package imports no DeepSpeed; ``engine.py``
imports it on first use of ``initialize``. Everything of DeepSpeed the integration wraps, replaces or writes on its
objects is declared, with the reviewed version range and a fingerprint, in ``upstream.py`` (checked by ``install``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["initialize", "DeepSpeedChameleon"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("chameleon_dist.integrations.deepspeed.engine"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
