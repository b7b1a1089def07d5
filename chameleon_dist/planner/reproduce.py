"""The paper's headline comparison, predicted by the planner, next to the published figures.

Published: Chameleon (arXiv 2509.11076) is "up to 38.94% faster than recomputation or high-degree
parallelism" on Ascend 910B NPUs (Llama2, Mixtral; the 38.94% combines replacing TP/PP by DP and turning
recomputation off). MindSpeed's SmartSwap, on Llama2 with 8 NPUs: +25% going from TP8 to TP1, +28%
turning full recomputation off. The papers do not give their global batch size, micro-batch size or
model size for those runs; the scenarios below state the values assumed here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

from chameleon_dist.planner.layout import Layout, RecomputeMode
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup, load_hardware, load_model
from chameleon_dist.planner.search import Approach, Plan, SearchResult, evaluate, search
from chameleon_dist.planner.sensitivity import (
    AssumedInput,
    FigureRange,
    assumed_inputs,
    describe_ranges,
    sweep,
    with_inputs,
)
from chameleon_dist.planner.space import SearchSpace

logger = logging.getLogger(__name__)

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
    """A published comparison re-run by the planner: a baseline named exactly against Chameleon's plan (no
    recomputation, swap where needed). ``swaps`` says whether Chameleon's plan swaps at all: where it does not,
    the speedup is what the layout or turning recomputation off gains, and the tables say "no swap needed"."""

    name: str
    baseline_name: str  # the baseline exactly, in words
    published: float
    source: str
    baseline: Plan | None
    chameleon: Plan | None
    spread: FigureRange | None = None  # the speedup over the assumed inputs (None: not swept)

    @property
    def speedup(self) -> float | None:
        if self.baseline is None or self.chameleon is None:
            return None
        return self.baseline.iteration_s / self.chameleon.iteration_s - 1

    @property
    def swaps(self) -> bool:
        return self.chameleon is not None and self.chameleon.swaps


@dataclasses.dataclass
class ScenarioResult:
    scenario: Scenario
    result: SearchResult
    fixed: list[FixedComparison]
    ranges: dict[str, FigureRange] = dataclasses.field(default_factory=dict)  # by figure name (empty: not swept)


def _setup(scenario: Scenario) -> TrainingSetup:
    return TrainingSetup(global_batch_size=scenario.global_batch_size, seq_length=scenario.seq_length)


def high_tp(scenario: Scenario, model: ModelProfile, hardware: HardwareProfile) -> int:
    """The "high-degree" TP of the published baselines: a whole node (8), within the heads."""
    return min(hardware.devices_per_node, scenario.devices, model.num_attention_heads)


def fixed_comparisons(scenario: Scenario, result: SearchResult) -> list[FixedComparison]:
    """The published comparisons, each baseline exactly as published, against Chameleon's plan:

    - SmartSwap's TP8 -> TP1: the best TP8 plan (no recomputation, no swap) against the best TP1 plan (no
      recomputation, swap where needed);
    - SmartSwap's full recomputation on -> off on the same layout: the layout of the fastest plan that swaps,
      with full recomputation and no swap, against itself with swap and no recomputation (with no plan that
      swaps: the best plan without recomputation, so the row measures recomputation off alone);
    - the paper's high-degree parallelism with recomputation: the best plan with full recomputation whose
      model-parallel size TP x PP is at least a node (8), no swap, against Chameleon's best plan.
    """
    model, hardware, setup = result.model, result.hardware, result.setup
    comparison = result.comparison()
    chameleon = comparison[Approach.SWAP]
    tp = high_tp(scenario, model, hardware)

    def best(space: SearchSpace, wanted=lambda plan: True) -> Plan | None:
        """The fastest plan of ``space`` that fits and is ``wanted`` (None: none, or no layout at all)."""
        try:
            found = search(model, hardware, setup, scenario.devices, space)
        except ValueError:
            return None
        return next((p for p in found.plans if p.feasible and wanted(p)), None)

    tp_high = best(SearchSpace(tp=(tp,), recompute=(RecomputeMode.NONE,), swap=(False,)))
    tp_one = best(SearchSpace(tp=(1,), recompute=(RecomputeMode.NONE,)))
    swapping = comparison["swapping"] or chameleon
    same_layout = full_twin = None
    if swapping is not None:
        twin = dataclasses.replace(swapping.layout, recompute=RecomputeMode.FULL, recompute_layers=0, swap=False)
        plan = evaluate(model, hardware, setup, twin)
        full_twin = plan if plan.feasible else None
        same_layout = swapping
    high_full = best(SearchSpace(recompute=(RecomputeMode.FULL,), swap=(False,)),
                     lambda plan: plan.layout.tp * plan.layout.pp >= tp)
    return [
        FixedComparison(f"TP{tp} -> TP1 with swap", f"best TP{tp} plan, no recomputation, no swap",
                        SMARTSWAP_TP8_TO_TP1, "SmartSwap", tp_high, tp_one),
        FixedComparison("full recomputation -> swap, same layout",
                        "the swap plan's layout with full recomputation, no swap",
                        SMARTSWAP_FULL_RECOMPUTE_OFF, "SmartSwap", full_twin, same_layout),
        FixedComparison("high TP/PP with full recomputation -> best swap plan",
                        f"best plan with full recomputation and TP x PP >= {tp}, no swap",
                        PAPER_HEADLINE, "paper (max)", high_full, chameleon),
    ]


BEST_VS_RECOMPUTE, BEST_VS_PARALLEL = "best vs best recomputation plan", "best vs best TP/PP plan"
GLOBAL_BATCH = "global_batch_size"
GLOBAL_BATCH_PER_DEVICE = (2, 32)  # assumed: the papers give no batch; 16-256 sequences on 8 devices


def scenario_inputs(scenario: Scenario, hardware: HardwareProfile) -> list[AssumedInput]:
    """The hardware profile's assumed inputs and the global batch, which the papers do not give."""
    low, high = (n * scenario.devices for n in GLOBAL_BATCH_PER_DEVICE)
    return [*assumed_inputs(hardware), AssumedInput(GLOBAL_BATCH, scenario.global_batch_size, low, high)]


def _figures(scenario: Scenario, model: ModelProfile, hardware: HardwareProfile,
             overrides: Mapping[str, float]) -> tuple[SearchResult, list[FixedComparison], dict[str, float | None]]:
    batch = int(overrides.get(GLOBAL_BATCH, scenario.global_batch_size))
    varied = dataclasses.replace(scenario, global_batch_size=batch)
    result = search(model, with_inputs(hardware, overrides), _setup(varied), scenario.devices)
    fixed = fixed_comparisons(varied, result)
    c = result.comparison()
    figures = {f.name: f.speedup for f in fixed}
    figures[BEST_VS_RECOMPUTE] = c["speedup_vs_recompute"]
    figures[BEST_VS_PARALLEL] = c["speedup_vs_parallel"]
    return result, fixed, figures


def run_scenario(scenario: Scenario, ranges: bool = False) -> ScenarioResult:
    """The scenario's search and comparisons; with ``ranges``, each speedup also as a range over the assumed
    inputs (``sensitivity.sweep``: two scenario runs per input and up to two corners per figure)."""
    model, hardware = load_model(scenario.model), load_hardware(scenario.hardware)
    result, fixed, figures = _figures(scenario, model, hardware, {})
    out = ScenarioResult(scenario, result, fixed)
    if ranges:
        out.ranges = sweep(lambda overrides: _figures(scenario, model, hardware, overrides)[2],
                           scenario_inputs(scenario, hardware), base=figures)
        for f in fixed:
            f.spread = out.ranges.get(f.name)
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def _plan(plan: Plan | None) -> str:
    return "none fits" if plan is None else f"{plan.layout.describe()} ({plan.iteration_s:.2f} s)"


def _chameleon(plan: Plan | None) -> str:
    if plan is None:
        return "none fits"
    if not plan.swaps:
        return f"no swap needed: {_plan(plan)}"
    return _plan(plan)


def _swap(plan: Plan | None) -> str:
    if plan is None or not plan.swaps:
        return "-"
    return f"{plan.swapped_bytes / 1e9:.0f} GB, stall {plan.time.stall:.2f} s"


def _range(spread: FigureRange | None) -> str:
    if spread is None or spread.low is None:
        return "-"
    most = f"; most: {spread.most}" if spread.most else ""
    return f"{_pct(spread.low)} to {_pct(spread.high)}{most}"


def _verdict(f: FixedComparison) -> str:
    if f.spread is None or f.spread.low is None:
        return "-"
    if f.spread.holds(f.published):
        return "inside the range"
    return "above the range" if f.published > f.spread.high else "below the range"


def _one_per_hardware(results: list[ScenarioResult]) -> list[ScenarioResult]:
    seen: dict[str, ScenarioResult] = {}
    for r in results:
        seen.setdefault(r.scenario.hardware, r)
    return list(seen.values())


def markdown(results: list[ScenarioResult]) -> str:
    """The reproduction tables: best against best, then each published comparison with its baseline named, what
    Chameleon's plan swaps, the predicted speedup, its range over the assumed inputs, and the published figure."""
    lines = [
        "| scenario | Chameleon plan | swapped, stall | best recompute plan | best TP/PP plan | vs recompute | "
        "vs TP/PP |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.result.comparison()
        cells = []
        for key, figure in (("speedup_vs_recompute", BEST_VS_RECOMPUTE), ("speedup_vs_parallel", BEST_VS_PARALLEL)):
            spread = r.ranges.get(figure)
            cells.append(_pct(c[key]) + (f" ({_range(spread)})" if spread is not None else ""))
        lines.append(
            f"| {r.scenario.label()} | {_chameleon(c[Approach.SWAP])} | {_swap(c[Approach.SWAP])} | "
            f"{_plan(c[Approach.RECOMPUTE])} | {_plan(c[Approach.PARALLEL])} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "| scenario | comparison | baseline | Chameleon plan | swapped, stall | predicted | range over assumed inputs "
        "| published | published vs range |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for f in r.fixed:
            lines.append(
                f"| {r.scenario.label()} | {f.name} | {f.baseline_name}: {_plan(f.baseline)} | {_chameleon(f.chameleon)} "
                f"| {_swap(f.chameleon)} | {_pct(f.speedup)} | {_range(f.spread)}"
                f"{' (where a plan fits)' if f.speedup is None and f.spread is not None and f.spread.low is not None else ''}"
                f" | {_pct(f.published)} ({f.source}) "
                f"| {_verdict(f)} |")
    if any(r.ranges for r in results):
        lines += ["", "Assumed inputs swept: " + "; ".join(
            f"{r.scenario.hardware}: " + describe_ranges(scenario_inputs(r.scenario, r.result.hardware))
            for r in _one_per_hardware(results)) + " (the global batch scales with the devices: 2-32 per device)."]
    return "\n".join(lines)


def reproduce(scenarios: tuple[Scenario, ...] = PAPER_SCENARIOS, ranges: bool = True,
              progress: Callable[[int, int, Scenario], None] | None = None) -> list[ScenarioResult]:
    """Every scenario's result; ``progress(index, count, scenario)`` before each (default: one log line)."""
    out = []
    for index, scenario in enumerate(scenarios, 1):
        if progress is None:
            logger.info("reproduction %d/%d: %s", index, len(scenarios), scenario.label())
        else:
            progress(index, len(scenarios), scenario)
        out.append(run_scenario(scenario, ranges=ranges))
    return out


__all__ = ["PAPER_SCENARIOS", "FixedComparison", "Layout", "Scenario", "ScenarioResult", "markdown", "reproduce",
           "run_scenario", "scenario_inputs"]
