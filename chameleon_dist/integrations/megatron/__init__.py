"""Megatron-core integration.

``cuda_on_cpu`` holds the CPU shims (patch definitions, imports no Megatron); ``gpt`` builds and trains a
small ``GPTModel`` on CPU and imports Megatron-core, so its names are loaded on first use only.
"""

from __future__ import annotations

import importlib
from typing import Any

from chameleon_dist.integrations.megatron.cuda_on_cpu import CPU_PATCHES, CudaLiteralsToCpu

_LAZY_FROM_GPT = ("build_gpt", "gpt_loss", "megatron_cpu_session", "synthetic_batch", "CpuSession")

__all__ = ["CPU_PATCHES", "CudaLiteralsToCpu", *_LAZY_FROM_GPT]


def __getattr__(name: str) -> Any:
    if name in _LAZY_FROM_GPT:
        return getattr(importlib.import_module("chameleon_dist.integrations.megatron.gpt"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
