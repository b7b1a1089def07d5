"""The search space: which (TP, CP, PP, DP, VPP, EP, micro-batch, recompute, swap) combinations a world size
allows. Every combination of the space's values is taken in order (TP slowest, swap fastest), and each rule
below names one reason to skip a combination; the search relies on this order to break ties.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from chameleon_dist.planner.layout import RECOMPUTE_MODES, Layout, RecomputeMode
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What the search may vary; None: every value that divides the problem."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] = (1, 2, 4)
    ep: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] = (1, 2, 4)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    swap: tuple[bool, ...] = (False, True)
    cp: tuple[int, ...] | None = None  # context parallelism; None: every degree ``cp_degrees`` allows


MIN_TOKENS_PER_CP_RANK = 4096
"""With an unset CP, degrees that would leave a rank fewer tokens than this are not tried: below it the
ring's per-step attention is too short to hide the key/value exchange (Megatron's and Transformer Engine's
guidance is CP for long sequences), and the search stays fast. An explicit ``--cp`` tries what it names."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_fits(model: ModelProfile, hardware: HardwareProfile, world_size: int, tp: int) -> bool:
    """TP splits the world, the attention heads and the query groups evenly, inside one node."""
    return not (world_size % tp or tp > hardware.devices_per_node or model.num_attention_heads % tp
                or model.query_groups % tp)


def _pp_fits(model: ModelProfile, world_size: int, tp: int, pp: int) -> bool:
    """PP splits what TP leaves of the world, and the layers, evenly."""
    return not ((world_size // tp) % pp or model.num_layers % pp)


def cp_degrees(setup: TrainingSetup, world_size: int) -> list[int]:
    """CP degrees an unset ``SearchSpace.cp`` tries: divisors of the world that leave every rank at least
    ``MIN_TOKENS_PER_CP_RANK`` tokens (always 1)."""
    return [d for d in _divisors(world_size) if d == 1 or setup.seq_length // d >= MIN_TOKENS_PER_CP_RANK]


def cp_problem(setup: TrainingSetup, world_size: int, tp: int, pp: int, cp: int) -> str:
    """Why Megatron refuses context parallelism ``cp`` here ("" when it allows it): the world must split into
    whole TP x CP x PP blocks, the sequence into ``2 cp`` chunks (the load-balanced causal split; Megatron's
    arguments.py asserts seq_length % (2 * context_parallel_size) == 0), and only Transformer Engine's
    attention (flash/fused) supports it (Megatron's local DotProductAttention asserts cp == 1). The TP x CP
    span may leave the node (Megatron does not require it; it is priced at the inter-node bandwidth)."""
    if cp == 1:
        return ""
    if world_size % (tp * cp * pp):
        return f"tp x cp x pp ({tp} x {cp} x {pp}) does not divide the world ({world_size})"
    if setup.seq_length % (2 * cp):
        return f"the sequence length ({setup.seq_length}) is not divisible by 2 x cp ({2 * cp})"
    if setup.attention != "flash":
        return "context parallelism needs flash (Transformer Engine) attention, not unfused"
    return ""


def _ep_fits(model: ModelProfile, dp: int, ep: int) -> bool:
    """Expert parallelism lives inside the data-parallel group and splits the experts evenly."""
    return dp % ep == 0 and model.num_experts % ep == 0


def _vpp_fits(model: ModelProfile, pp: int, vpp: int) -> bool:
    """Interleaving needs a pipeline and whole layers in every model chunk."""
    return vpp <= 1 or (pp > 1 and (model.num_layers // pp) % vpp == 0)


def _batch_fits(setup: TrainingSetup, dp: int, pp: int, vpp: int, micro_batch: int) -> bool:
    """The global batch is whole micro-batches on every DP rank, and the interleaved schedule needs a
    multiple of PP of them."""
    if setup.global_batch_size % (dp * micro_batch):
        return False
    return vpp <= 1 or (setup.global_batch_size // (dp * micro_batch)) % pp == 0


def _mode_differs(setup: TrainingSetup, recompute: str) -> bool:
    """Flash attention stores no attention core, so selective recomputation would be no recomputation."""
    return not (recompute == RecomputeMode.SELECTIVE and setup.attention == "flash")


def _block_fits(model: ModelProfile, pp: int, vpp: int, recompute: str) -> bool:
    """Block recomputation of some layers needs two layers per chunk (all of them is full recomputation)."""
    return recompute != RecomputeMode.BLOCK or model.num_layers // pp // vpp >= 2


def _swap_alone(recompute: str, swap: bool) -> bool:
    """Swap plans recompute nothing: the comparison is swap against recomputation."""
    return not swap or recompute == RecomputeMode.NONE


def layouts(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, world_size: int,
            space: SearchSpace = SearchSpace()) -> Iterator[Layout]:
    """Every layout the space allows for ``world_size`` devices (block recomputation with 1 layer per
    chunk; the search raises it to what fits). Unset TP, PP and EP degrees range over the divisors of the
    world; the rules keep those that divide what is left of it."""
    divisors = _divisors(world_size)
    eps = (space.ep or divisors) if model.is_moe else (1,)
    cps = space.cp or cp_degrees(setup, world_size)
    for tp, cp, pp, ep, vpp, micro_batch, recompute, swap in itertools.product(
            space.tp or divisors, cps, space.pp or divisors, eps, space.vpp, space.micro_batch, space.recompute,
            space.swap):
        if not (_tp_fits(model, hardware, world_size, tp) and _pp_fits(model, world_size, tp, pp)):
            continue
        if cp_problem(setup, world_size, tp, pp, cp):
            continue
        dp = world_size // (tp * cp * pp)
        if (_ep_fits(model, dp, ep) and _vpp_fits(model, pp, vpp) and _batch_fits(setup, dp, pp, vpp, micro_batch)
                and _mode_differs(setup, recompute) and _block_fits(model, pp, vpp, recompute)
                and _swap_alone(recompute, swap)):
            block_layers = 1 if recompute == RecomputeMode.BLOCK else 0
            yield Layout(tp, pp, dp, vpp, micro_batch, ep, recompute, block_layers, swap, cp=cp)


__all__ = ["MIN_TOKENS_PER_CP_RANK", "SearchSpace", "cp_degrees", "cp_problem", "layouts"]
