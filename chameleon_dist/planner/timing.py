"""Iteration time of a layout: compute, recomputation, TP/PP/DP/EP communication, the pipeline bubble.

Compute is FLOPs over the device's peak times an efficiency factor. A layer's forward FLOPs (per
micro-batch of ``b`` sequences of ``s`` tokens, hidden ``h``): ``2 s b h (h + 2 h_kv)`` for the QKV
projection, ``2 s b h^2`` for the output projection, ``4 s^2 b h`` for scores and context (halved for
flash attention, which skips the masked half of a causal mask), and ``2 s b h f`` per MLP matrix
(2 for GeLU, 3 for SwiGLU; times the router's top-k for MoE); the output layer adds ``2 s b h V``.
Backward costs twice the forward; full recomputation adds one forward per layer, selective
recomputation the attention core's.

Collectives use bus bandwidths (nccl-tests ``busbw``): an all-reduce over ``n`` ranks of ``B`` bytes
takes ``2 (n - 1) / n B / busbw``, an all-gather or reduce-scatter ``(n - 1) / n B / busbw``, an
all-to-all ``(n - 1) / n B / busbw``. Megatron orders ranks TP innermost, then DP, then PP: a group
stays inside a node while its span fits ``devices_per_node``.

Per micro-batch, a stage spends ``T_mb`` (compute, recomputation, exposed TP and EP communication); the
slowest stage sets the pace. Iteration: ``m T_mb`` + bubble ``(p - 1) / v T_mb`` + point-to-point
transfers ``2 (m v + p - 1)`` activations + the exposed gradient reduction + the optimizer step + stall.
"""

from __future__ import annotations

import dataclasses

from chameleon_dist.planner.layout import Layout, RecomputeMode
from chameleon_dist.planner.memory import stage_layers, stage_params
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup

COMPONENTS = ("compute", "recompute", "tp_comm", "ep_comm", "pp_comm", "bubble", "dp_comm", "optimizer", "stall")


@dataclasses.dataclass(frozen=True)
class LayerFlops:
    dense_flops: float  # projections and MLP, one forward, one micro-batch, whole layer (all TP ranks)
    core_flops: float  # attention scores and context

    @property
    def forward_flops(self) -> float:
        return self.dense_flops + self.core_flops


def layer_flops(model: ModelProfile, setup: TrainingSetup, micro_batch: int) -> LayerFlops:
    s, b, h = setup.seq_length, micro_batch, model.hidden_size
    tokens = s * b
    qkv = 2 * tokens * h * (h + 2 * model.kv_hidden_size)
    proj = 2 * tokens * h * h
    k = model.moe_router_topk if model.is_moe else 1
    mlp = 2 * tokens * h * model.ffn_hidden_size * model.mlp_matrices * k
    router = 2 * tokens * h * model.num_experts
    core = 4 * s * s * b * h * (0.5 if setup.attention == "flash" else 1.0)
    return LayerFlops(qkv + proj + mlp + router, core)


def head_flops(model: ModelProfile, setup: TrainingSetup, micro_batch: int) -> float:
    return 2.0 * setup.seq_length * micro_batch * model.hidden_size * model.vocab_size


def model_flops_per_iteration(model: ModelProfile, setup: TrainingSetup) -> float:
    """Useful FLOPs of one iteration (forward and backward, no recomputation), for utilisation figures."""
    per_sequence = model.num_layers * layer_flops(model, setup, 1).forward_flops + head_flops(model, setup, 1)
    return 3.0 * per_sequence * setup.global_batch_size


def _span_fits(span: int, hardware: HardwareProfile) -> bool:
    return span <= hardware.devices_per_node


def _bus(hardware: HardwareProfile, span: int) -> float:
    return hardware.intra_node_bus_bytes_per_s if _span_fits(span, hardware) else hardware.inter_node_bus_bytes_per_s


def all_reduce_s(nbytes: float, ranks: int, bus_bytes_per_s: float) -> float:
    return 0.0 if ranks <= 1 else 2.0 * (ranks - 1) / ranks * nbytes / bus_bytes_per_s


def gather_or_scatter_s(nbytes: float, ranks: int, bus_bytes_per_s: float) -> float:
    return 0.0 if ranks <= 1 else (ranks - 1) / ranks * nbytes / bus_bytes_per_s


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """One layer, one micro-batch, one rank (seconds)."""

    forward_s: float  # compute
    backward_s: float
    recompute_s: float
    tp_comm_s: float  # forward and backward, exposed
    ep_comm_s: float

    @property
    def forward_op_s(self) -> float:
        """The layer's forward as the training stream sees it (compute and its communication)."""
        return self.forward_s + (self.tp_comm_s + self.ep_comm_s) / 2

    @property
    def backward_op_s(self) -> float:
        return self.backward_s + self.recompute_s + (self.tp_comm_s + self.ep_comm_s) / 2


def layer_times(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> LayerTimes:
    flops = layer_flops(model, setup, layout.micro_batch)
    rate = hardware.effective_flops_per_s * layout.tp
    forward = flops.forward_flops / rate
    per_chunk = stage_layers(model, layout) // layout.vpp
    share = layout.recomputed_layers(per_chunk) / per_chunk  # of the layers rebuilt in backward
    recompute = flops.core_flops / rate if layout.recompute == RecomputeMode.SELECTIVE else share * forward
    hidden_bytes = setup.seq_length * layout.micro_batch * model.hidden_size * setup.activation_bytes
    # per layer: 2 all-reduces (or 2 all-gathers + 2 reduce-scatters with SP) in forward, as many in backward
    tp_once = all_reduce_s(hidden_bytes, layout.tp, _bus(hardware, layout.tp))
    tp = 4 * tp_once * (1 - setup.tp_comm_overlap)
    tp += share * 2 * tp_once * (1 - setup.tp_comm_overlap)  # the rebuilt forward communicates again
    ep = 0.0
    if model.is_moe and layout.ep > 1:
        routed = hidden_bytes * model.moe_router_topk / layout.tp
        ep = 4 * gather_or_scatter_s(routed, layout.ep, _bus(hardware, layout.ep * layout.tp))
    return LayerTimes(forward, 2 * forward, recompute, tp, ep)


@dataclasses.dataclass
class TimeBreakdown:
    """Seconds per iteration by cause (the critical pipeline stage's view)."""

    compute: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    ep_comm: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    dp_comm: float = 0.0
    optimizer: float = 0.0
    stall: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(getattr(self, name) for name in COMPONENTS)

    def to_dict(self) -> dict[str, float]:
        out = {f"{name}_s": getattr(self, name) for name in COMPONENTS}
        out["total_s"] = self.total_s
        return out


@dataclasses.dataclass(frozen=True)
class StageTiming:
    """Per micro-batch on the slowest stage, and the per-layer times the swap model uses."""

    layer: LayerTimes
    head_forward_s: float
    head_backward_s: float
    layers_per_stage: int

    def micro_batch_parts(self, with_head: bool) -> dict[str, float]:
        n = self.layers_per_stage
        head = self.head_forward_s + self.head_backward_s if with_head else 0.0
        return {
            "compute": n * (self.layer.forward_s + self.layer.backward_s) + head,
            "recompute": n * self.layer.recompute_s,
            "tp_comm": n * self.layer.tp_comm_s,
            "ep_comm": n * self.layer.ep_comm_s,
        }


def stage_timing(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> StageTiming:
    head = head_flops(model, setup, layout.micro_batch) / (hardware.effective_flops_per_s * layout.tp)
    return StageTiming(layer_times(model, hardware, setup, layout), head, 2 * head, stage_layers(model, layout))


def iteration_time(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout,
                   stall_s: float = 0.0) -> TimeBreakdown:
    m = layout.num_micro_batches(setup.global_batch_size)
    p, v = layout.pp, layout.vpp
    timing = stage_timing(model, hardware, setup, layout)
    parts = timing.micro_batch_parts(with_head=layout.post_process)  # the last stage is the slowest (the head)
    per_mb = sum(parts.values())
    out = TimeBreakdown(**{name: m * value for name, value in parts.items()})
    out.bubble = (p - 1) / v * per_mb
    if p > 1:
        hidden_bytes = setup.seq_length * layout.micro_batch * model.hidden_size * setup.activation_bytes
        if setup.sequence_parallel and layout.tp > 1:
            hidden_bytes /= layout.tp
        span = layout.tp * layout.dp * 2  # neighbouring stages are tp * dp ranks apart
        p2p_bytes_per_s = hardware.intra_node_bus_bytes_per_s if _span_fits(span, hardware) else hardware.inter_node_bus_bytes_per_s
        out.pp_comm = 2 * (m * v + p - 1) * hidden_bytes / p2p_bytes_per_s
    out.dp_comm = dp_comm_s(model, hardware, setup, layout) * (1 - setup.dp_comm_overlap)
    out.optimizer = optimizer_s(model, hardware, setup, layout)
    out.stall = stall_s
    return out


def dp_comm_s(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> float:
    """Gradient reduction (reduce-scatter with a sharded optimizer, else all-reduce) and, when the
    optimizer is sharded, the all-gather of the updated parameters; on the stage with the most parameters."""
    worst = 0.0
    for stage in {0, layout.pp - 1}:
        params = stage_params(model, setup, layout, stage)
        total = 0.0
        # dense parameters reduce over dp ranks spaced tp apart; experts over dp / ep ranks spaced tp * ep apart
        for count, ranks, span in ((params.dense, layout.dp, layout.tp * layout.dp),
                                   (params.experts, layout.dp // layout.ep, layout.tp * layout.dp)):
            if ranks <= 1 or count == 0:
                continue
            bus = _bus(hardware, span)
            grads = count * setup.grad_bytes
            if setup.zero_stage >= 1:
                total += gather_or_scatter_s(grads, ranks, bus) + gather_or_scatter_s(count * setup.param_bytes, ranks, bus)
            else:
                total += all_reduce_s(grads, ranks, bus)
        worst = max(worst, total)
    return worst


def optimizer_s(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> float:
    """Adam is bound by device-memory bandwidth: for each parameter it updates it reads and writes the
    optimizer state, reads the gradient and writes the parameter."""
    per_param_bytes = 2 * setup.optimizer_bytes + setup.grad_bytes + setup.param_bytes
    worst = 0.0
    for stage in {0, layout.pp - 1}:
        params = stage_params(model, setup, layout, stage)
        sharded = setup.zero_stage >= 1
        updated = params.dense / (layout.dp if sharded else 1) + params.experts / (layout.dp // layout.ep if sharded else 1)
        worst = max(worst, updated * per_param_bytes / hardware.memory_bytes_per_s)
    return worst
