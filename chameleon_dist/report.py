"""``IterationReport``: what one training iteration did, as the runtime saw it."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class IterationReport:
    """One iteration. Byte counts are device bytes unless named ``host``; ``emulated`` marks CPU figures.

    ``stage`` is "disabled" (chameleon.enabled is false: measured only), or "baseline" (the swap-all
    executor of this release; the profiler's warmup / gen_policy / stable stages replace it).
    ``num_ops`` is the number of aten ops seen (emulated device only until the profiler lands), and
    ``sequence_changed`` is None until the profiler compares sequences."""

    iteration: int
    stage: str
    peak_device_bytes: int
    capacity_bytes: int
    memory_budget_bytes: int
    swap_out_bytes: int
    swap_in_bytes: int
    swapped_storages: int
    prefetched: int
    kept_on_device_bytes: int
    host_pool_bytes: int
    stall_s: float
    iteration_s: float
    policy_version: int
    num_ops: int | None
    sequence_changed: bool | None
    passive_swaps: int
    oom_retries: int
    emulated: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
