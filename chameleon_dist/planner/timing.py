"""Iteration time of a layout: compute, recomputation, TP/PP/DP/EP communication, the pipeline bubble.

Compute is FLOPs over the peak times the per-rank GEMMs' efficiency (``efficiency.py``). A layer's forward FLOPs (per
micro-batch of ``b`` sequences of ``s`` tokens, hidden ``h``): ``2 s b h (h + 2 h_kv)`` for the QKV
projection, ``2 s b h^2`` for the output projection, ``4 s^2 b h`` for scores and context (halved for
flash attention, which skips the masked half of a causal mask), and ``2 s b h f`` per MLP matrix
(2 for GeLU, 3 for SwiGLU; times the router's top-k for MoE); the output layer adds ``2 s b h V``.
Backward costs twice the forward (``HardwareProfile.backward_to_forward``: a calibration sets it); full
recomputation adds one forward per layer, selective recomputation the attention core's.

Collectives use bus bandwidths (nccl-tests ``busbw``): an all-reduce over ``n`` ranks of ``B`` bytes
takes ``2 (n - 1) / n B / busbw``, an all-gather or reduce-scatter ``(n - 1) / n B / busbw``, an
all-to-all ``(n - 1) / n B / busbw``. Megatron orders ranks TP innermost, then CP, then DP, then PP
(its default order "tp-cp-ep-dp-pp"): a TP group spans ``tp`` ranks, a CP group ``tp cp``, a DP group
``tp cp dp``, and pipeline neighbours are ``tp cp dp`` apart; a group stays inside a node while its span
fits ``devices_per_node``.

With sequence parallelism a layer's forward runs 4 TP collectives (an all-gather before QKV and FC1, a
reduce-scatter after the output projection and FC2), its backward 6: the column-parallel linears (QKV,
FC1) all-gather their sharded input again for the weight gradient and reduce-scatter the input gradient,
the row-parallel ones all-gather the output gradient; without it, 2 all-reduces each way. A rebuilt
(recomputed) forward runs the forward's collectives again. Megatron's ``tp_comm_overlap`` hides each
collective under the GEMM it is paired with (exposed ``max(0, comm - gemm)``).

Context parallelism (``cp`` ranks, ``s / cp`` tokens each, load-balanced causal split): every FLOP of a
rank is over ``cp``; the ring attention passes the local key/value chunk (``2 s / cp b h_kv / t`` elements)
``cp - 1`` times in forward and twice that (keys/values and their gradients) in backward, each step
overlapped with that step's attention (``1 / cp`` of the rank's core FLOPs): ``cp_comm`` is what exceeds it.

Megatron's overlap switches (``TrainingSetup``): ``overlap_grad_reduce`` hides the gradient reduction
under the last micro-batch's backward except its last bucket (Megatron's default bucket: ``max(4e7, 1e6
dp)`` parameters); ``overlap_param_gather`` hides the distributed optimizer's parameter all-gather under the
next iteration's first forward the same way; ``overlap_p2p_comm`` (interleaved schedule only) hides each
steady-state send/receive under the next chunk's compute.

Per micro-batch, a stage spends ``T_mb`` (compute, recomputation, exposed TP and EP communication); the
slowest stage sets the pace. Iteration: ``m T_mb`` + bubble ``(p - 1) / v T_mb`` + point-to-point
transfers ``2 (m v + p - 1)`` activations + the exposed gradient reduction + the optimizer step + stall.
"""

from __future__ import annotations

import dataclasses

from chameleon_dist.planner.efficiency import LayerRates, layer_rates
from chameleon_dist.planner.layout import Layout, RecomputeMode
from chameleon_dist.planner.memory import stage_layers, stage_params
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup

COMPONENTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "bubble", "dp_comm", "optimizer",
              "stall")


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


@dataclasses.dataclass(frozen=True)
class GemmFlops:
    """The forward GEMMs of one layer that TP collectives pair with (whole layer, one micro-batch)."""

    qkv: float
    proj: float
    fc1: float  # gate and up (SwiGLU) or the first matrix (GeLU); times top-k for MoE
    fc2: float


def layer_gemm_flops(model: ModelProfile, setup: TrainingSetup, micro_batch: int) -> GemmFlops:
    tokens, h = setup.seq_length * micro_batch, model.hidden_size
    k = model.moe_router_topk if model.is_moe else 1
    mlp_one = 2 * tokens * h * model.ffn_hidden_size * k
    return GemmFlops(2 * tokens * h * (h + 2 * model.kv_hidden_size), 2 * tokens * h * h,
                     mlp_one * (model.mlp_matrices - 1), mlp_one)


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
    cp_comm_s: float = 0.0  # the ring attention's exposed key/value exchange, forward and backward
    forward_comm_s: float | None = None  # of the exposed TP, EP and CP communication, the forward's (None: half)

    @property
    def _comm_s(self) -> float:
        return self.tp_comm_s + self.ep_comm_s + self.cp_comm_s

    @property
    def _forward_comm_s(self) -> float:
        return self._comm_s / 2 if self.forward_comm_s is None else self.forward_comm_s

    @property
    def forward_op_s(self) -> float:
        """The layer's forward as the training stream sees it (compute and its communication)."""
        return self.forward_s + self._forward_comm_s

    @property
    def backward_op_s(self) -> float:
        return self.backward_s + self.recompute_s + self._comm_s - self._forward_comm_s


def layer_times(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout,
                rates: LayerRates | None = None) -> LayerTimes:
    """``rates``: ``efficiency.layer_rates`` of the layout, when the caller has them."""
    flops = layer_flops(model, setup, layout.micro_batch)
    rates = rates or layer_rates(model, hardware, setup, layout)
    rate = rates.layer_flops_per_s
    forward = flops.forward_flops / rate
    per_chunk = stage_layers(model, layout) // layout.vpp
    share = layout.recomputed_layers(per_chunk) / per_chunk  # of the layers rebuilt in backward
    selective = layout.recompute == RecomputeMode.SELECTIVE
    recompute = flops.core_flops / rates.core_flops_per_s if selective else share * forward

    forward, recompute = forward / layout.cp, recompute / layout.cp  # a CP rank computes s / cp tokens
    hidden_bytes = hidden_bytes_per_rank(model, setup, layout)
    tp_forward, tp_backward = tp_comm_times(model, hardware, setup, layout, rate * layout.cp)
    tp_backward += share * tp_forward  # the rebuilt forward communicates again
    cp_forward, cp_backward = cp_comm_times(model, hardware, setup, layout, rate * layout.cp)
    rebuilt_core = 1.0 if selective else share  # the ring runs again
    cp_backward += rebuilt_core * cp_forward
    ep = 0.0
    if model.is_moe and layout.ep > 1:
        routed = hidden_bytes * model.moe_router_topk / layout.tp
        ep = 4 * gather_or_scatter_s(routed, layout.ep, _bus(hardware, layout.ep * layout.cp * layout.tp))
    return LayerTimes(forward, hardware.backward_to_forward * forward, recompute, tp_forward + tp_backward, ep,
                      cp_forward + cp_backward, forward_comm_s=tp_forward + cp_forward + ep / 2)


def hidden_bytes_per_rank(model: ModelProfile, setup: TrainingSetup, layout: Layout) -> float:
    """One micro-batch's hidden activation on a CP rank (``s / cp`` tokens), the unit TP, EP and PP move."""
    return setup.seq_length * layout.micro_batch * model.hidden_size * setup.activation_bytes / layout.cp


def tp_collective_s(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> float:
    """One all-gather (or reduce-scatter) of a layer's hidden activation (a CP rank's tokens) over TP."""
    hidden_bytes = hidden_bytes_per_rank(model, setup, layout)
    return gather_or_scatter_s(hidden_bytes, layout.tp, _bus(hardware, layout.tp))


def tp_comm_times(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout,
                  rate_flops_per_s: float) -> tuple[float, float]:
    """Exposed TP communication of one layer, one micro-batch: (forward, backward), without recomputation.
    With sequence parallelism: 4 collectives in forward (all-gather before QKV and FC1, reduce-scatter after
    the projection and FC2), 6 in backward (QKV and FC1 all-gather their input again for the weight gradient
    and reduce-scatter the input gradient; the projection and FC2 all-gather the output gradient); without
    it, 2 all-reduces each way. ``tp_comm_overlap`` (Megatron's switch, sequence parallel only) hides each
    collective under its GEMM (``rate_flops_per_s``: a rank's GEMM rate, whole layer); the old hidden
    fraction then hides a share of what is left."""
    if layout.tp <= 1:
        return 0.0, 0.0
    one = tp_collective_s(model, hardware, setup, layout)
    if not setup.sequence_parallel:
        forward, backward = 4 * one, 4 * one  # an all-reduce is an all-gather and a reduce-scatter
    elif setup.tp_comm_gemm_overlap:
        g = layer_gemm_flops(model, setup, layout.micro_batch)
        qkv, proj, fc1, fc2 = (x / rate_flops_per_s for x in (g.qkv, g.proj, g.fc1, g.fc2))
        # forward: AG | QKV, RS | projection, AG | FC1, RS | FC2; backward: the data-gradient GEMM hides the
        # re-gather (column-parallel) or the gradient's all-gather (row-parallel), the weight-gradient GEMM the
        # reduce-scatter of the input gradient (column-parallel)
        forward = sum(max(0.0, one - gemm) for gemm in (qkv, proj, fc1, fc2))
        backward = sum(max(0.0, one - gemm) for gemm in (qkv, qkv, proj, fc1, fc1, fc2))
    else:
        forward, backward = 4 * one, 6 * one
    kept = 1 - setup.tp_comm_hidden_fraction
    return forward * kept, backward * kept


def cp_comm_times(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout,
                  rate_flops_per_s: float) -> tuple[float, float]:
    """Exposed ring-attention communication of one layer, one micro-batch (forward, backward): ``cp - 1``
    steps, each sending the local key/value chunk to the next CP rank (backward: keys/values and their
    gradients, twice the bytes), overlapped with that step's attention (``1 / cp`` of the rank's attention
    core; backward's is twice the forward's)."""
    cp = layout.cp
    if cp <= 1:
        return 0.0, 0.0
    tokens = setup.seq_length / cp * layout.micro_batch
    kv_bytes = 2 * tokens * model.kv_hidden_size / layout.tp * setup.activation_bytes
    step_s = kv_bytes / _bus(hardware, layout.tp * cp)
    core_s = layer_flops(model, setup, layout.micro_batch).core_flops / rate_flops_per_s  # a rank's core, all steps
    attention_step_s = core_s / cp
    return (cp - 1) * max(0.0, step_s - attention_step_s), (cp - 1) * max(0.0, 2 * step_s - 2 * attention_step_s)


@dataclasses.dataclass
class TimeBreakdown:
    """Seconds per iteration by cause (the critical pipeline stage's view)."""

    compute: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    ep_comm: float = 0.0
    cp_comm: float = 0.0  # context parallelism's exposed ring exchange
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
            "cp_comm": n * self.layer.cp_comm_s,
            "ep_comm": n * self.layer.ep_comm_s,
        }

    def micro_batch_backward_s(self, with_head: bool) -> float:
        """One micro-batch's backward on the stage (what the last one hides the gradient reduction under)."""
        return self.layers_per_stage * self.layer.backward_op_s + (self.head_backward_s if with_head else 0.0)

    def micro_batch_forward_s(self, with_head: bool) -> float:
        """One micro-batch's forward on the stage (what the first one hides the parameter all-gather under)."""
        return self.layers_per_stage * self.layer.forward_op_s + (self.head_forward_s if with_head else 0.0)


def stage_timing(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> StageTiming:
    rates = layer_rates(model, hardware, setup, layout)
    if hardware.head_flops_per_s:  # (a calibrated head has its own rate)
        head_rate = hardware.head_flops_per_s * layout.tp
    else:  # the output layer's GEMM at its per-rank shape (planner/efficiency.py)
        head_rate = rates.head_flops_per_s
    head = head_flops(model, setup, layout.micro_batch) / head_rate
    return StageTiming(layer_times(model, hardware, setup, layout, rates), head / layout.cp,
                       hardware.head_backward_to_forward * head / layout.cp,
                       stage_layers(model, layout))


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
        hidden_bytes = hidden_bytes_per_rank(model, setup, layout)
        if setup.sequence_parallel and layout.tp > 1:
            hidden_bytes /= layout.tp
        span = layout.tp * layout.cp * layout.dp * 2  # neighbouring stages are tp * cp * dp ranks apart
        p2p_bytes_per_s = hardware.intra_node_bus_bytes_per_s if _span_fits(span, hardware) else hardware.inter_node_bus_bytes_per_s
        out.pp_comm = pp_comm_s(timing, setup, layout, m, hidden_bytes / p2p_bytes_per_s)
    out.dp_comm = exposed_dp_comm_s(model, hardware, setup, layout, timing) * (1 - setup.dp_comm_overlap)
    out.optimizer = optimizer_s(model, hardware, setup, layout)
    out.stall = stall_s
    return out


def pp_comm_s(timing: StageTiming, setup: TrainingSetup, layout: Layout, num_micro_batches: int,
              transfer_s: float) -> float:
    """Point-to-point sends and receives of one stage: ``2 (m v + p - 1)`` activations of ``transfer_s``
    each; with ``overlap_p2p_comm`` under the interleaved schedule (Megatron turns it off otherwise) the
    ``2 m v`` steady-state ones hide under the next chunk's forward or backward."""
    m, p, v = num_micro_batches, layout.pp, layout.vpp
    if not (setup.overlap_p2p_comm and v > 1):
        return 2 * (m * v + p - 1) * transfer_s
    chunk_layers = timing.layers_per_stage / v
    forward_s, backward_s = chunk_layers * timing.layer.forward_op_s, chunk_layers * timing.layer.backward_op_s
    return 2 * (p - 1) * transfer_s + m * v * (max(0.0, transfer_s - forward_s) + max(0.0, transfer_s - backward_s))


def megatron_bucket_params(layout: Layout) -> int:
    """Megatron's default DDP bucket (distributed_data_parallel_config.py: ``max(40000000, 1000000 *
    dp_size)`` parameters, dp_size the dp x cp group)."""
    return max(40_000_000, 1_000_000 * layout.dp_cp)


@dataclasses.dataclass(frozen=True)
class DataParallelComm:
    """One stage's data-parallel collectives per iteration, unhidden."""

    reduce_s: float  # gradient reduce-scatter (sharded optimizer) or all-reduce
    gather_s: float  # the sharded optimizer's all-gather of the updated parameters
    params: int  # parameters of the stage's rank (dense and experts)


def dp_comm_parts(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout,
                  stage: int) -> DataParallelComm:
    """Gradients reduce over Megatron's dp_cp group (dense: ``dp cp`` ranks spaced ``tp`` apart; experts:
    ``dp cp / ep`` ranks); a sharded optimizer reduce-scatters them and all-gathers the parameters."""
    params = stage_params(model, setup, layout, stage)
    reduce = gather = 0.0
    for count, ranks in ((params.dense, layout.dp_cp), (params.experts, layout.dp_cp // layout.ep)):
        if ranks <= 1 or count == 0:
            continue
        bus = _bus(hardware, layout.tp * layout.dp_cp)
        grads = count * setup.grad_bytes
        if setup.zero_stage >= 1:
            reduce += gather_or_scatter_s(grads, ranks, bus)
            gather += gather_or_scatter_s(count * setup.param_bytes, ranks, bus)
        else:
            reduce += all_reduce_s(grads, ranks, bus)
    return DataParallelComm(reduce, gather, params.total)


def dp_comm_s(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> float:
    """Gradient reduction (reduce-scatter with a sharded optimizer, else all-reduce) and, when the
    optimizer is sharded, the all-gather of the updated parameters, none of it hidden; on the stage with
    the most of it."""
    parts = [dp_comm_parts(model, hardware, setup, layout, stage) for stage in {0, layout.pp - 1}]
    return max(x.reduce_s + x.gather_s for x in parts)


def hidden_under(comm_s: float, window_s: float, bucket_share: float) -> float:
    """What stays exposed of ``comm_s`` bucketed collectives overlapped with ``window_s`` of compute: the
    last bucket (``bucket_share`` of the whole) waits for the window's end, the rest hides under it."""
    last = comm_s * min(1.0, bucket_share)
    return last + max(0.0, comm_s - last - window_s)


def exposed_dp_comm_s(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout,
                      timing: StageTiming) -> float:
    """The data-parallel collectives the iteration waits for, on the stage that waits longest:
    ``overlap_grad_reduce`` hides the reduction under the last micro-batch's backward, ``overlap_param_gather``
    the parameter all-gather under the next iteration's first forward (each but its last bucket)."""
    worst = 0.0
    for stage in {0, layout.pp - 1}:
        parts = dp_comm_parts(model, hardware, setup, layout, stage)
        head = layout.holds_head(stage)
        share = megatron_bucket_params(layout) / max(1, parts.params)
        reduce, gather = parts.reduce_s, parts.gather_s
        if setup.overlap_grad_reduce:
            reduce = hidden_under(reduce, timing.micro_batch_backward_s(head), share)
        if setup.overlap_param_gather:
            gather = hidden_under(gather, timing.micro_batch_forward_s(head), share)
        worst = max(worst, reduce + gather)
    return worst


def optimizer_s(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> float:
    """Adam is bound by device-memory bandwidth: for each parameter it updates it reads and writes the
    optimizer state, reads the gradient and writes the parameter."""
    per_param_bytes = 2 * setup.optimizer_bytes + setup.grad_bytes + setup.param_bytes
    worst = 0.0
    for stage in {0, layout.pp - 1}:
        params = stage_params(model, setup, layout, stage)
        sharded = setup.zero_stage >= 1
        updated = (params.dense / (layout.dp_cp if sharded else 1)
                   + params.experts / (layout.dp_cp // layout.ep if sharded else 1))
        worst = max(worst, updated * per_param_bytes / hardware.memory_bytes_per_s)
    return worst
