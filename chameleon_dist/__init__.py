"""chameleon-dist: activation swapping that keeps working when the operator sequence changes.

Importing this package initialises no CUDA and imports neither Megatron nor DeepSpeed; those live in
``chameleon_dist.integrations`` and load only when used.
"""

from chameleon_dist.config import ChameleonConfig, ConfigError, load_config
from chameleon_dist.device import EmulatedDevice
from chameleon_dist.report import IterationReport
from chameleon_dist.runtime import Chameleon

__version__ = "0.1.0"

__all__ = [
    "Chameleon",
    "ChameleonConfig",
    "ConfigError",
    "CudaDevice",
    "EmulatedDevice",
    "IterationReport",
    "load_config",
]


def __getattr__(name: str):
    if name == "CudaDevice":
        from chameleon_dist.device.cuda import CudaDevice

        return CudaDevice
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
