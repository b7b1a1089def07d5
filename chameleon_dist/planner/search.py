"""Layout search: TP, PP, DP, VPP, EP, micro-batch size, recomputation and swap for one world size.

Every layout gets the cost model's per-rank peak and iteration time; layouts that only fit with swapping
get the swap estimate's verdict on their stage traces (``swap_model``), in order of their time without stall,
and only while that time can still beat the best plan that needs no recomputation (a branch and bound: the
estimate is the one expensive step). Every plan leaves the setup's memory margin free; plans within
``TIE_FRACTION`` of the best are ties, and ``SearchResult.recommended`` picks among them. The result holds the best feasible plan, every alternative with
the reason it lost, and the comparison "best with swap vs best with recomputation vs best with a high
TP/PP degree and neither".
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from types import MappingProxyType
from typing import TYPE_CHECKING

from chameleon_dist.planner.host_memory import (
    NodeHostUse,
    fit_host_memory,
    host_budget_words,
    host_source,
    overflow_reason,
)
from chameleon_dist.planner.layout import Layout, RecomputeMode
from chameleon_dist.planner.memory import StageMemory, rank_peaks, stage_layers
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup
from chameleon_dist.planner.space import SearchSpace, layouts
from chameleon_dist.planner.swap_model import StageInfeasibility, SwapEstimate, estimate_swap, stages_needing_swap
from chameleon_dist.planner.timing import COMPONENTS, TimeBreakdown, iteration_time, model_flops_per_iteration, stage_timing
from chameleon_dist.policy.model import Infeasibility

if TYPE_CHECKING:
    from chameleon_dist.planner.cluster import ClusterProfile

logger = logging.getLogger(__name__)

FEASIBLE, OUT_OF_MEMORY, PRUNED = "feasible", "out of memory", "pruned"
TIE_FRACTION = 0.02  # plans this close in predicted time tie: the cost model's own error is larger


class Approach(enum.StrEnum):
    """What a plan relies on to fit, for the comparison "swap vs recomputation vs parallelism alone". Not a
    per-tensor ``policy.Decision``; string-valued, so the comparison's JSON keys stay the same words."""

    SWAP = "swap"  # Chameleon swap, no recomputation
    RECOMPUTE = "recompute"  # some recomputation, no swap
    PARALLEL = "parallel"  # the parallel layout alone


# Why a plan's swap fit failed, in the words of its "why not" column; any other cause (the link is too slow,
# even swapping every candidate is not enough, every estimate fit but another stage did not) reads as
# copies not keeping up.
_WHY_SWAP_FAILED = MappingProxyType({
    Infeasibility.HOST_BUDGET: "the host memory budget runs out",
    Infeasibility.NO_SWAPPABLE_AT_PEAK: "the peak is where nothing can be swapped",
    StageInfeasibility.STATIC_ABOVE_DEVICE: "the peak is where nothing can be swapped",
})
_COPIES_TOO_SLOW = "copies cannot keep up with compute"
COMPONENT_LABELS = MappingProxyType({
    "compute": "compute", "recompute": "recomputation", "tp_comm": "communication (TP)",
    "cp_comm": "communication (CP)",
    "ep_comm": "communication (EP)", "pp_comm": "communication (PP)", "bubble": "pipeline bubble",
    "dp_comm": "communication (DP)", "optimizer": "optimizer step", "stall": "swap stall",
})


class PlanError(ValueError):
    """Inputs the planner cannot plan for; the message names the setting to change."""


@dataclasses.dataclass
class Plan:
    layout: Layout
    memory: list[StageMemory]
    time: TimeBreakdown
    usable_bytes: int
    status: str = FEASIBLE
    peak_bytes: int = 0  # the worst stage; with swap, as the policy predicts it
    swap: list[SwapEstimate] = dataclasses.field(default_factory=list)
    reason: str = ""  # why it is not the best (filled by the search)
    tokens_per_iteration: int = 0
    model_flops: float = 0.0
    budget_bytes: int = 0  # what the plan may fill: usable memory less the memory margin
    host_nodes: list[NodeHostUse] = dataclasses.field(default_factory=list)  # swap plans: host RAM per node

    @property
    def free_bytes(self) -> int:
        """Usable device memory the plan leaves free at its peak (the margin included)."""
        return self.usable_bytes - self.peak_bytes

    @property
    def swaps(self) -> bool:
        """The plan moves activations to the host (a swap layout that fits without swapping moves none)."""
        return self.layout.swap and self.swapped_bytes > 0

    @property
    def feasible(self) -> bool:
        return self.status == FEASIBLE

    @property
    def iteration_s(self) -> float:
        return self.time.total_s

    @property
    def approach(self) -> Approach:
        if self.layout.recompute != RecomputeMode.NONE:
            return Approach.RECOMPUTE
        return Approach.SWAP if self.layout.swap else Approach.PARALLEL

    @property
    def swapped_bytes(self) -> int:
        return max((s.swapped_bytes for s in self.swap), default=0)

    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_iteration / self.iteration_s / self.layout.world_size

    def mfu(self, hardware: HardwareProfile) -> float:
        """Model FLOPs utilisation (useful FLOPs, no recomputation, over the devices' peak)."""
        return self.model_flops / (self.iteration_s * self.layout.world_size * hardware.peak_flops_per_s)

    def describe_memory(self) -> str:
        worst = max(self.memory, key=lambda m: m.peak_bytes)
        return worst.describe()

    def to_dict(self, hardware: HardwareProfile | None = None) -> dict:
        data = {
            "layout": self.layout.to_dict(), "describe": self.layout.describe(), "status": self.status,
            "reason": self.reason, "peak_bytes": self.peak_bytes, "usable_bytes": self.usable_bytes,
            "budget_bytes": self.budget_bytes, "free_bytes": self.free_bytes,
            "no_swap_peak_bytes": max(m.peak_bytes for m in self.memory),
            "iteration_s": self.iteration_s, "time": self.time.to_dict(),
            "tokens_per_s_per_device": self.tokens_per_s_per_device(),
            "stages": [dataclasses.asdict(m) for m in self.memory],
            "swap": [s.to_dict() for s in self.swap],
            "host_bytes_per_node": [n.host_bytes for n in self.host_nodes],
            "host_nodes": [n.to_dict() for n in self.host_nodes],
        }
        if hardware is not None:
            data["mfu"] = self.mfu(hardware)
        return data


def evaluate(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout,
             run_swap: bool = True) -> Plan:
    """One layout's memory and time (and, for a swap layout that needs it, the policy's verdict)."""
    memory = rank_peaks(model, setup, layout)
    plan = Plan(layout, memory, iteration_time(model, hardware, setup, layout), hardware.usable_bytes,
                peak_bytes=max(m.peak_bytes for m in memory),
                tokens_per_iteration=setup.global_batch_size * setup.seq_length,
                model_flops=model_flops_per_iteration(model, setup), budget_bytes=setup.budget_bytes(hardware))
    if plan.peak_bytes <= plan.budget_bytes:
        return plan
    plan.status = OUT_OF_MEMORY
    if layout.swap and run_swap:
        _apply_swap(plan, model, hardware, setup)
    return plan


def _apply_swap(plan: Plan, model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup) -> None:
    timing = stage_timing(model, hardware, setup, plan.layout)
    need = {m.stage: m for m in stages_needing_swap(plan.memory, plan.budget_bytes)}

    def run(stage: int, host_budget_bytes: int) -> SwapEstimate:
        return estimate_swap(model, hardware, setup, plan.layout, need[stage], timing, host_budget_bytes=host_budget_bytes)

    # the ranks of a node share its host RAM (host_memory): each stage's host budget per rank follows from that
    source = host_source(model, setup, plan.layout, set(need), plan.budget_bytes)
    found, nodes = fit_host_memory(hardware, plan.layout, list(need), run, source)
    estimates = [found[stage] for stage in need]
    plan.swap, plan.host_nodes = estimates, nodes
    stall = max(e.stall_s for e in estimates)
    plan.time = iteration_time(model, hardware, setup, plan.layout, stall_s=stall)
    others = [m.peak_bytes for m in plan.memory if m.stage not in {e.stage for e in estimates}]
    plan.peak_bytes = max([e.peak_bytes for e in estimates] + others)
    fits = all(e.feasible for e in estimates) and plan.peak_bytes <= plan.budget_bytes
    plan.status = FEASIBLE if fits and all(n.fits for n in nodes) else OUT_OF_MEMORY


def _fit_block(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> Layout | None:
    """The fewest recomputed layers per chunk that fit (None: none or all of them)."""
    per_chunk = stage_layers(model, layout) // layout.vpp

    def fits(n: int) -> bool:
        trial = dataclasses.replace(layout, recompute_layers=n)
        return max(m.peak_bytes for m in rank_peaks(model, setup, trial)) <= setup.budget_bytes(hardware)

    low, high = 1, per_chunk - 1
    if _fits_without(model, hardware, setup, layout) or not fits(high):
        return None
    while low < high:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid + 1
    return dataclasses.replace(layout, recompute_layers=low)


def _fits_without(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, layout: Layout) -> bool:
    plain = dataclasses.replace(layout, recompute=RecomputeMode.NONE, recompute_layers=0)
    return max(m.peak_bytes for m in rank_peaks(model, setup, plain)) <= setup.budget_bytes(hardware)


@dataclasses.dataclass
class SearchResult:
    model: ModelProfile
    hardware: HardwareProfile
    setup: TrainingSetup
    world_size: int
    plans: list[Plan]  # feasible fastest first, then pruned, then out of memory
    policy_runs: int
    elapsed_s: float
    cluster: ClusterProfile | None = None  # where the node values came from (None: the hardware profile)

    @property
    def best(self) -> Plan | None:
        return self.plans[0] if self.plans and self.plans[0].feasible else None

    def ties(self) -> list[Plan]:
        """Plans that fit within ``TIE_FRACTION`` of the best's time (the best first): the model cannot rank them."""
        best = self.best
        if best is None:
            return []
        return [p for p in self.plans if p.feasible and p.iteration_s <= best.iteration_s * (1 + TIE_FRACTION)]

    @property
    def recommended(self) -> Plan | None:
        """Among the ties, the one to run: the most standard layout (fewest departures from TP and DP alone),
        then the most free memory, then the fastest."""
        ties = self.ties()
        if not ties:
            return None
        return min(ties, key=lambda p: (len(departures(p.layout)), -p.free_bytes, p.iteration_s))

    def best_of(self, approach: Approach) -> Plan | None:
        return next((p for p in self.plans if p.feasible and p.approach == approach), None)

    def comparison(self) -> dict:
        """Best with swap (Chameleon: no recomputation, swap where needed) vs best with recomputation vs
        best with parallelism alone; speedups are time ratios minus one ("x% faster")."""
        chameleon = self.best_of(Approach.SWAP)
        parallel = self.best_of(Approach.PARALLEL)
        if chameleon is None or (parallel is not None and parallel.iteration_s <= chameleon.iteration_s):
            chameleon = parallel  # swapping was not needed: the plain plan is Chameleon's plan
        recompute = self.best_of(Approach.RECOMPUTE)

        def speedup(other: Plan | None) -> float | None:
            if chameleon is None or other is None:
                return None
            return other.iteration_s / chameleon.iteration_s - 1

        baseline = min((p for p in (recompute, parallel) if p is not None), key=lambda p: p.iteration_s, default=None)
        swapping = self.best_of(Approach.SWAP)  # the fastest plan that really swaps (None: none fits or none needs it)
        recompute_off = None
        if recompute is not None and parallel is not None:
            recompute_off = recompute.iteration_s / parallel.iteration_s - 1
        return {Approach.SWAP.value: chameleon, Approach.RECOMPUTE.value: recompute,
                Approach.PARALLEL.value: parallel,
                "speedup_vs_recompute": speedup(recompute), "speedup_vs_parallel": speedup(parallel),
                "speedup_vs_best_without_swap": speedup(baseline),
                # whether Chameleon's plan swaps at all: when it does not, the speedups above are what turning
                # recomputation off (or a layout change) gains, not what swapping gains
                "swap_needed": chameleon is not None and chameleon.layout.swap,
                "swapping": swapping,
                "recompute_off_gain": recompute_off}

    def infeasible_message(self) -> str:
        """Why nothing fits, naming what to change."""
        smallest = min(self.plans, key=lambda p: p.peak_bytes, default=None)
        if smallest is None:
            return "no layout was evaluated"
        worst = max(smallest.memory, key=lambda m: m.peak_bytes)
        gb = 1e9
        budget = self.setup.budget_bytes(self.hardware)
        what = ("the model state alone" if worst.state.total_bytes + worst.workspace_bytes > budget
                else "model state plus the activations of one micro-batch")
        return (
            f"nothing fits on {self.world_size} x {self.hardware.name}: {what} does not fit. The smallest per-rank "
            f"peak is {smallest.peak_bytes / gb:.1f} GB ({smallest.layout.describe()}: model state "
            f"{worst.state.total_bytes / gb:.1f} GB, workspace {worst.workspace_bytes / gb:.1f} GB, activations "
            f"{worst.activation_bytes / gb:.1f} GB, transient {worst.transient_bytes / gb:.1f} GB) against "
            f"{budget / gb:.1f} GB allowed ({self.hardware.usable_bytes / gb:.1f} GB usable, memory_bytes - "
            f"reserved_bytes of {self.hardware.name}, less the {self.setup.memory_margin * 100:g}% memory margin). "
            "Raise --devices, lower --seq or --global-batch or --memory-margin, or use a hardware profile with more "
            "memory."
        )


def search(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, world_size: int,
           space: SearchSpace = SearchSpace(), cluster: ClusterProfile | None = None) -> SearchResult:
    """``hardware`` prices every rank; with a ``cluster``, pass ``cluster.device_profile()`` (the result and
    the host-RAM reasons name the cluster)."""
    start_s = time.perf_counter()
    if world_size < 1:
        raise PlanError(f"--devices must be >= 1, got {world_size}")
    candidates = list(layouts(model, hardware, setup, world_size, space))
    if not candidates:
        raise PlanError(
            f"no parallel layout for {world_size} devices: TP must divide num_attention_heads "
            f"({model.num_attention_heads}) and num_query_groups ({model.query_groups}) and stay within a node "
            f"({hardware.devices_per_node}), PP must divide num_layers ({model.num_layers}), and global_batch_size "
            f"({setup.global_batch_size}) must be a multiple of dp x micro_batch; change --devices or --global-batch")
    plans: list[Plan] = []
    waiting: list[Plan] = []
    for layout in candidates:
        if layout.recompute == RecomputeMode.BLOCK:
            layout = _fit_block(model, hardware, setup, layout)
            if layout is None:
                continue
        plan = evaluate(model, hardware, setup, layout, run_swap=False)
        if layout.swap and plan.feasible:
            continue  # fits without swapping: the same plan as its no-swap twin
        (waiting if layout.swap else plans).append(plan)
    bound = min((p.iteration_s for p in plans if p.feasible and p.layout.recompute == RecomputeMode.NONE),
                default=float("inf"))
    runs = 0
    for plan in sorted(waiting, key=lambda p: p.iteration_s):
        if plan.iteration_s >= bound:
            plan.status = PRUNED
        else:
            _apply_swap(plan, model, hardware, setup)
            runs += len(plan.swap)
            if plan.feasible:
                bound = min(bound, plan.iteration_s)
        plans.append(plan)
    order = {FEASIBLE: 0, PRUNED: 1, OUT_OF_MEMORY: 2}
    plans.sort(key=lambda p: (order[p.status], p.iteration_s if p.status != OUT_OF_MEMORY else p.peak_bytes, p.layout))
    result = SearchResult(model, hardware, setup, world_size, plans, runs, 0.0, cluster)
    _explain(result)
    result.elapsed_s = time.perf_counter() - start_s
    logger.info("searched %d layouts (%d policy runs) in %.2f s", len(plans), runs, result.elapsed_s)
    return result


def _explain(result: SearchResult) -> None:
    best = result.best
    gb = 1e9
    for plan in result.plans:
        if plan.status == OUT_OF_MEMORY:
            worst = max(plan.memory, key=lambda m: m.peak_bytes)
            owner = (f"of cluster {result.cluster.name}" if result.cluster is not None
                     else f"of hardware profile {result.hardware.name}")
            if plan.swap and all(s.feasible for s in plan.swap) and not all(n.fits for n in plan.host_nodes):
                plan.reason = overflow_reason(plan.host_nodes, result.hardware, owner)
            elif plan.swap:
                failed = next((s for s in plan.swap if not s.feasible), plan.swap[0])
                why = why_swap_failed(failed)
                if result.cluster is not None:  # (the words of a run without a cluster stay as they were)
                    why += host_budget_words(result.hardware, plan.layout, failed.stage, failed.host_bytes, owner,
                                             stopped=failed.infeasibility == Infeasibility.HOST_BUDGET)
                plan.reason = (f"out of memory even with swap: stage {failed.stage} peaks at "
                               f"{failed.peak_bytes / gb:.1f} GB > {plan.budget_bytes / gb:.1f} GB allowed ({why})")
            else:
                plan.reason = (f"out of memory: stage {worst.stage} needs {worst.peak_bytes / gb:.1f} GB > "
                               f"{plan.budget_bytes / gb:.1f} GB allowed")
        elif plan.status == PRUNED:
            plan.reason = "slower than the best plan without recomputation even before any swap stall"
        elif best is not None and plan is not best:
            deltas = {c: getattr(plan.time, c) - getattr(best.time, c) for c in COMPONENTS}
            cause = max(deltas, key=deltas.get)
            extra = plan.iteration_s / best.iteration_s - 1
            if extra < 5e-4:
                plan.reason = "as fast as the best (a tie; the best is first in layout order)"
            elif extra <= TIE_FRACTION:
                plan.reason = (f"a tie: {extra * 100:.1f}% slower, within the model's {TIE_FRACTION * 100:g}% error"
                               f"{preferences(plan, best)}")
            else:
                plan.reason = f"{extra * 100:.1f}% slower: {COMPONENT_LABELS[cause]} +{deltas[cause]:.2f} s"
        elif plan is best:
            plan.reason = "best"


def departures(layout: Layout) -> list[str]:
    """What a layout adds to the plainest one that Megatron users run (TP inside a node, DP across), in the
    words of the tie reasons; fewer is "more standard"."""
    out = []
    if layout.swap:
        out.append("swap")
    if layout.recompute != RecomputeMode.NONE:
        out.append("recomputation")
    if layout.cp > 1:
        out.append("context parallelism")
    if layout.pp > 1:
        out.append("pipeline")
    if layout.vpp > 1:
        out.append("interleaving")
    return out


def preferences(plan: Plan, best: Plan) -> str:
    """``plan``'s reasons to be preferred over ``best`` (they tie on time): more headroom, fewer departures
    from a plain layout; "" when it has none."""
    reasons = []
    more_free = plan.free_bytes - best.free_bytes
    if more_free >= 0.5e9:
        reasons.append(f"{more_free / 1e9:.1f} GB more free")
    dropped = [d for d in departures(best.layout) if d not in departures(plan.layout)]
    if dropped:
        reasons.append("no " + ", no ".join(dropped))
    return "; prefer it for " + " and ".join(reasons) if reasons else ""


def why_swap_failed(estimate: SwapEstimate) -> str:
    """The words for a failed swap fit, chosen by its typed cause (never by its message)."""
    return _WHY_SWAP_FAILED.get(estimate.infeasibility, _COPIES_TOO_SLOW)


__all__ = ["FEASIBLE", "OUT_OF_MEMORY", "PRUNED", "TIE_FRACTION", "Approach", "Plan", "PlanError", "SearchResult", "SearchSpace",
           "departures", "evaluate", "layouts", "preferences", "search",
           "why_swap_failed"]
