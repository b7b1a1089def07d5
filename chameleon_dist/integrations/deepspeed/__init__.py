"""DeepSpeed integration: ``initialize`` (``engine.py``), a drop-in for ``deepspeed.initialize`` that installs the
runtime from the config's ``"chameleon"`` block. Importing this package imports no DeepSpeed; ``engine.py``
imports it on first use of ``initialize``. Everything of DeepSpeed the integration wraps, replaces or writes on its
objects is declared, with the reviewed version range and a fingerprint, in ``upstream.py`` (checked by ``install``).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the submodule that defines it, loaded on first use (``cpu`` imports no DeepSpeed: patch definitions)
_LAZY = {"initialize": "engine", "install": "engine", "DeepSpeedChameleon": "engine", "CPU_PATCHES": "cpu"}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"chameleon_dist.integrations.deepspeed.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
