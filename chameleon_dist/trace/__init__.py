"""The shared vocabulary of profiler, policy and executor: traces of one training iteration."""

from chameleon_dist.trace.step_trace import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    OTHER,
    SCHEMA_VERSION,
    OpRecord,
    StepTrace,
    StorageRecord,
    SwapRecord,
    TensorRecord,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "OPTIMIZER",
    "OTHER",
    "SCHEMA_VERSION",
    "OpRecord",
    "StepTrace",
    "StorageRecord",
    "SwapRecord",
    "TensorRecord",
]
