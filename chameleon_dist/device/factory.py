"""Build the ``Device`` a configuration asks for."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import torch

from chameleon_dist.device.base import Device
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.model import DeviceModel

if TYPE_CHECKING:
    from chameleon_dist.config import ChameleonConfig
    from chameleon_dist.config.budgets import NodeReading

logger = logging.getLogger(__name__)

UNBOUNDED_CAPACITY_BYTES = sys.maxsize


def accelerator_is_cuda() -> bool:
    """True when a CUDA accelerator is present (does not initialise it)."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and accelerator.type == "cuda"


def make_device(config: "ChameleonConfig", node: "NodeReading | None" = None) -> Device:
    """``device.kind``: "cuda", "emulated", or "auto" (CUDA when present, else the emulated device; always the
    emulated device with ``device.meta_tensors``, which a GPU cannot run). Its host pool's budget is
    ``host_memory_budget`` from ``node``, the machine as the runtime read it at start (``config/budgets.py``);
    without one, from the machine read now."""
    settings = config.device
    kind = settings.kind
    if kind == "auto":
        kind = "cuda" if accelerator_is_cuda() and not settings.meta_tensors else "emulated"
    pinned = kind == "cuda"  # (page-locked: RLIMIT_MEMLOCK)
    if node is None:
        host_budget_bytes = config.host_memory_budget_bytes(pinned=pinned)
    else:
        host_budget_bytes = node.host_budget_bytes(config.host_memory_budget, pinned=pinned)
    if kind == "cuda":
        from chameleon_dist.device.cuda import CudaDevice

        return CudaDevice(
            capacity_bytes=settings.capacity,
            host_memory_budget_bytes=host_budget_bytes,
            d2h_bytes_per_s=settings.d2h_bytes_per_s,
            h2d_bytes_per_s=settings.h2d_bytes_per_s,
            enforce_capacity=settings.enforce_capacity,
        )
    if settings.enforce_capacity:
        logger.debug("device.enforce_capacity: the emulated device always raises at device.capacity")
    capacity_bytes = settings.capacity
    if capacity_bytes is None:
        logger.info("emulated device without device.capacity: memory is metered but never runs out")
        capacity_bytes = UNBOUNDED_CAPACITY_BYTES
    return EmulatedDevice(capacity_bytes=capacity_bytes, host_memory_budget_bytes=host_budget_bytes,
                          model=DeviceModel.from_config(settings), meta_tensors=settings.meta_tensors,
                          caching_allocator=settings.caching_allocator,
                          expandable_segments=settings.expandable_segments)
