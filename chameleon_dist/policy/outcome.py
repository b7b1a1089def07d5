"""What the runtime tells the ``PolicyController`` about an iteration (``IterationOutcome``) and what the
controller tells it to change after an out-of-memory error (``RetryAction``, with its ``RetryCause``).

They live apart from the controller (``policy/selection.py``) so that the trial rules (``policy/trials.py``)
can read an outcome without importing the controller.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from chameleon_dist.policy.model import Policy
from chameleon_dist.trace.stages import RetryCause, Stage
from chameleon_dist.trace.swap_figures import SwapFigures


@dataclasses.dataclass(frozen=True)
class IterationOutcome:
    """What one completed iteration did, as the controller needs it. ``swaps`` is what the executor did in
    the attempt that completed (the record the iteration's report holds: every count of ``SwapFigures``,
    ``passive_swaps`` also readable as ``outcome.passive_swaps``); ``oom_retries`` counts the attempts that
    did not complete, and ``failed_attempt_passive_swaps`` the passive swaps they needed (they still mean
    the policy did not hold)."""

    iteration: int
    stage: Stage
    policy: Policy | None  # the policy the iteration started with (None: every eligible tensor swapped)
    peak_device_bytes: int  # the whole iteration's (the report's ``peak_device_bytes``)
    iteration_s: float
    stall_s: float  # the whole iteration's, failed attempts included
    attempt_stall_s: float  # the completed attempt's
    oom_retries: int
    profiled: bool  # a detailed trace of this iteration was recorded (WarmUp)
    swaps: SwapFigures = dataclasses.field(default_factory=SwapFigures)  # the completed attempt's counts
    saved_bytes: int = 0  # bytes autograd saved for backward in the completed attempt
    passive_swap_bytes: int = 0  # bytes passive swap moved in the completed attempt (0: none, or not known)
    failed_attempt_passive_swaps: int = 0  # passive swaps of the attempts that did not complete (never absorbed)
    saved_bytes_by_layer: Mapping[int, int] = dataclasses.field(default_factory=dict)  # saved_bytes per layer (-1: none)

    @property
    def passive_swaps(self) -> int:
        """``swaps.passive_swaps``: kept tensors the completed attempt swapped out under memory pressure."""
        return self.swaps.passive_swaps


@dataclasses.dataclass(frozen=True)
class RetryAction:
    """What the next attempt of an iteration that ran out of memory does differently, as the controller
    decided it (``PolicyController.on_out_of_memory``) and the executor applies it
    (``SwapExecutor.new_attempt``): its typed ``cause`` and the settings the retry runs with."""

    cause: RetryCause
    min_swap_bytes: int  # the executor's ``min_swap_bytes`` for the retry (lowered for SMALL_TENSORS_KEPT)
    swap_everything: bool = False  # drop the applied policy for the rest of the iteration (it did not hold)
    wait_for_host: bool = False  # the host budget was full: the retry waits for host memory to come back
