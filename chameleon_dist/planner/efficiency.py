"""The achieved fraction of the device's peak for a layer's GEMMs, from the per-rank GEMM shapes.

A GEMM of ``M x K`` by ``K x N`` does ``F = 2 M N K`` FLOPs. Its achieved fraction of the peak is

    eff(F) = cap * F / (F + F_half)

where ``cap`` is the profile's ``efficiency`` (the large-GEMM efficiency) and ``F_half`` its
``gemm_half_efficiency_flops`` (the GEMM size that reaches half the cap). Equivalently each GEMM takes
``(F + F_half) / (cap * peak)`` seconds: its FLOPs at the large-GEMM rate plus a fixed cost per kernel
(launch, the tail wave, the epilogue), which is why small per-rank GEMMs (high TP, one short micro-batch)
fall below the cap. ``F_half = 0`` (the default) gives ``eff = cap`` for every GEMM: profiles that do not
set it (custom files, the calibrated CPU profile of ``calibrate.py``) price compute as before.

Per-rank shapes of one layer (``M`` = tokens per rank = ``seq_length * micro_batch / cp``; TP splits the
column-parallel outputs and the row-parallel inputs):

- QKV ``M x h -> (h + 2 h_kv) / tp``, output projection ``M x h / tp -> h``;
- MLP: the first matrix (or gate and up, fused) ``M x h -> (mlp_matrices - 1) f / tp``, the second
  ``M x f / tp -> h``; an MoE expert sees ``M * topk / num_experts`` tokens, one GEMM pair per local expert;
  the router ``M x h -> num_experts`` (not split);
- the attention core (scores and context, one batched kernel): its FLOPs per rank; with flash attention and
  the profile's ``attention_efficiency`` set, that fraction of the peak instead of the GEMM curve (a fused
  attention kernel is not a GEMM: FlashAttention-2 reaches 50-73% of an A100's peak, FlashAttention-3 up to
  75% of an H100's in forward);
- the output layer ``M x h -> V / tp``.

``eff`` rises with every dimension (``F`` does, and ``F / (F + F_half)`` rises with ``F``), so a larger
micro-batch, a lower TP degree or a wider model never computes slower per FLOP.
"""

from __future__ import annotations

import dataclasses

from chameleon_dist.planner.layout import Layout
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup


def gemm_efficiency(hardware: HardwareProfile, gemm_flops: float) -> float:
    """The achieved fraction of the peak of one GEMM of ``gemm_flops`` FLOPs (see the module docstring)."""
    half = hardware.gemm_half_efficiency_flops
    if half <= 0:
        return hardware.efficiency
    return hardware.efficiency * gemm_flops / (gemm_flops + half)


def gemm_shape_efficiency(hardware: HardwareProfile, m: float, n: float, k: float) -> float:
    """:func:`gemm_efficiency` of an ``m x k`` by ``k x n`` GEMM."""
    return gemm_efficiency(hardware, 2.0 * m * n * k)


@dataclasses.dataclass(frozen=True)
class GemmGroup:
    """GEMMs of one kind on one rank: ``count`` kernels of ``gemm_flops`` FLOPs each."""

    gemm_flops: float
    count: float = 1.0
    efficiency: float | None = None  # a fixed fraction of the peak instead of the GEMM curve (fused attention)

    @property
    def flops(self) -> float:
        return self.gemm_flops * self.count

    def seconds(self, hardware: HardwareProfile) -> float:
        efficiency = self.efficiency or gemm_efficiency(hardware, self.gemm_flops)
        return self.flops / (hardware.peak_flops_per_s * efficiency)


@dataclasses.dataclass(frozen=True)
class LayerRates:
    """FLOPs per second of a TP group (the rank's rate times ``tp``, as ``effective_flops_per_s * tp``
    was), so that a layer's whole-group FLOPs over the rate is one rank's time."""

    layer_flops_per_s: float  # the layer's forward (dense and core together)
    core_flops_per_s: float  # the attention core alone (what selective recomputation rebuilds)
    head_flops_per_s: float  # the output layer


def tokens_per_rank(setup: TrainingSetup, layout: Layout) -> float:
    return setup.seq_length * layout.micro_batch / layout.cp


def _rate(groups: list[GemmGroup], hardware: HardwareProfile, tp: int) -> float:
    if hardware.gemm_half_efficiency_flops <= 0 and all(g.efficiency is None for g in groups):
        return hardware.effective_flops_per_s * tp  # the constant efficiency, bit for bit
    seconds = sum(g.seconds(hardware) for g in groups)
    return sum(g.flops for g in groups) / seconds * tp


def gemm_parts(model: ModelProfile, setup: TrainingSetup, layout: Layout, tokens: float,
               hardware: HardwareProfile | None = None) -> tuple[list[GemmGroup], list[GemmGroup], list[GemmGroup]]:
    """One rank's forward GEMMs of one layer (dense, attention core) and of the output layer, for ``tokens``
    tokens per rank. Their FLOPs times ``tp`` are ``timing.layer_flops`` and ``timing.head_flops`` (the
    router, replicated on every TP rank, is counted split as those count it)."""
    h, tp = model.hidden_size, layout.tp
    dense = [GemmGroup(2.0 * tokens * h * (h + 2 * model.kv_hidden_size) / tp),
             GemmGroup(2.0 * tokens * h * h / tp)]
    f, mats = model.ffn_hidden_size, model.mlp_matrices
    if model.is_moe:
        ep = layout.ep
        expert_tokens = tokens * ep * model.moe_router_topk / model.num_experts
        local = model.num_experts / ep
        dense += [GemmGroup(2.0 * expert_tokens * h * (mats - 1) * f / tp, local),
                  GemmGroup(2.0 * expert_tokens * f * h / tp, local)]
    else:
        dense += [GemmGroup(2.0 * tokens * h * (mats - 1) * f / tp), GemmGroup(2.0 * tokens * f * h / tp)]
    if model.num_experts:
        dense.append(GemmGroup(2.0 * tokens * h * model.num_experts / tp))
    keys = setup.seq_length
    flash = setup.attention == "flash"
    core = [GemmGroup(4.0 * tokens * keys * h / tp * (0.5 if flash else 1.0),
                      efficiency=hardware.attention_efficiency if flash and hardware is not None else None)]
    head = [GemmGroup(2.0 * tokens * h * model.vocab_size / tp)]
    return dense, core, head


def layer_rates(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> LayerRates:
    """The compute rates of one layer's GEMMs and the output layer, from their per-rank shapes."""
    dense, core, head = gemm_parts(model, setup, layout, tokens_per_rank(setup, layout), hardware)
    return LayerRates(_rate(dense + core, hardware, layout.tp), _rate(core, hardware, layout.tp),
                      _rate(head, hardware, layout.tp))


__all__ = ["GemmGroup", "LayerRates", "gemm_efficiency", "gemm_parts", "gemm_shape_efficiency", "layer_rates",
           "tokens_per_rank"]
