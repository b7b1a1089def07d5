"""``IterationReport``: what one training iteration did, as the runtime saw it."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class IterationReport:
    """One iteration. Byte counts are device bytes unless named ``host``; ``emulated`` marks CPU figures.

    ``stage`` is the stage the iteration ran in ("warmup", "gen_policy", "stable"). ``num_ops`` is the
    number of aten ops in its signature; ``sequence_changed`` says whether the sequence differs at all from
    the reference, ``sequence_change_major`` whether the difference needs a new policy (and sent the
    runtime back to WarmUp), ``stage_transition`` what changed stage after this iteration, and why."""

    iteration: int
    enabled: bool  # chameleon.enabled: false means measured only, nothing swapped
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
    num_ops: int
    sequence_changed: bool
    sequence_change_major: bool
    sequence_cosine: float
    sequence_length_change: float  # relative, among ops inside autograd
    saved_bytes_change: float  # relative change of the bytes saved for backward
    stage_transition: str | None
    passive_swaps: int  # kept tensors swapped out synchronously because the device ran out of memory
    oom_retries: int
    emulated: bool
    pressure_waits: int = 0  # out-of-memory averted by waiting for in-flight swap-outs (their time is stall)
    policy: str = ""  # the policy applied ("" = swap every eligible tensor: WarmUp or no policy)
    matched_exact: int = 0
    matched_fuzzy: int = 0
    unmatched: int = 0  # saved storages a policy could not place confidently (kept on the device)
    on_demand_fetches: int = 0  # planned swap-ins that had not started when backward needed the tensor

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
