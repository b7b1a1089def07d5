"""What an out-of-memory replay of one DeepSpeed gradient-accumulation window resets, so the window can run again
from its start (one rank; ``engine.py`` decides when to replay).

DeepSpeed zeroes every gradient after each optimizer step, so a window always starts with nothing accumulated:
a replay does not copy gradients anywhere, it discards what the failed attempt accumulated the way DeepSpeed's
own step does (its overflow path, ``zero_grad``) and puts back the counters the window advanced.

- ``WindowStart``: the engine counters a window advances before its boundary step (``micro_steps``, the
  throughput timer's counts; ``global_steps``/``global_samples``/``skipped_steps`` only move in the boundary
  step, kept for a step that failed half way) and the random state (CPU, the runtime's device, DeepSpeed's
  model-parallel RNG tracker), taken when the window starts.
- ``reset_window``: every gradient the window accumulated, per optimizer (see its docstring), the ZeRO
  reduction and backward-hook bookkeeping, ZeRO-3's gathered parameters and forward stack, the pipeline
  engine's buffers, and the counters (from a ``WindowStart``, or the last window boundary without one).
- ``ReplayIterator``: the micro-batches ``PipelineEngine.train_batch`` took, fed again on the replay.
- ``WindowDiscardedOutOfMemoryError``: the user's own loop ran out of memory; the window was discarded.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Iterator

import torch

from chameleon_dist.device.base import Device
from chameleon_dist.retry import RandomState

logger = logging.getLogger(__name__)

_ENGINE_COUNTERS = ("micro_steps", "global_steps", "global_samples", "skipped_steps", "_unmanaged_backward_count")
_THROUGHPUT_COUNTERS = ("micro_step_count", "global_step_count")


class WindowDiscardedOutOfMemoryError(torch.OutOfMemoryError):
    """Out of memory in a window run by the user's own loop: the window's gradients were discarded (the optimizer
    did not step on them) and the next window starts clean. ``engine.chameleon.run_window(closure)`` replays a
    window instead."""


def _rng_tracker() -> Any:
    try:
        from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    except ImportError:  # pragma: no cover - an older DeepSpeed
        return None
    return get_cuda_rng_tracker()


class WindowStart:
    """The engine counters and random state of a window's start; ``restore`` puts them back for a replay."""

    def __init__(self, engine: Any, device: Device) -> None:
        self.counters = {name: getattr(engine, name) for name in _ENGINE_COUNTERS}  # (upstream.ENGINE_COUNTERS)
        timer = getattr(engine, "tput_timer", None)
        self.throughput = {name: getattr(timer, name) for name in _THROUGHPUT_COUNTERS if hasattr(timer, name)}
        self.random = RandomState(device)
        tracker = _rng_tracker()
        self.tracker_states = tracker.get_states() if tracker is not None else None

    def restore(self, engine: Any) -> None:
        """Counters and random state as the window began."""
        for name, value in self.counters.items():
            setattr(engine, name, value)
        timer = getattr(engine, "tput_timer", None)
        for name, value in self.throughput.items():
            setattr(timer, name, value)
        self.random.restore()
        if self.tracker_states is not None:
            _rng_tracker().set_states(dict(self.tracker_states))


class ReplayIterator:
    """Wraps ``train_batch``'s data iterator: records the items taken, and after ``rewind`` yields them again
    before taking new ones, so a replayed batch trains on exactly the same micro-batches."""

    def __init__(self, source: Iterator) -> None:
        self.source = source
        self.taken: list[Any] = []
        self._again: collections.deque = collections.deque()

    def __iter__(self) -> "ReplayIterator":
        return self

    def __next__(self) -> Any:
        if self._again:
            return self._again.popleft()
        item = next(self.source)
        self.taken.append(item)
        return item

    def rewind(self) -> None:
        self._again = collections.deque(self.taken)


def _zero_grads(engine: Any) -> None:
    """Every gradient accumulated since the last step, dropped as DeepSpeed's own step drops it."""
    for parameter in engine.module.parameters():  # ZeRO-0 (a torch optimizer): engine.zero_grad()
        parameter.grad = None  # first: ZeRO-3's zero_grad calls record_stream on a gradient it finds
        if hasattr(parameter, "grad_accum"):
            parameter.grad_accum = None
    optimizer = engine.optimizer
    if hasattr(optimizer, "zero_grad") and optimizer is not getattr(engine, "basic_optimizer", None):
        # ZeRO 1/2: param.grad and grad_accum; ZeRO-3: param.grad, micro_step_id = 0 (the first reduce copies
        # into the partitions); BF16_Optimizer: bf16 grads and its fp32 accumulators; FP16_Optimizer: grads
        optimizer.zero_grad(set_to_none=True)


def _reset_hook_state(optimizer: Any) -> None:
    """ZeRO's backward bookkeeping: a backward that raised never ran its epilogue (``exit_backward``)."""
    state = getattr(optimizer, "_backward_hook_state", None)
    if state is None:
        return
    state.reset_for_new_step()
    state.backward_active_depth = 0
    state.remaining_grad_acc_hooks = 0


def _reset_zero_1_2(optimizer: Any) -> None:
    """``DeepSpeedZeroOptimizer``: what its step's overflow path discards, and the reduction state a backward
    that raised half way left (ipg buckets, ``params_already_reduced``, the contiguous partition buffer)."""
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    optimizer.micro_step_id = INITIAL_MICRO_STEP_ID
    optimizer._release_preflattened_grad_buffers()
    for key in list(optimizer.averaged_gradients.keys()):
        optimizer.averaged_gradients[key] = None
    for key in list(optimizer.all_grad_tensors.keys()):
        optimizer.all_grad_tensors[key] = None
    if optimizer.cpu_offload:
        optimizer.reset_cpu_buffers()
        optimizer._offload_accumulated_param_ids = set()
    for bucket in optimizer.ipg_buckets.values():
        bucket.clear()
        bucket.index = 0
    optimizer.extra_large_param_to_reduce.clear()
    optimizer._release_ipg_buffers()  # grads_in_partition, its offset, ready_for_gradients
    for dtype in optimizer.previous_reduced_grads:
        optimizer.previous_reduced_grads[dtype].clear()
    for index in range(len(optimizer.params_already_reduced)):
        optimizer.params_already_reduced[index] = False
    optimizer.reset_partition_gradient_structures()
    optimizer._epilogue_ran_this_backward = False


def _reset_zero_3(optimizer: Any, module: torch.nn.Module) -> None:
    """``DeepSpeedZeroOptimizer_Stage3``: grad partitions, ipg buckets, ``params_already_reduced``; and the
    parameters a forward or backward that raised left gathered, the coordinator's trace, and
    ``FWD_MODULE_STACK``, released as its step releases them (persistent parameters gathered again)."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    optimizer.micro_step_id = 0  # zero_grad did so too
    optimizer._epilogue_ran_this_backward = False
    optimizer._offload_boundary_param_ids = set()
    if optimizer.offload_optimizer:
        optimizer.reset_cpu_buffers()
    else:
        optimizer.averaged_gradients = {}
    if optimizer.grad_partitions_flat_buffer is not None:
        optimizer.grad_partitions_flat_buffer.zero_()
    for bucket in optimizer.ipg_buckets.values():
        bucket.clear_params()
    for key in optimizer.params_already_reduced:
        optimizer.params_already_reduced[key] = False

    for submodule in module.modules():
        if isinstance(submodule._parameters, ZeROOrderedDict):
            submodule._parameters._in_forward = False
    inside = set(map(id, module.modules())) - {id(module)}
    stack, seen_root = [], False  # the root stays once (pushed at setup); what the failed forward pushed goes
    for entry in parameter_offload.FWD_MODULE_STACK:
        if id(entry) in inside or (entry is module and seen_root):
            continue
        seen_root = seen_root or entry is module
        stack.append(entry)
    parameter_offload.FWD_MODULE_STACK[:] = stack

    offload = optimizer.parameter_offload
    coordinator = offload.get_param_coordinator()
    offload.release_backward_leftovers()
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()  # a partial trace must not become the prefetch order
    offload.partition_all_parameters()
    if optimizer.persistent_parameters:
        optimizer.persistent_parameters[0].all_gather(optimizer.persistent_parameters)


def _reset_pipeline(engine: Any) -> None:
    """``PipelineEngine``: the buffers and losses of the failed attempt's micro-batches (they hold its graphs)."""
    engine._force_grad_boundary = False
    for key, buffers in engine.pipe_buffers.items():
        engine.pipe_buffers[key] = [None] * len(buffers)
    engine.fwd_outputs = []
    engine.total_loss = None
    engine.total_additional_losses = None
    if isinstance(getattr(engine, "loss", None), torch.Tensor):
        engine.loss = engine.loss.detach()


def _stop_timers(engine: Any) -> None:
    """Timers the failed attempt started and never stopped (``start`` asserts they are stopped)."""
    for timer in getattr(getattr(engine, "timers", None), "timers", {}).values():
        if getattr(timer, "started_", False):
            timer.stop()
    if getattr(engine, "tput_timer", None) is not None:
        engine.tput_timer.started = False


def reset_window(engine: Any, start: WindowStart | None = None) -> None:
    """Reset ``engine`` to the start of its current gradient-accumulation window, so the window can run again
    (or the next one starts clean).

    Gradients, by optimizer: ZeRO-0 (a torch optimizer): ``param.grad``. ZeRO-1/2 (``DeepSpeedZeroOptimizer``):
    ``zero_grad``, ``averaged_gradients``, ``all_grad_tensors``, ipg buckets, ``extra_large_param_to_reduce``,
    ``grads_in_partition`` and its offset, ``params_already_reduced``, ``previous_reduced_grads``,
    ``micro_step_id``, the CPU-offload buffers. ZeRO-3: ``zero_grad``, ``grad_partitions_flat_buffer`` zeroed,
    ipg buckets, ``params_already_reduced``, ``averaged_gradients``. BF16_Optimizer: ``zero_grad`` (bf16 grads,
    the fp32 accumulators and their flags). All ZeRO optimizers: the backward-hook state.

    Counters: from ``start``; without one (the user's loop), ``micro_steps`` goes back to the last window
    boundary (managed accumulation; unmanaged, it only moves in ``step()``) and the backward count since the
    last ``step()`` to 0. ``start`` also restores the random state; without one it is left as it is.
    """
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    _stop_timers(engine)
    _zero_grads(engine)
    optimizer = engine.optimizer
    _reset_hook_state(optimizer)
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        _reset_zero_1_2(optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        _reset_zero_3(optimizer, engine.module)
    engine._running_engine_step = False
    pipeline = isinstance(engine, PipelineEngine)
    if pipeline:
        _reset_pipeline(engine)
    if start is not None:
        start.restore(engine)
    elif not pipeline:
        if engine.managed_gradient_accumulation():
            engine.micro_steps -= engine.micro_steps % engine.gradient_accumulation_steps()
        engine._unmanaged_backward_count = 0  # (unmanaged: each step() is a boundary)
    logger.debug("reset the accumulation window of %s (%s): micro_steps %d", type(engine).__name__,
                 type(optimizer).__name__, engine.micro_steps)
