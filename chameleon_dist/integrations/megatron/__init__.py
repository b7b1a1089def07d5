"""Megatron-core integration.

``install`` (``install.py``) puts a runtime on one rank of a Megatron job, driven by Megatron's own schedule
(``schedule.py``: the patches that name each step's micro-batch). ``cuda_on_cpu`` holds the CPU shims
(patch definitions, imports no Megatron); ``gpt`` builds a small ``GPTModel`` on CPU; ``meta_models`` builds
``GPTModel`` at real LLM shapes on meta tensors and runs Megatron's schedule over it (``meta_routing``: the MoE routing
it draws on the CPU, patch definitions, imports no Megatron). The modules that import Megatron-core are loaded on first
use only.
"""

from __future__ import annotations

import importlib
from typing import Any

from chameleon_dist.integrations.megatron.cuda_on_cpu import CPU_PATCHES, CudaLiteralsToCpu

_LAZY = {
    **dict.fromkeys(("build_gpt", "gpt_loss", "megatron_cpu_session", "synthetic_batch", "CpuSession"), "gpt"),
    **dict.fromkeys(("install", "installed", "MegatronChameleon", "RankOutOfMemoryError"), "install"),
    **dict.fromkeys(("build_meta_gpt", "megatron_meta_session", "meta_schedule_step", "meta_build_of", "MetaBuild"),
                    "meta_models"),
}

__all__ = ["CPU_PATCHES", "CudaLiteralsToCpu", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"chameleon_dist.integrations.megatron.{_LAZY[name]}"), name)
        # importing the submodule ``install`` bound the package's name ``install`` to the module; bind the name
        # asked for instead, so that ``from chameleon_dist.integrations.megatron import install`` (the README's
        # three lines) gives the function, not the module
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
