"""Devices: the ``Device`` protocol and its one implementation ``StreamDevice`` over two backends: the real
``CudaDevice`` and the CPU ``EmulatedDevice`` (a simulated GPU).

``CudaDevice`` is imported lazily so that importing this package never touches CUDA.
"""

from chameleon_dist.device.base import CopyHandle, Device, byte_view
from chameleon_dist.device.cost import KernelCostModel, is_host_sync
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.factory import UNBOUNDED_CAPACITY_BYTES, make_device
from chameleon_dist.device.host_pool import HostBufferPool
from chameleon_dist.device.model import DeviceModel, measure_cpu_rates
from chameleon_dist.device.simulated.hazards import StreamHazardError
from chameleon_dist.device.simulated.backend import SimulatedBackend
from chameleon_dist.device.simulated.memory import EmulatedOutOfMemoryError, storage_key
from chameleon_dist.device.stream_device import StreamDevice
from chameleon_dist.device.presets import PRESETS, AcceleratorPreset

__all__ = [
    "AcceleratorPreset",
    "CopyHandle",
    "CudaDevice",
    "Device",
    "DeviceModel",
    "EmulatedDevice",
    "EmulatedOutOfMemoryError",
    "HostBufferPool",
    "KernelCostModel",
    "PRESETS",
    "SimulatedBackend",
    "StreamDevice",
    "StreamHazardError",
    "UNBOUNDED_CAPACITY_BYTES",
    "byte_view",
    "is_host_sync",
    "make_device",
    "storage_key",
    "measure_cpu_rates",
]


def __getattr__(name: str):
    if name == "CudaDevice":
        from chameleon_dist.device.cuda import CudaDevice

        return CudaDevice
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
