"""Everything of DeepSpeed that the integration changes, declared in one place and checked at ``install``.

The integration leaves DeepSpeed's classes and modules as they are; it changes DeepSpeed *objects*: it wraps
bound methods on the engine instance, gives a ``PipelineEngine`` its own copy of the instruction map, writes
private counters and buffers when it resets a window for a replay, and calls a few private methods. Each of
those is an :class:`~chameleon_dist.patching.InstanceChange` below: the owner class, the attributes, how
they are changed, the DeepSpeed version range it was reviewed for and a fingerprint of the upstream code it
relies on. ``install`` runs :func:`verify_deepspeed` before it touches the engine, so a DeepSpeed release
outside the range, or one whose relied-on code changed, is refused with one error naming the installed
version and what to re-review, instead of breaking a replay silently. The opt-in fp16-on-CPU patch of the
CPU accelerator class is a :class:`~chameleon_dist.patching.Patch` (``cpu.py``), listed here as well.

Importing this module imports no DeepSpeed (the records are data); ``verify_deepspeed`` does.

To update after a DeepSpeed release: read the new code of each record's ``relies_on``, adjust the module
named in ``defined_in`` if needed, widen ``versions``, and set ``fingerprint`` to
``fingerprint_of_all(relied_on_code(record))``; ``tests/test_patching.py`` fails until then.
"""

from __future__ import annotations

from chameleon_dist.integrations.deepspeed.cpu import CPU_PATCHES
from chameleon_dist.patching import InstanceChange, Patch, verify_instance_changes

VERSIONS = ">=0.19,<0.20"
"""The DeepSpeed releases every record below was reviewed for (the fingerprints are of 0.19.8)."""

_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_PIPE = "deepspeed.runtime.pipe.engine:PipelineEngine"
_ZERO_1_2 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
_ZERO_3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
_ENGINE_PY = "chameleon_dist.integrations.deepspeed.engine"
_REPLAY_PY = "chameleon_dist.integrations.deepspeed.replay"
_PROTECT_PY = "chameleon_dist.integrations.deepspeed.protect"
_REVIEW = "DeepSpeed offers a callback for this, or the integration stops needing it"


def _change(name: str, owner: str, attributes: tuple[str, ...], how: str, relies_on: tuple[str, ...],
            fingerprint: str, defined_in: str, why: str, remove_when: str = _REVIEW) -> InstanceChange:
    return InstanceChange(name=name, owner=owner, attributes=attributes, how=how, relies_on=relies_on,
                          package="deepspeed", versions=VERSIONS, why=why, remove_when=remove_when,
                          fingerprint=fingerprint, defined_in=defined_in)


ENGINE_FORWARD = _change(
    "deepspeed-engine-forward-opens-window", _ENGINE, ("forward",), "wraps", (f"{_ENGINE}.forward",),
    "4b61dc0bbd6109d9", _ENGINE_PY,
    "The first training forward of an accumulation window opens the runtime's iteration; the k-th forward of "
    "the window enters micro-batch k. Wrapped on the engine instance (DeepSpeedChameleon.follow).",
    "DeepSpeed offers a per-micro-batch callback")
ENGINE_BACKWARD = _change(
    "deepspeed-engine-backward-names-micro-batch", _ENGINE, ("backward",), "wraps", (f"{_ENGINE}.backward",),
    "8b858ded9f15c181", _ENGINE_PY,
    "The k-th backward of the window enters micro-batch k, and an out-of-memory error in it is handled as the "
    "window's (replayed or discarded). Wrapped on the engine instance.",
    "DeepSpeed offers a per-micro-batch callback")
ENGINE_STEP = _change(
    "deepspeed-engine-step-closes-window", _ENGINE, ("step",), "wraps",
    (f"{_ENGINE}.step", f"{_ENGINE}.is_gradient_accumulation_boundary"), "d7b8637f7a663940", _ENGINE_PY,
    "engine.step() at the window's boundary (is_gradient_accumulation_boundary() before it) runs as the "
    "optimizer phase and closes the iteration. Wrapped on the engine instance.",
    "DeepSpeed offers an accumulation-boundary callback")
PIPE_TRAIN_BATCH = _change(
    "deepspeed-pipeline-train-batch-is-iteration", _PIPE, ("train_batch",), "wraps", (f"{_PIPE}.train_batch",),
    "5a62b05062bc7ae5", _ENGINE_PY,
    "One train_batch is one iteration; it is replayed from its start on the same micro-batches after an "
    "out-of-memory error. Wrapped on the engine instance (DeepSpeedChameleon.follow_pipeline).")
PIPE_DATA_ITERATOR = _change(
    "deepspeed-pipeline-data-iterator-recorded", _PIPE, ("data_iterator",), "writes",
    (f"{_PIPE}.train_batch", f"{_PIPE}._next_batch"), "5ad8950811f2eb37", _ENGINE_PY,
    "While a train_batch runs, the engine's own data iterator is a ReplayIterator over it (what _next_batch "
    "reads), so a replay trains on the same micro-batches; the original is put back after the batch.")
PIPE_INSTRUCTION_MAP = _change(
    "deepspeed-pipeline-instruction-map-copied", _PIPE, ("_INSTRUCTION_MAP",), "replaces",
    (f"{_PIPE}._INSTRUCTION_MAP", f"{_PIPE}._exec_schedule", f"{_PIPE}._exec_forward_pass",
     f"{_PIPE}._exec_backward_pass", f"{_PIPE}._exec_optimizer_step"), "6dd747df69ff9570", _ENGINE_PY,
    "_exec_schedule runs each instruction through self._INSTRUCTION_MAP; the engine gets its own copy (an "
    "instance attribute; the class's map is untouched) in which the k-th ForwardPass and BackwardPass of a "
    "batch name micro-batch k (their buffer_id is a reused buffer) and OptimizerStep runs as the optimizer "
    "phase.", "DeepSpeed's pipeline schedule offers per-instruction callbacks")
PIPE_RECEIVE_BUFFERS = _change(
    "deepspeed-pipeline-receive-buffers-protected", _PIPE, ("pipe_recv_buf", "grad_layer", "meta_buffer"), "reads",
    (f"{_PIPE}._exec_recv_activations", f"{_PIPE}._exec_recv_grads"), "9504e44293b05728", _PROTECT_PY,
    "The receive buffers a stage reuses for every micro-batch are protected from the swap path the moment "
    "RecvActivation / RecvGrad made them (their entries in the engine's copy of the instruction map are "
    "wrapped) and at every iteration's start.", "DeepSpeed marks its reused p2p buffers")
ENGINE_COUNTERS = _change(
    "deepspeed-engine-window-counters-restored", _ENGINE,
    ("micro_steps", "global_steps", "global_samples", "skipped_steps", "_unmanaged_backward_count",
     "_running_engine_step", "tput_timer", "timers"), "writes",
    (f"{_ENGINE}.backward", f"{_ENGINE}.step", f"{_ENGINE}._take_model_step",
     f"{_ENGINE}.is_gradient_accumulation_boundary"), "9ee3a3099d90ed6b", _REPLAY_PY,
    "A replayed (or discarded) window puts back the counters the failed attempt advanced (WindowStart, "
    "reset_window) and clears the step flag a step that raised left set.")
THROUGHPUT_TIMER = _change(
    "deepspeed-throughput-timer-counters-restored", "deepspeed.utils.timer:ThroughputTimer",
    ("micro_step_count", "global_step_count", "started"), "writes",
    ("deepspeed.utils.timer:ThroughputTimer.start", "deepspeed.utils.timer:ThroughputTimer.stop"),
    "c5fbf8e66a61f9d7", _REPLAY_PY,
    "The throughput timer's counts go back to the window's start, and a start the failed attempt never "
    "stopped is cleared.")
WALL_CLOCK_TIMERS = _change(
    "deepspeed-wall-clock-timers-stopped", "deepspeed.utils.timer:SynchronizedWallClockTimer.Timer",
    ("started_", "stop"), "calls",
    ("deepspeed.utils.timer:SynchronizedWallClockTimer.Timer.start",
     "deepspeed.utils.timer:SynchronizedWallClockTimer.Timer.stop"), "9438c9da4261a78d", _REPLAY_PY,
    "Timers the failed attempt started and never stopped are stopped (start asserts not started_).")
BACKWARD_HOOK_STATE = _change(
    "deepspeed-zero-backward-hook-state-reset", "deepspeed.runtime.base_optimizer:BackwardHookStateManager",
    ("_backward_hook_state", "reset_for_new_step", "backward_active_depth", "remaining_grad_acc_hooks"), "writes",
    ("deepspeed.runtime.base_optimizer:ZeROOptimizer.__init__",
     "deepspeed.runtime.base_optimizer:BackwardHookStateManager.__init__",
     "deepspeed.runtime.base_optimizer:BackwardHookStateManager.reset_for_new_step"), "192fd54faff116e2", _REPLAY_PY,
    "A backward that raised never ran its epilogue: the ZeRO optimizers' backward bookkeeping is reset.")
ZERO_1_2_RESET = _change(
    "deepspeed-zero-1-2-window-reset", _ZERO_1_2,
    ("micro_step_id", "averaged_gradients", "all_grad_tensors", "cpu_offload", "_offload_accumulated_param_ids",
     "ipg_buckets", "index", "extra_large_param_to_reduce", "previous_reduced_grads", "params_already_reduced",
     "_epilogue_ran_this_backward", "grad_accum", "_release_preflattened_grad_buffers", "reset_cpu_buffers",
     "_release_ipg_buffers", "reset_partition_gradient_structures", "INITIAL_MICRO_STEP_ID"), "writes",
    (f"{_ZERO_1_2}.__init__", f"{_ZERO_1_2}.zero_grad", f"{_ZERO_1_2}.step", f"{_ZERO_1_2}._release_ipg_buffers",
     f"{_ZERO_1_2}._release_preflattened_grad_buffers", f"{_ZERO_1_2}.reset_cpu_buffers",
     f"{_ZERO_1_2}.reset_partition_gradient_structures", f"{_ZERO_1_2}.independent_gradient_partition_epilogue",
     "deepspeed.runtime.zero.stage_1_and_2:IPGBucket.clear"),
    "fd6116830730ab8a", _REPLAY_PY,
    "A replayed window discards what the failed attempt accumulated and reduced, as the step's overflow path "
    "does, plus the reduction state a backward that raised half way left (ipg buckets, "
    "params_already_reduced, the contiguous partition buffer).")
ZERO_3_RESET = _change(
    "deepspeed-zero-3-window-reset", _ZERO_3,
    ("micro_step_id", "_epilogue_ran_this_backward", "_offload_boundary_param_ids", "offload_optimizer",
     "reset_cpu_buffers", "averaged_gradients", "grad_partitions_flat_buffer", "ipg_buckets", "clear_params",
     "params_already_reduced", "parameter_offload", "persistent_parameters"), "writes",
    (f"{_ZERO_3}.__init__", f"{_ZERO_3}._setup_for_real_optimizer", f"{_ZERO_3}.zero_grad", f"{_ZERO_3}.step",
     f"{_ZERO_3}.independent_gradient_partition_epilogue", f"{_ZERO_3}.reset_cpu_buffers",
     "deepspeed.runtime.zero.stage3:IPGBucketZ3.clear_params"), "e22d13fc22f54295", _REPLAY_PY,
    "A replayed window zeroes ZeRO-3's gradient partitions and clears its ipg buckets and "
    "params_already_reduced, as its step does.")
ZERO_3_FORWARD_STATE = _change(
    "deepspeed-zero-3-forward-state-released", _OFFLOAD,
    ("FWD_MODULE_STACK", "_in_forward", "release_backward_leftovers", "partition_all_parameters",
     "get_param_coordinator"), "writes",
    (f"{_OFFLOAD}:ZeROOrderedDict.__init__", f"{_OFFLOAD}:DeepSpeedZeRoOffload.setup_zero_stage3_hooks",
     f"{_OFFLOAD}:DeepSpeedZeRoOffload.release_backward_leftovers",
     f"{_OFFLOAD}:DeepSpeedZeRoOffload.partition_all_parameters",
     f"{_OFFLOAD}:DeepSpeedZeRoOffload.get_param_coordinator"), "13a187c2f3c24810", _REPLAY_PY,
    "The parameters a forward or backward that raised left gathered are released as the step releases them, "
    "ZeRO-3's module stack (FWD_MODULE_STACK, a module-level list, edited in place) loses what the failed "
    "forward pushed, and each ZeROOrderedDict leaves its forward.")
ZERO_3_TRACE = _change(
    "deepspeed-zero-3-partial-trace-invalidated",
    "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator",
    ("is_invalid_trace", "_invalidate_trace"), "calls",
    ("deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator.is_invalid_trace",
     "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator._invalidate_trace"),
    "161e9dca8c696912", _REPLAY_PY,
    "The failed attempt's partial parameter trace must not become the prefetch order of the replay.")
PIPE_RESET = _change(
    "deepspeed-pipeline-window-reset", _PIPE,
    ("_force_grad_boundary", "pipe_buffers", "fwd_outputs", "total_loss", "total_additional_losses", "loss"),
    "writes", (f"{_PIPE}.__init__", f"{_PIPE}.train_batch", f"{_PIPE}._exec_schedule",
               f"{_PIPE}._exec_forward_pass", f"{_PIPE}._exec_optimizer_step"), "a12df9ec0b89a3cb", _REPLAY_PY,
    "A replayed train_batch drops the failed attempt's pipe buffers and losses (they hold its graphs).")
RNG_TRACKER = _change(
    "deepspeed-model-parallel-rng-restored",
    "deepspeed.runtime.activation_checkpointing.checkpointing:CudaRNGStatesTracker", ("get_states", "set_states"),
    "calls", ("deepspeed.runtime.activation_checkpointing.checkpointing:get_cuda_rng_tracker",
              "deepspeed.runtime.activation_checkpointing.checkpointing:CudaRNGStatesTracker.get_states",
              "deepspeed.runtime.activation_checkpointing.checkpointing:CudaRNGStatesTracker.set_states"),
    "05e6c44cfd3c04f6", _REPLAY_PY,
    "A replayed window starts from the random state its first attempt started from, DeepSpeed's "
    "model-parallel RNG tracker included.")

INSTANCE_CHANGES: tuple[InstanceChange, ...] = (
    ENGINE_FORWARD, ENGINE_BACKWARD, ENGINE_STEP, PIPE_TRAIN_BATCH, PIPE_DATA_ITERATOR, PIPE_INSTRUCTION_MAP,
    PIPE_RECEIVE_BUFFERS, ENGINE_COUNTERS, THROUGHPUT_TIMER, WALL_CLOCK_TIMERS, BACKWARD_HOOK_STATE,
    ZERO_1_2_RESET, ZERO_3_RESET, ZERO_3_FORWARD_STATE, ZERO_3_TRACE, PIPE_RESET, RNG_TRACKER,
)
"""What ``install`` changes on DeepSpeed objects (see the module docstring)."""

PATCHES: tuple[Patch, ...] = CPU_PATCHES
"""DeepSpeed class attributes replaced (opt-in, by ``launch/train_deepspeed.py`` on CPU for an fp16 config)."""


def verify_deepspeed() -> None:
    """Refuse (:class:`~chameleon_dist.patching.PatchRefused`, naming the installed DeepSpeed version and what to
    re-review) when the installed DeepSpeed is outside the reviewed range or the code an instance change relies
    on changed; ``install`` calls it before it touches the engine."""
    verify_instance_changes(INSTANCE_CHANGES)
