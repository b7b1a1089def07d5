"""Host RAM per node bounds the swap plans: the ranks of one node share its RAM.

Megatron orders ranks TP innermost, then CP, then DP, then PP (``RankGenerator``'s default order,
``tp-cp-ep-dp-pp``; EP lies inside DP), so pipeline stage ``s`` is the ``tp cp dp`` consecutive ranks from
``s tp cp dp``, and node ``n`` the ``devices_per_node`` consecutive ranks from ``n devices_per_node``. A
node whose ranks are all in one stage holds ``devices_per_node`` copies of that stage's host residency; a
node that straddles stages (``tp cp dp < devices_per_node``, or a stage width that does not divide the node)
holds the sum over its stages.

The node's swap budget is ``host_memory_bytes x host_swap_fraction``; a node the job fills only in part
gets the share of its devices in use (its other devices may run another job). A swap plan fits only if
every node's sum fits (``node_host_use``). What each stage's policy may fill per rank
(``fit_host_memory``): first the most one of its ranks can hold on any node holding it, the node's budget
over the ranks of *that stage* there (ranks of one stage run the same trace, so an equal split among them
is exact; a neighbour stage that swaps little leaves its share unused); since the policy fills what it is
given, a node that then overflows gets its largest consumer re-run with what the node's other ranks leave
it; failing that, every stage gets the node's equal share per device (what the policy was given before
nodes were summed). A stage between the first and the last is not simulated: where it does not fit
without swapping, the first stage's residency stands for it (``host_source``).

Host residency follows the policy generator's own accounting of ``host_budget_bytes``: a swapped storage
occupies host memory from the op after its last forward use to its first backward use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from chameleon_dist.planner.layout import Layout
from chameleon_dist.planner.memory import stage_memory
from chameleon_dist.planner.profiles import HardwareProfile, ModelProfile, TrainingSetup

GB = 1e9


class _Estimate(Protocol):
    stage: int
    feasible: bool
    host_bytes: int


E = TypeVar("E", bound=_Estimate)


def ranks_per_stage(layout: Layout) -> int:
    """Ranks of one pipeline stage: TP x CP x DP (CP: context parallelism, 1 where the layout has none)."""
    return layout.tp * layout.cp * layout.dp


def node_stage_ranks(layout: Layout, devices_per_node: int) -> list[dict[int, int]]:
    """Per node the job uses, in node order: ``{stage: ranks of that stage on the node}``."""
    per_stage = ranks_per_stage(layout)
    world = per_stage * layout.pp
    nodes = []
    for start in range(0, world, devices_per_node):
        end = min(start + devices_per_node, world)
        counts = {}
        for stage in range(start // per_stage, (end - 1) // per_stage + 1):
            counts[stage] = min(end, (stage + 1) * per_stage) - max(start, stage * per_stage)
        nodes.append(counts)
    return nodes


def node_budget_bytes(hardware: HardwareProfile, ranks_on_node: int) -> int:
    """Host memory swapped activations may fill on a node where the job has ``ranks_on_node`` ranks."""
    whole = int(hardware.host_memory_bytes * hardware.host_swap_fraction)
    return whole * min(ranks_on_node, hardware.devices_per_node) // hardware.devices_per_node


def stage_host_budget_bytes(hardware: HardwareProfile, layout: Layout, stage: int) -> int:
    """The most host memory one rank of ``stage`` may fill: on every node holding the stage, the node's
    budget over the stage's ranks there (module docstring)."""
    shares = [node_budget_bytes(hardware, sum(counts.values())) // counts[stage]
              for counts in node_stage_ranks(layout, hardware.devices_per_node) if stage in counts]
    return min(shares)


def host_source(model: ModelProfile, setup: TrainingSetup, layout: Layout, estimated: set[int],
                usable_bytes: int) -> Callable[[int], int | None]:
    """Which swap-model run stands for a stage's host residency (``estimated``: the stages it ran, the first
    and the last where they do not fit without swapping): the stage's own; for a stage between them that
    does not fit without swapping, the first stage's, a bound (it holds the same layers with fewer
    micro-batches in flight and no embedding, so it has less to move); None: the stage swaps nothing."""
    cache: dict[int, int | None] = {}

    def source(stage: int) -> int | None:
        if stage in estimated:
            return stage
        if stage in (0, layout.pp - 1) or 0 not in estimated:
            return None
        if stage not in cache:
            cache[stage] = 0 if stage_memory(model, setup, layout, stage).peak_bytes > usable_bytes else None
        return cache[stage]

    return source


@dataclasses.dataclass(frozen=True)
class NodeHostUse:
    """One node's swapped-activation host memory: the sum over its ranks."""

    node: int
    stage_ranks: dict[int, int]  # stage -> ranks of that stage on the node
    stage_host_bytes: dict[int, int]  # stage -> host bytes of one of its ranks
    host_bytes: int
    budget_bytes: int

    @property
    def ranks(self) -> int:
        return sum(self.stage_ranks.values())

    @property
    def fits(self) -> bool:
        return self.host_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        return {"node": self.node, "ranks": self.ranks, "host_bytes": self.host_bytes,
                "budget_bytes": self.budget_bytes,
                "stages": [{"stage": s, "ranks": k, "host_bytes_per_rank": self.stage_host_bytes[s]}
                           for s, k in self.stage_ranks.items()]}


def node_host_use(hardware: HardwareProfile, layout: Layout, stage_host_bytes: Callable[[int], int]) -> list[NodeHostUse]:
    """Every node's host residency, from ``stage_host_bytes(stage)`` (one rank's) and the rank order."""
    out = []
    for node, counts in enumerate(node_stage_ranks(layout, hardware.devices_per_node)):
        per_rank = {stage: stage_host_bytes(stage) for stage in counts}
        total = sum(k * per_rank[stage] for stage, k in counts.items())
        out.append(NodeHostUse(node, counts, per_rank, total, node_budget_bytes(hardware, sum(counts.values()))))
    return out


def overflow_reason(nodes: Sequence[NodeHostUse], hardware: HardwareProfile, owner: str) -> str:
    """Why a plan does not fit the host RAM per node, naming the setting (``owner``: where it comes from)."""
    worst = max(nodes, key=lambda n: n.host_bytes - n.budget_bytes)
    parts = " + ".join(f"{k} ranks of stage {s} x {worst.stage_host_bytes[s] / GB:.1f} GB"
                       for s, k in worst.stage_ranks.items() if worst.stage_host_bytes[s])
    share = "" if worst.ranks >= hardware.devices_per_node else f", its share for {worst.ranks} of {hardware.devices_per_node} devices"
    return (f"out of memory in host RAM per node: node {worst.node} would hold {worst.host_bytes / GB:.1f} GB of "
            f"swapped activations ({parts}) > {worst.budget_bytes / GB:.1f} GB (host_memory_bytes "
            f"{hardware.host_memory_bytes / GB:.0f} GB x host_swap_fraction {hardware.host_swap_fraction:g}{share}, "
            f"{owner}); raise host_memory_bytes or host_swap_fraction, or use more devices")


def fit_host_memory(hardware: HardwareProfile, layout: Layout, stages: Sequence[int], run: Callable[[int, int], E],
                    source: Callable[[int], int | None]) -> tuple[dict[int, E], list[NodeHostUse]]:
    """Each of ``stages``' swap estimates (``run(stage, host_budget_bytes)``) and the host RAM per node they
    add up to. First every stage gets the most its nodes allow one of its ranks (``stage_host_budget_bytes``).
    The policy fills what it is given (more on the host, less stall), so where a node then overflows, the
    largest consumer of each such node runs again with what the node's other ranks leave it; failing that,
    every stage gets the node's equal share per device. The first that fits every node is kept, else the
    first (its node sums say why it does not fit)."""
    def use(found: dict[int, E]) -> list[NodeHostUse]:
        def host_of(stage: int) -> int:
            src = source(stage)
            return 0 if src is None else found[src].host_bytes

        return node_host_use(hardware, layout, host_of)

    def fits(found: dict[int, E], nodes: list[NodeHostUse]) -> bool:
        return all(e.feasible for e in found.values()) and all(n.fits for n in nodes)

    budgets = {stage: stage_host_budget_bytes(hardware, layout, stage) for stage in stages}
    first = {stage: run(stage, budgets[stage]) for stage in stages}
    first_nodes = use(first)
    if fits(first, first_nodes) or not all(e.feasible for e in first.values()):
        return first, first_nodes
    leftover = _leftover_budgets(hardware, layout, first, first_nodes, source)
    if leftover:
        found = {**first, **{stage: run(stage, budget) for stage, budget in leftover.items()}}
        nodes = use(found)
        if fits(found, nodes):
            return found, nodes
    equal = hardware.host_swap_budget_bytes()  # the node's budget split evenly over its devices
    if any(budget > equal for budget in budgets.values()):
        found = {stage: run(stage, equal) for stage in stages}
        nodes = use(found)
        if fits(found, nodes):
            return found, nodes
    return first, first_nodes


def _leftover_budgets(hardware: HardwareProfile, layout: Layout, found: dict[int, E], nodes: list[NodeHostUse],
                      source: Callable[[int], int | None]) -> dict[int, int]:
    """For the largest consumer of each overflowing node: per rank, the least any of its nodes leaves once the
    node's other ranks hold what they hold now."""
    layout_nodes = node_stage_ranks(layout, hardware.devices_per_node)
    rerun = set()
    for counts, node in zip(layout_nodes, nodes):
        sources = {source(stage) for stage in counts} - {None}
        if not node.fits and sources:
            rerun.add(max(sources, key=lambda src: (found[src].host_bytes, -src)))
    budgets: dict[int, int] = {}
    for counts, node in zip(layout_nodes, nodes):
        mine = sum(k for stage, k in counts.items() if source(stage) in rerun)
        if not mine:
            continue
        others = sum(k * found[src].host_bytes for stage, k in counts.items()
                     if (src := source(stage)) is not None and src not in rerun)
        share = max(0, node.budget_bytes - others) // mine
        for stage in counts:
            if (src := source(stage)) in rerun:
                budgets[src] = min(budgets.get(src, share), share)
    return budgets


HOST_FULL_FRACTION = 0.9
"""A failed stage whose host residency is this much of its host budget per rank reads as stopped by it too (the
generator's "all candidates" fallback does not say when the host budget left some out)."""


def host_budget_words(hardware: HardwareProfile, layout: Layout, stage: int, host_bytes: int, owner: str,
                      stopped: bool) -> str:
    """Where a failed stage's host budget per rank comes from, when the budget stopped its policy (``stopped``)
    or the policy filled it; empty otherwise."""
    budget = stage_host_budget_bytes(hardware, layout, stage)
    if not stopped and host_bytes < HOST_FULL_FRACTION * budget:
        return ""
    ranks = max(counts[stage] for counts in node_stage_ranks(layout, hardware.devices_per_node) if stage in counts)
    return (f"; its host budget is full: {host_bytes / GB:.1f} of {budget / GB:.1f} GB per rank, host RAM per node "
            f"(host_memory_bytes {hardware.host_memory_bytes / GB:.0f} GB x host_swap_fraction "
            f"{hardware.host_swap_fraction:g} {owner}) over the {ranks} ranks of stage {stage} on a node")


__all__ = ["NodeHostUse", "fit_host_memory", "host_source",
           "node_budget_bytes", "node_host_use", "node_stage_ranks", "overflow_reason", "host_budget_words",
           "ranks_per_stage", "stage_host_budget_bytes"]
