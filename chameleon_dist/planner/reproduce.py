"""The paper's headline comparison, predicted by the planner, next to the published figures.

Published: Chameleon (arXiv 2509.11076) is "up to 38.94% faster than recomputation or high-degree
parallelism" on Ascend 910B NPUs (Llama2, Mixtral; the 38.94% combines replacing TP/PP by DP and turning
recomputation off). MindSpeed's SmartSwap, on Llama2 with 8 NPUs: +25% going from TP8 to TP1, +28%
turning full recomputation off. The papers do not give their global batch size, micro-batch size or
model size for those runs; the scenarios below state the values assumed here.
"""

from __future__ import annotations

import dataclasses

from chameleon_dist.planner.layout import Layout, RecomputeMode
from chameleon_dist.planner.profiles import load_hardware, load_model, TrainingSetup
from chameleon_dist.planner.search import Approach, Plan, SearchResult, evaluate, search
from chameleon_dist.planner.space import SearchSpace

PAPER_HEADLINE = 0.3894  # arXiv 2509.11076: up to 38.94% faster (TP/PP -> DP and recomputation off, combined)
SMARTSWAP_TP8_TO_TP1 = 0.25  # MindSpeed SmartSwap, Llama2, 8 NPUs
SMARTSWAP_FULL_RECOMPUTE_OFF = 0.28  # MindSpeed SmartSwap, Llama2, 8 NPUs


@dataclasses.dataclass(frozen=True)
class Scenario:
    model: str
    hardware: str
    devices: int
    seq_length: int
    global_batch_size: int

    def label(self) -> str:
        return f"{self.model}, {self.devices} x {self.hardware}, seq {self.seq_length // 1024}K, batch {self.global_batch_size}"


PAPER_SCENARIOS = (
    Scenario("llama2-7b", "ascend-910b", 8, 8192, 64),
    Scenario("llama2-7b", "ascend-910b", 8, 16384, 64),
    Scenario("llama2-13b", "ascend-910b", 8, 4096, 64),
    Scenario("llama2-13b", "ascend-910b", 8, 8192, 64),
    Scenario("mixtral-8x7b", "ascend-910b", 32, 4096, 128),
    Scenario("llama2-70b", "ascend-910b", 64, 4096, 256),
    Scenario("llama2-7b", "a100-80gb", 8, 16384, 64),
    Scenario("llama2-7b", "h100-80gb", 8, 16384, 64),
)


@dataclasses.dataclass
class FixedComparison:
    """A SmartSwap-style comparison: a named baseline against the planner's swap plan."""

    name: str
    published: float
    baseline: Plan | None
    chameleon: Plan | None

    @property
    def speedup(self) -> float | None:
        if self.baseline is None or self.chameleon is None:
            return None
        return self.baseline.iteration_s / self.chameleon.iteration_s - 1


@dataclasses.dataclass
class ScenarioResult:
    scenario: Scenario
    result: SearchResult
    fixed: list[FixedComparison]


def _setup(scenario: Scenario) -> TrainingSetup:
    return TrainingSetup(global_batch_size=scenario.global_batch_size, seq_length=scenario.seq_length)


def fixed_comparisons(scenario: Scenario, result: SearchResult) -> list[FixedComparison]:
    """SmartSwap's two cases and the paper's combined one, each against the planner's swap plan:
    the best TP8 plan (no swap, no recomputation) against the best TP1 plan with swap; the best swap plan's
    layout with full recomputation instead of swap against the swap plan; the best plan with full
    recomputation (any layout, no swap) against the best swap plan."""
    model, hardware, setup = result.model, result.hardware, result.setup
    best_swap = result.comparison()[Approach.SWAP]
    high_tp = min(hardware.devices_per_node, scenario.devices, model.num_attention_heads)

    def best(space: SearchSpace) -> Plan | None:
        try:
            return search(model, hardware, setup, scenario.devices, space).best
        except ValueError:
            return None

    tp_high = best(SearchSpace(tp=(high_tp,), recompute=(RecomputeMode.NONE,), swap=(False,)))
    tp_one = best(SearchSpace(tp=(1,), recompute=(RecomputeMode.NONE,)))
    same_layout = None
    if best_swap is not None:
        twin = dataclasses.replace(best_swap.layout, recompute=RecomputeMode.FULL, recompute_layers=0, swap=False)
        plan = evaluate(model, hardware, setup, twin)
        same_layout = plan if plan.feasible else None
    full = best(SearchSpace(recompute=(RecomputeMode.FULL,), swap=(False,)))
    return [
        FixedComparison(f"TP{high_tp} -> TP1 with swap", SMARTSWAP_TP8_TO_TP1, tp_high, tp_one),
        FixedComparison("full recomputation -> swap, same layout", SMARTSWAP_FULL_RECOMPUTE_OFF, same_layout, best_swap),
        FixedComparison("best with full recomputation -> best with swap", PAPER_HEADLINE, full, best_swap),
    ]


def run_scenario(scenario: Scenario) -> ScenarioResult:
    model, hardware = load_model(scenario.model), load_hardware(scenario.hardware)
    result = search(model, hardware, _setup(scenario), scenario.devices)
    return ScenarioResult(scenario, result, fixed_comparisons(scenario, result))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def _plan(plan: Plan | None) -> str:
    return "none fits" if plan is None else f"{plan.layout.describe()} ({plan.iteration_s:.2f} s)"


def markdown(results: list[ScenarioResult]) -> str:
    """The reproduction tables (predicted speedups next to the published ones)."""
    lines = [
        "| scenario | best swap plan | best recompute plan | best TP/PP plan | swap vs recompute | swap vs TP/PP | paper |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.result.comparison()
        lines.append(
            f"| {r.scenario.label()} | {_plan(c[Approach.SWAP])} | {_plan(c[Approach.RECOMPUTE])} | "
            f"{_plan(c[Approach.PARALLEL])} | "
            f"{_pct(c['speedup_vs_recompute'])} | {_pct(c['speedup_vs_parallel'])} | up to +38.94% |"
        )
    lines += [
        "",
        "| scenario | comparison | baseline | Chameleon plan | predicted | published |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for f in r.fixed:
            source = "paper (max)" if f.published == PAPER_HEADLINE else "SmartSwap"
            lines.append(f"| {r.scenario.label()} | {f.name} | {_plan(f.baseline)} | {_plan(f.chameleon)} | "
                         f"{_pct(f.speedup)} | {_pct(f.published)} ({source}) |")
    return "\n".join(lines)


def reproduce(scenarios: tuple[Scenario, ...] = PAPER_SCENARIOS) -> list[ScenarioResult]:
    return [run_scenario(s) for s in scenarios]


__all__ = ["PAPER_SCENARIOS", "FixedComparison", "Layout", "Scenario", "ScenarioResult", "markdown", "reproduce",
           "run_scenario"]
