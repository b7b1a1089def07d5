"""Megatron's pipeline schedules tell the runtime which micro-batch and model chunk each step works on.

Every schedule of megatron-core (no pipelining, 1F1B, interleaved) runs a micro-batch's forward through the
module-level ``schedules.forward_step`` (which receives ``current_microbatch`` and ``vp_stage``, the
chunk) and its backward through ``schedules.backward_step`` (which receives the very object that
``forward_step`` returned for that micro-batch). The patches here wrap both, only while a wrapped
``forward_backward_func`` runs: a forward names its slot ``chunk * num_microbatches + micro_batch`` on the
runtime's ``MicroBatchClock``, and a backward finds the slot of its forward by that object's identity. The
profiler's traces and the executor's save sites then carry the schedule's identity, not a guess from
forward/backward turns (wrong under 1F1B, where the first stage runs F F B F B ... with ``pp`` micro-batches
in flight).

A third patch wraps ``GlobalMemoryBuffer.get_tensor``: Megatron's shared workspaces are handed out during
forward (and reused by the next layer), so each one is protected from swapping the moment it is handed
out, also in the first iteration, before any refresh could see it.

The ``Patch`` constants below are the reviewed definitions (what ``defined_patches`` lists and the
fingerprint tests check); ``schedule_patches(tracker)`` binds copies of them to one runtime's tracker.
Imports no Megatron.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable

import torch

from chameleon_dist.patching import Patch, unbound_replacement
from chameleon_dist.profiler.scope import MicroBatchClock

logger = logging.getLogger(__name__)

_NEEDS = "a runtime's ScheduleTracker: apply schedule_patches(tracker)"
"""What this module's Patch records need before they apply (``unbound_replacement``)."""

_MEGATRON_VERSIONS = ">=0.16,<0.17"


class ScheduleTracker:
    """Turns the schedule's forward and backward steps into micro-batch slots on ``clock`` and protects the
    workspaces Megatron hands out (``protect_now``). ``begin``/``end`` bracket one ``forward_backward_func``
    call (outside, e.g. in an evaluation call with ``forward_only=True``, the steps are not followed); the
    counts say how many steps were seen and how many backward steps could not be matched to their forward
    (then the clock keeps the last slot, and a warning is logged once)."""

    def __init__(self, clock: MicroBatchClock, protect_now: Callable[[torch.Tensor], None]) -> None:
        self.clock = clock
        self.protect_now = protect_now
        self._outputs: dict[int, tuple[Any, int]] = {}  # id(forward output) -> (the output, its slot)
        self._forwards_per_chunk: dict[int, int] = {}
        self.forward_steps = 0
        self.backward_steps = 0
        self.unmatched_backward_steps = 0
        self.following = False
        self._warned = False

    def begin(self) -> None:
        self._outputs.clear()
        self._forwards_per_chunk.clear()
        self.following = True

    def end(self) -> None:
        self.following = False
        self._outputs.clear()

    def on_forward(self, micro_batch: int | None, chunk: int | None, num_microbatches: int | None) -> int:
        """A forward step begins; returns its slot (also entered on the clock)."""
        chunk = chunk or 0
        seen = self._forwards_per_chunk.get(chunk, 0)
        self._forwards_per_chunk[chunk] = seen + 1
        micro_batch = seen if micro_batch is None else micro_batch
        slot = chunk * max(num_microbatches or 0, micro_batch + 1) + micro_batch
        self.forward_steps += 1
        self.clock.enter(slot)
        return slot

    def on_forward_output(self, output: Any, slot: int) -> None:
        self._outputs[id(output)] = (output, slot)

    def on_backward(self, output: Any) -> None:
        """A backward step begins for the forward that returned ``output``."""
        self.backward_steps += 1
        known = self._outputs.pop(id(output), None)
        if known is not None and known[0] is output:
            self.clock.enter(known[1])
            return
        self.unmatched_backward_steps += 1
        if not self._warned:
            self._warned = True
            logger.warning("a backward step's output was not returned by a forward step seen in this iteration: "
                           "its micro-batch is unknown (a custom schedule?); saves keep the last slot")


def _forward_step_replacement(original: Any, tracker: ScheduleTracker) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        if not tracker.following:
            return original(*args, **kwargs)
        given = signature.bind_partial(*args, **kwargs).arguments
        slot = tracker.on_forward(given.get("current_microbatch"), given.get("vp_stage"), given.get("num_microbatches"))
        result = original(*args, **kwargs)
        tracker.on_forward_output(result[0], slot)
        return result

    return forward_step


def _backward_step_replacement(original: Any, tracker: ScheduleTracker) -> Any:
    @functools.wraps(original)
    def backward_step(input_tensor: Any, output_tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if tracker.following:
            tracker.on_backward(output_tensor)
        return original(input_tensor, output_tensor, *args, **kwargs)

    return backward_step


def _get_tensor_replacement(original: Any, tracker: ScheduleTracker) -> Any:
    @functools.wraps(original)
    def get_tensor(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = original(self, *args, **kwargs)
        tracker.protect_now(tensor)
        return tensor

    return get_tensor


FORWARD_STEP_NAMES_MICRO_BATCH = Patch(
    name="megatron-forward-step-names-micro-batch",
    target="megatron.core.pipeline_parallel.schedules:forward_step",
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "Every schedule runs a micro-batch's forward through this function, which knows the micro-batch "
        "(current_microbatch) and the model chunk (vp_stage); the wrapper enters that slot on the runtime's "
        "MicroBatchClock, so traces and save sites follow the schedule under 1F1B and interleaving."
    ),
    remove_when="Megatron-core offers a hook or callback per forward/backward step with its micro-batch",
    fingerprint="24c526af44458ac2",
    make_replacement=unbound_replacement("megatron-forward-step-names-micro-batch", _NEEDS),
)

BACKWARD_STEP_NAMES_MICRO_BATCH = Patch(
    name="megatron-backward-step-names-micro-batch",
    target="megatron.core.pipeline_parallel.schedules:backward_step",
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "Counterpart of the forward hook: a backward step receives the object its forward step returned; the "
        "wrapper finds that forward's slot by identity and enters it before autograd runs."
    ),
    remove_when="Megatron-core offers a hook or callback per forward/backward step with its micro-batch",
    fingerprint="6ac4aa596b1b6261",
    make_replacement=unbound_replacement("megatron-backward-step-names-micro-batch", _NEEDS),
)

WORKSPACES_ARE_NEVER_SWAPPED = Patch(
    name="megatron-workspaces-never-swapped",
    target="megatron.core.utils:GlobalMemoryBuffer.get_tensor",
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "GlobalMemoryBuffer workspaces (sequence-parallel all-gathers, attention scratch) are reused by the "
        "next layer; the wrapper protects each one from the swap path when it is handed out, also in the "
        "first iteration."
    ),
    remove_when="Megatron-core marks its shared workspaces in a way the saved-tensor hooks can read",
    fingerprint="9b215610fda2e661",
    make_replacement=unbound_replacement("megatron-workspaces-never-swapped", _NEEDS),
)

SCHEDULE_PATCHES: tuple[Patch, ...] = (
    FORWARD_STEP_NAMES_MICRO_BATCH,
    BACKWARD_STEP_NAMES_MICRO_BATCH,
    WORKSPACES_ARE_NEVER_SWAPPED,
)

_REPLACEMENTS = {
    FORWARD_STEP_NAMES_MICRO_BATCH.name: _forward_step_replacement,
    BACKWARD_STEP_NAMES_MICRO_BATCH.name: _backward_step_replacement,
    WORKSPACES_ARE_NEVER_SWAPPED.name: _get_tensor_replacement,
}


def _bound(replace: Callable[[Any, ScheduleTracker], Any], tracker: ScheduleTracker) -> Callable[[Any], Any]:
    def make_replacement(original: Any) -> Any:
        return replace(original, tracker)

    return make_replacement


def schedule_patches(tracker: ScheduleTracker) -> tuple[Patch, ...]:
    """The schedule patches bound to ``tracker`` (apply them with ``apply_patches``)."""
    return tuple(dataclasses.replace(patch, make_replacement=_bound(_REPLACEMENTS[patch.name], tracker))
                 for patch in SCHEDULE_PATCHES)
