"""The swap option: a coarse ``StepTrace`` of one pipeline stage of one rank, and the swap estimate on it.

Per micro-batch in flight the trace has one forward op and one backward op per layer, in the stage's
1F1B (or interleaved) order. Each layer's forward writes the layer's saved activations (the cost model's
tensors, each in its own storage; tiny ones merged), the layer's backward reads them, and the storages
die at the op after that. Tensor granularity matters: one storage per layer would need a whole layer's
copy to fit in one layer's compute, which on PCIe-class links it never does. The last stage adds one head op pair (final norm, output layer and
the fp32 logits). Live bytes per op are the stage's model state and workspace, the storages alive after
the op, and the transients of the op (gradients being produced, a rebuilt attention core). Op durations come from the planner's cost model (``op_times_s``), so the simulator's copy
windows are the planner's compute and communication times.

What leaves the device to fit the usable device memory, and the stall, come from ``swap_prefix``: the shortest
prefix of a fixed order of the trace's saved storages that fits, replayed conservatively, so that more memory
or a faster host link never gives a slower or infeasible estimate (the runtime's policy generator, a
heuristic, does not promise that). Stages with many micro-batches are simulated with fewer (the schedule's
steady state repeats) and the stall and the swapped bytes are scaled by the micro-batch ratio.
"""

from __future__ import annotations

import dataclasses
import enum
import logging

from chameleon_dist.planner.layout import FORWARD_STEP, Layout, RecomputeMode, in_flight_chunks, schedule
from chameleon_dist.planner.memory import SavedTensor, StageMemory, head_activations, layer_activations
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup
from chameleon_dist.planner.timing import StageTiming
from chameleon_dist.planner.swap_prefix import estimate_prefix
from chameleon_dist.policy.model import Infeasibility
from chameleon_dist.trace.step_trace import BACKWARD, FORWARD, OpRecord, StepTrace, StorageRecord, TensorRecord

logger = logging.getLogger(__name__)

OP_NAMES = ("layer_forward", "layer_backward", "head_forward", "head_backward")
EXTRA_SIMULATED_MICRO_BATCHES = 4  # beyond those in flight; enough to reach the steady state


class StageInfeasibility(enum.StrEnum):
    """Why a stage cannot fit before the swap estimate is even run (the estimate's own causes are
    ``Infeasibility``)."""

    STATIC_ABOVE_DEVICE = "static_above_device"  # model state, workspace and transients alone exceed the device


SwapInfeasibility = Infeasibility | StageInfeasibility


@dataclasses.dataclass(frozen=True)
class SwapEstimate:
    stage: int
    feasible: bool
    stall_s: float  # per iteration, extrapolated to every micro-batch
    peak_bytes: int  # predicted device peak with the policy, transients included
    budget_bytes: int  # what the policy had to fit the iteration in
    swapped_bytes: int  # moved to the host per iteration (extrapolated)
    micro_batches_simulated: int
    reason: str = ""  # why it does not fit, in words
    policy_summary: str = ""
    infeasibility: SwapInfeasibility | None = None  # why it does not fit, for code to branch on (None: it fits)
    host_bytes: int = 0  # most swapped bytes one rank of the stage holds in host memory at once

    def to_dict(self) -> dict:
        """The plan JSON's form: ``reason`` carries the cause in words; the typed cause is left out so that
        the JSON stays as it was before it existed."""
        data = dataclasses.asdict(self)
        del data["infeasibility"]
        return data


def build_stage_trace(memory: StageMemory, timing: StageTiming, layout: Layout, num_micro_batches: int,
                      last_stage: bool, layer_tensor_bytes: tuple[int, ...] | None = None,
                      head_tensor_bytes: tuple[int, ...] | None = None) -> tuple[StepTrace, list[float]]:
    """The stage's coarse trace and its per-op durations (see the module docstring). A layer's (and the
    head's) activation is one storage, or one storage per entry of ``layer_tensor_bytes``
    (``head_tensor_bytes``), which lets the policy move part of a layer."""
    layer_parts = layer_tensor_bytes or (memory.layer_stored_bytes,)
    head_parts = head_tensor_bytes or (memory.head_bytes,)
    layers_per_chunk = timing.layers_per_stage // layout.vpp
    static = memory.static_bytes
    ops: list[OpRecord] = []
    times: list[float] = []
    tensors: list[TensorRecord] = []
    storages: list[StorageRecord] = []
    saves: list[tuple[int, int]] = []
    produced: dict[tuple[int, int], tuple[int, ...]] = {}  # (micro-batch, layer label) -> tensor ids
    head_label = timing.layers_per_stage

    def forward(micro_batch: int, label: int, parts: tuple[int, ...], name_id: int, op_s: float) -> None:
        index = len(ops)
        ids = []
        for nbytes in parts:
            tensor_id = len(tensors)
            storages.append(StorageRecord(tensor_id, nbytes, created_at=index, freed_at=-1))
            tensors.append(TensorRecord(tensor_id, tensor_id, "bfloat16", (nbytes,), nbytes, False, True))
            saves.append((tensor_id, index + 1))
            ids.append(tensor_id)
        ops.append(OpRecord(name_id, FORWARD, micro_batch, -1, label, (), tuple(ids), 0))
        produced[(micro_batch, label)] = tuple(ids)
        times.append(op_s)

    def backward(micro_batch: int, label: int, name_id: int, op_s: float) -> None:
        ids = produced.pop((micro_batch, label))
        ops.append(OpRecord(name_id, BACKWARD, micro_batch, -1, label, ids, (), 0))
        for tensor_id in ids:
            storages[tensor_id].freed_at = len(ops)  # dies at the op after its use
        times.append(op_s)

    for kind, micro_batch, chunk in schedule(memory.stage, layout.pp, layout.vpp, num_micro_batches):
        labels = range(chunk * layers_per_chunk, (chunk + 1) * layers_per_chunk)
        with_head = last_stage and chunk == layout.vpp - 1
        if kind == FORWARD_STEP:
            for label in labels:
                forward(micro_batch, label, layer_parts, 0, timing.layer.forward_op_s)
            if with_head:
                forward(micro_batch, head_label, head_parts, 2, timing.head_forward_s)
        else:
            if with_head:
                backward(micro_batch, head_label, 3, timing.head_backward_s)
            for label in reversed(labels):
                backward(micro_batch, label, 1, timing.layer.backward_op_s)
    for storage in storages:
        if storage.freed_at > len(ops) or storage.freed_at < 0:
            storage.freed_at = len(ops)
    delta = [0] * (len(ops) + 1)
    for storage in storages:
        delta[storage.created_at] += storage.nbytes
        delta[storage.freed_at] -= storage.nbytes
    extra = {0: memory.forward_extra_bytes, 1: memory.backward_extra_bytes, 2: 0, 3: memory.head_extra_bytes}
    backward_ops = sum(op.phase == BACKWARD for op in ops)
    running = done = 0
    for index, op in enumerate(ops):
        running += delta[index]
        if op.phase == BACKWARD:  # gradients that are not a persistent buffer appear as backward proceeds
            done += 1
        grads = memory.transient_grads_bytes * done // max(1, backward_ops)
        op.live_bytes = static + running + extra[op.name_id] + grads
    trace = StepTrace(
        iteration=0, op_names=list(OP_NAMES), module_paths=[], ops=ops, tensors=tensors, storages=storages,
        swaps=[], iteration_s=sum(times), start_live_bytes=static, saves=saves, emulated=False,
    )
    return trace, times


def storage_parts(tensors: tuple[SavedTensor, ...], skip_core: bool = False) -> tuple[int, ...]:
    """Storage sizes for the trace: each saved tensor, the small ones (< 1% of the total) merged."""
    kept = [t.nbytes for t in tensors if not (skip_core and t.core)]
    floor = sum(kept) // 100
    big = tuple(n for n in kept if n >= floor)
    small = sum(n for n in kept if n < floor)
    return big + ((small,) if small else ())


def _simulated_count(layout: Layout, stage: int, num_micro_batches: int) -> int:
    """Micro-batches to simulate: all of them, or a short run past the steady state (a multiple of PP
    under interleaving)."""
    step = layout.pp if layout.vpp > 1 else 1
    in_flight = -(-in_flight_chunks(stage, layout.pp, layout.vpp, num_micro_batches) // layout.vpp)
    return min(num_micro_batches, -(-(in_flight + EXTRA_SIMULATED_MICRO_BATCHES) // step) * step)


def estimate_swap(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout,
                  memory: StageMemory, timing: StageTiming, host_budget_bytes: int | None = None) -> SwapEstimate:
    """The stage trace's monotone swap verdict (``swap_prefix``): feasibility, stall and peak.
    ``host_budget_bytes``: host memory one rank may fill (default ``hardware.host_swap_budget_bytes()``)."""
    m = layout.num_micro_batches(setup.global_batch_size)
    last = layout.holds_head(memory.stage)
    budget = setup.budget_bytes(hardware)
    if budget <= memory.static_bytes + max(memory.forward_extra_bytes, memory.backward_extra_bytes):
        return SwapEstimate(memory.stage, False, 0.0, memory.peak_bytes, max(budget, 0), 0, 0,
                            reason="model state, workspace and transients alone exceed the device",
                            infeasibility=StageInfeasibility.STATIC_ABOVE_DEVICE)
    acts = layer_activations(model, setup, layout.tp, layout.micro_batch, layout.recompute, cp=layout.cp)
    layer_parts = storage_parts(acts.tensors, skip_core=layout.recompute == RecomputeMode.SELECTIVE)
    head_parts = storage_parts(head_activations(model, setup, layout.tp, layout.micro_batch, cp=layout.cp))
    count = _simulated_count(layout, memory.stage, m)
    trace, times = build_stage_trace(memory, timing, layout, count, last, layer_parts, head_parts)
    host_budget = hardware.host_swap_budget_bytes() if host_budget_bytes is None else host_budget_bytes
    verdict = estimate_prefix(trace, times, budget, hardware.d2h_bytes_per_s, hardware.swap_h2d_bytes_per_s,
                              host_budget, setup.min_swap_bytes)
    scale = m / count  # the simulated micro-batches stand for all of them (a positive factor keeps monotonicity)
    return SwapEstimate(memory.stage, verdict.feasible, verdict.stall_s * scale if verdict.feasible else 0.0,
                        verdict.peak_bytes, budget, int(verdict.swapped_bytes * scale), count,
                        reason=verdict.reason, policy_summary=verdict.summary(), infeasibility=verdict.infeasibility,
                        host_bytes=verdict.host_bytes)


def stages_needing_swap(memories: list[StageMemory], usable_bytes: int) -> list[StageMemory]:
    """Stages whose no-swap peak exceeds the device: stage 0 (most in flight) and the last stage (the
    head) stand for the others, whose needs lie between theirs."""
    over = [m for m in memories if m.peak_bytes > usable_bytes]
    picked = {m.stage: m for m in over if m.stage in (0, len(memories) - 1)}
    if over and not picked:
        picked[over[0].stage] = over[0]
    return [picked[k] for k in sorted(picked)]


__all__ = ["StageInfeasibility", "SwapEstimate", "SwapInfeasibility", "build_stage_trace", "estimate_swap",
           "stages_needing_swap", "storage_parts"]
