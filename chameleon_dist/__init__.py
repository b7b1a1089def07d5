"""chameleon-dist: activation swapping that keeps working when the operator sequence changes.

Importing this package initialises no CUDA and imports neither Megatron nor DeepSpeed; those live in
``chameleon_dist.integrations`` and load only when used. The names below load on first use, so tools
that need no torch (``chameleon-plan``) start fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Chameleon": "chameleon_dist.runtime",
    "ChameleonConfig": "chameleon_dist.config",
    "ConfigError": "chameleon_dist.config",
    "load_config": "chameleon_dist.config",
    "EmulatedDevice": "chameleon_dist.device.emulated",
    "CudaDevice": "chameleon_dist.device.cuda",
    "IterationReport": "chameleon_dist.report",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
