"""What the runtime tells the ``PolicyController`` about an iteration (``IterationOutcome``) and what the
controller tells it to change after an out-of-memory error (``RetryAction``).

They live apart from the controller (``policy/selection.py``) so that the trial rules (``policy/trials.py``)
can read an outcome without importing the controller.
"""

from __future__ import annotations

import dataclasses
import enum

from chameleon_dist.policy.model import Policy
from chameleon_dist.trace.stages import Stage


@dataclasses.dataclass(frozen=True)
class IterationOutcome:
    """What one completed iteration did, as the controller needs it. ``passive_swaps`` are those of the
    attempt that completed; ``oom_retries`` counts the attempts that did not."""

    iteration: int
    stage: Stage
    policy: Policy | None  # the policy the iteration started with (None: every eligible tensor swapped)
    peak_bytes: int
    iteration_s: float
    stall_s: float  # the whole iteration's, failed attempts included
    attempt_stall_s: float  # the completed attempt's
    passive_swaps: int
    oom_retries: int
    profiled: bool  # a detailed trace of this iteration was recorded (WarmUp)
    saved_bytes: int = 0  # bytes autograd saved for backward in the completed attempt
    passive_swap_bytes: int = 0  # bytes passive swap moved in the completed attempt (0: none, or not known)


class RetryAction(enum.StrEnum):
    """What the next attempt of an iteration that ran out of memory does differently."""

    SWAP_EVERYTHING = "swap_everything"  # the applied policy did not hold: drop it for this iteration
    WAIT_FOR_HOST = "wait_for_host"  # the host budget refused swaps: swapping more cannot help
    RETRY_AS_IS = "retry_as_is"  # already everything is swapped: a transient shortage may pass
    LOWER_MIN_SWAP = "lower_min_swap"  # swap smaller tensors too (``min_swap_bytes`` goes down)
