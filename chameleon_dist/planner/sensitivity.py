"""Headline figures as ranges over the inputs nobody measured.

A hardware profile marks the inputs it has no source for (``assumed: {field: [low, high]}``); a study may
add its own (the reproduction's global batch, which the papers do not give). ``sweep`` re-evaluates the
figures with each input at its low and at its high end, the others at their values (which input moves a
figure most), and then at the two corners that push every input the way it moved that figure (the joint
extremes one-at-a-time changes miss when effects add up). A figure's range is the smallest and largest value
seen; ``None`` (e.g. no plan fits) is left out of it. The figures are whatever the caller computes from one
evaluation, so one search serves every figure.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup
from chameleon_dist.planner.search import SearchResult, search
from chameleon_dist.planner.space import SearchSpace

logger = logging.getLogger(__name__)

Overrides = Mapping[str, float]
Figures = Mapping[str, float | None]


@dataclasses.dataclass(frozen=True)
class AssumedInput:
    name: str
    value: float
    low: float
    high: float


@dataclasses.dataclass(frozen=True)
class FigureRange:
    """One figure: its value at the profile's inputs, the smallest and largest value over the assumed ranges,
    and the input whose range alone moves it most (with how far)."""

    name: str
    value: float | None
    low: float | None
    high: float | None
    most: str | None  # the input that moves it most on its own (None: no input moves it)
    swing: float  # high minus low over that input's range alone
    low_at: dict[str, float]  # the inputs where the figure is lowest
    high_at: dict[str, float]

    def holds(self, figure: float) -> bool:
        return self.low is not None and self.low <= figure <= self.high

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def assumed_inputs(hardware: HardwareProfile) -> list[AssumedInput]:
    return [AssumedInput(name, getattr(hardware, name), low, high) for name, (low, high) in hardware.assumed.items()]


def with_inputs(hardware: HardwareProfile, overrides: Overrides) -> HardwareProfile:
    """``hardware`` with the overridden fields that are its own (others belong to the caller)."""
    fields = {k: (int(v) if isinstance(getattr(hardware, k), int) else v) for k, v in overrides.items()
              if k in HardwareProfile.model_fields}
    return hardware.model_copy(update=fields) if fields else hardware


def sweep(evaluate: Callable[[Overrides], Figures], inputs: list[AssumedInput],
          base: Figures | None = None) -> dict[str, FigureRange]:
    """Every figure ``evaluate`` returns, as a range over ``inputs`` (see the module docstring). ``base``: the
    figures at the profile's values when the caller has them already (else ``evaluate({})``)."""
    base = dict(evaluate({}) if base is None else base)
    seen: dict[str, list[tuple[float, dict[str, float]]]] = {k: [] for k in base}
    moved: dict[str, dict[str, tuple[float, float]]] = {k: {} for k in base}  # figure -> input -> (at low, at high)

    def record(figures: Figures, at: dict[str, float]) -> None:
        for key, value in figures.items():
            if value is not None and key in seen:
                seen[key].append((value, at))

    record(base, {})
    for item in inputs:
        at_low = evaluate({item.name: item.low})
        at_high = evaluate({item.name: item.high})
        record(at_low, {item.name: item.low})
        record(at_high, {item.name: item.high})
        for key in base:
            if at_low.get(key) is not None and at_high.get(key) is not None:
                moved[key][item.name] = (at_low[key], at_high[key])
        logger.info("sensitivity: %s over [%g, %g] done", item.name, item.low, item.high)
    for key in base:
        if not moved[key]:
            continue
        for sign in (1, -1):  # the corner that raises the figure, then the one that lowers it
            corner = {}
            for item in inputs:
                if item.name in moved[key]:
                    low_value, high_value = moved[key][item.name]
                    if low_value != high_value:
                        corner[item.name] = item.high if (high_value - low_value) * sign > 0 else item.low
            if len(corner) > 1:
                record(evaluate(corner), corner)
    out = {}
    for key, value in base.items():
        values = seen[key]
        swings = {name: abs(high - low) for name, (low, high) in moved[key].items()}
        most = max(swings, key=swings.get) if swings and max(swings.values()) > 0 else None
        low = min(values, key=lambda v: v[0], default=(None, {}))
        high = max(values, key=lambda v: v[0], default=(None, {}))
        out[key] = FigureRange(key, value, low[0], high[0], most, swings.get(most, 0.0), low[1], high[1])
    return out


SEARCH_FIGURES = (  # comparison key -> the figure's words
    ("speedup_vs_recompute", "swap plan vs best recomputation plan"),
    ("speedup_vs_parallel", "swap plan vs best TP/PP plan"),
    ("speedup_vs_best_without_swap", "swap plan vs best plan without swap"),
)
BEST_TIME = "best plan iteration s"


@dataclasses.dataclass
class SearchSensitivity:
    """A search's headline speedups as ranges over its hardware's assumed inputs, and which plan was best where."""

    hardware: str
    inputs: list[AssumedInput]
    ranges: dict[str, FigureRange]
    best_plans: dict[str, list[dict[str, float]]]  # best plan -> the input settings it was best at ({}: the profile's)

    def to_dict(self) -> dict:
        return {"hardware": self.hardware, "inputs": [dataclasses.asdict(i) for i in self.inputs],
                "ranges": {k: v.to_dict() for k, v in self.ranges.items()}, "best_plans": self.best_plans}


def sensitivity_of_search(model: ModelProfile, hardware: HardwareProfile, setup: TrainingSetup, world_size: int,
                          space: SearchSpace, cluster: Any = None, result: SearchResult | None = None
                          ) -> SearchSensitivity:
    """Re-run the search over ``hardware``'s assumed inputs (``sweep``; ``cluster``: as ``search`` takes it;
    ``result``: the search at the profile's values, when the caller has run it)."""
    best_plans: dict[str, list[dict[str, float]]] = {}

    def figures_of(found: SearchResult, overrides: Overrides) -> Figures:
        comparison = found.comparison()
        figures: dict[str, float | None] = {words: comparison[key] for key, words in SEARCH_FIGURES}
        figures[BEST_TIME] = None if found.best is None else found.best.iteration_s
        name = "no plan fits" if found.best is None else found.best.layout.describe()
        best_plans.setdefault(name, []).append(dict(overrides))
        return figures

    def evaluate(overrides: Overrides) -> Figures:
        found = search(model, with_inputs(hardware, overrides), setup, world_size, space, cluster=cluster)
        return figures_of(found, overrides)

    inputs = assumed_inputs(hardware)
    base = None if result is None else figures_of(result, {})
    return SearchSensitivity(hardware.name, inputs, sweep(evaluate, inputs, base), best_plans)


def format_input(name: str, value: float) -> str:
    """An input's value in the units of its name (GB, GB/s)."""
    if name.endswith("_bytes_per_s"):
        return f"{value / 1e9:g} GB/s"
    if name.endswith("_bytes"):
        return f"{value / 1e9:g} GB"
    return f"{value:g}"


def describe_inputs(at: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {format_input(k, v)}" for k, v in at.items()) or "the profile's values"


def describe_ranges(inputs: list[AssumedInput]) -> str:
    """``name low to high`` for each input, in its units."""
    return ", ".join(f"{i.name} {format_input(i.name, i.low)} to {format_input(i.name, i.high)}" for i in inputs)


__all__ = ["BEST_TIME", "SEARCH_FIGURES", "AssumedInput", "FigureRange", "SearchSensitivity", "assumed_inputs",
           "describe_inputs", "describe_ranges", "format_input", "sensitivity_of_search", "sweep", "with_inputs"]
