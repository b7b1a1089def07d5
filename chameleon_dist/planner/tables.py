"""Readable tables and JSON for a :class:`~chameleon_dist.planner.search.SearchResult`."""

from __future__ import annotations

import dataclasses
import textwrap

from chameleon_dist.planner.search import FEASIBLE, OUT_OF_MEMORY, PRUNED, TIE_FRACTION, Plan, SearchResult, preferences
from chameleon_dist.planner.sensitivity import BEST_TIME, SearchSensitivity, describe_inputs, describe_ranges
from chameleon_dist.planner.timing import COMPONENTS

GB = 1e9
COMPARISON_ROWS = (
    ("swap", "best with Chameleon swap"),  # no recomputation, swap where needed
    ("recompute", "best with recomputation"),  # no swap
    ("parallel", "best with TP/PP alone"),  # no swap, no recomputation
)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def _time_parts(plan: Plan) -> str:
    parts = [f"{name.replace('_', ' ')} {getattr(plan.time, name):.2f}" for name in COMPONENTS if getattr(plan.time, name) > 5e-4]
    return " + ".join(parts)


MAX_WIDTH = 120
"""Columns of the text output (wider detail goes to ``--json``)."""


def _fit(line: str, max_width: int = MAX_WIDTH) -> str:
    """``line`` wrapped at ``max_width``, continuation lines indented past its own indent."""
    if len(line) <= max_width:
        return line
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.fill(line, max_width, subsequent_indent=indent, break_on_hyphens=False)


def table(rows: list[list[str]], header: list[str], max_width: int = MAX_WIDTH) -> str:
    """Left-aligned columns; a last column that would pass ``max_width`` wraps onto indented lines."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    last = max(len(header[-1]), min(widths[-1], max_width - indent))
    widths[-1] = last

    def lines_of(cells: list) -> list[str]:
        head = "  ".join(str(c).ljust(w) for c, w in zip(cells[:-1], widths))
        wrapped = textwrap.wrap(str(cells[-1]), last) or [""]
        first = (head + "  " if cells[:-1] else "") + wrapped[0]
        return [first.rstrip()] + [(" " * indent + more).rstrip() for more in wrapped[1:]]

    out = lines_of(header) + ["  ".join("-" * w for w in widths)]
    for r in rows:
        out += lines_of(r)
    return "\n".join(out)


def _swap_cell(plan: Plan) -> str:
    if not plan.layout.swap or not plan.swap:
        return "-"
    return f"{plan.swapped_bytes / GB:.0f} GB, {plan.time.stall:.2f} s"


def plan_row(plan: Plan, best: Plan | None) -> list[str]:
    vs = "-" if best is None or plan.status == OUT_OF_MEMORY else f"{plan.iteration_s / best.iteration_s:.3f}x"
    time_s = f"{plan.iteration_s:.2f}" if plan.status == FEASIBLE else (f">={plan.iteration_s:.2f}" if plan.status == PRUNED else "-")
    free = f"{plan.free_bytes / GB:.1f}" if plan.status == FEASIBLE else "-"
    return [plan.layout.describe(), f"{plan.peak_bytes / GB:.1f}", free, time_s, vs, _swap_cell(plan), plan.reason]


def header_text(result: SearchResult) -> str:
    s, m, h = result.setup, result.model, result.hardware
    return (
        f"chameleon-plan: {m.name} ({m.parameter_count(s.seq_length) / 1e9:.2f} B parameters) on {result.world_size} x "
        f"{h.name} ({h.memory_bytes / GB:.0f} GB, {h.usable_bytes / GB:.0f} GB usable, plans fill at most "
        f"{s.budget_bytes(h) / GB:.1f} GB: --memory-margin {s.memory_margin * 100:g}%; host link "
        f"{h.d2h_bytes_per_s / GB:.0f} GB/s)"
        + ("" if result.cluster is None else f" of {result.cluster.describe(result.world_size)}") + "\n"
        f"training: global batch {s.global_batch_size} x seq {s.seq_length}, {s.precision}, ZeRO stage {s.zero_stage}, "
        f"{s.attention} attention, sequence parallel {'on' if s.sequence_parallel else 'off'}\n"
        f"searched {len(result.plans)} plans ({result.policy_runs} swap estimates) in {result.elapsed_s:.2f} s"
    )


def comparison_text(result: SearchResult) -> str:
    """Best against best, each row with its plan, time, the swap plan's lead and what it swaps; where Chameleon's
    plan needs no swap, the swap row says so and the recomputation-off gain is given on its own."""
    c = result.comparison()
    rows = []
    for key, label in COMPARISON_ROWS:
        plan = c[key]
        if plan is None:
            rows.append([label, "none fits", "-", "-", "-"])
            continue
        describe = plan.layout.describe()
        if key == "swap" and not c["swap_needed"]:
            describe = f"no swap needed: {describe}"
        speed = "-" if key == "swap" else _pct(c[f"speedup_vs_{key}"])
        rows.append([label, describe, f"{plan.iteration_s:.2f}", speed, _swap_cell(plan)])
    text = table(rows, ["comparison", "plan", "s", "swap plan ahead", "swapped, stall"])
    if not c["swap_needed"]:
        swapping = c["swapping"]
        text += "\nno swap needed: the best plan without recomputation fits without swapping"
        if c["recompute_off_gain"] is not None:
            text += (f"; turning recomputation off (best TP/PP plan vs best recomputation plan) gains "
                     f"{_pct(c['recompute_off_gain'])}")
        if swapping is not None:
            text += (f"; the best plan that swaps ({swapping.layout.describe()}) is "
                     f"{_pct(swapping.iteration_s / c['swap'].iteration_s - 1)} slower")
    elif c["speedup_vs_best_without_swap"] is not None:
        text += f"\nswap plan vs the best plan without swap: {_pct(c['speedup_vs_best_without_swap'])}"
    return text


def ties_text(result: SearchResult) -> list[str]:
    """The plans that tie with the best (within the model's error) and the one to prefer, with why."""
    ties = result.ties()
    if len(ties) < 2:
        return []
    best, pick = result.best, result.recommended
    lines = [f"{len(ties) - 1} plan(s) within {TIE_FRACTION * 100:g}% of the best, the cost model's error: a tie."]
    if pick is best:
        lines.append(f"  recommended: the best plan ({best.layout.describe()}): no tie is more standard or "
                     f"has more free memory ({best.free_bytes / GB:.1f} GB free)")
    else:
        lines.append(f"  recommended: {pick.layout.describe()} ({_pct(pick.iteration_s / best.iteration_s - 1)}, "
                     f"{pick.free_bytes / GB:.1f} GB free{preferences(pick, best)})")
    return lines


def text_report(result: SearchResult, top: int = 12) -> str:
    best = result.best
    lines = [header_text(result), ""]
    if best is None:
        lines.append("NO PLAN FITS: " + result.infeasible_message())
    else:
        lines += [
            f"best plan: {best.layout.describe()}: {best.iteration_s:.2f} s per iteration, "
            f"{best.tokens_per_s_per_device():,.0f} tokens/s per device, MFU {best.mfu(result.hardware) * 100:.1f}%",
            f"  time (s): {_time_parts(best)}",
            f"  memory{' without swap' if best.swap else ''}: {best.describe_memory()}",
        ]
        if best.swap:
            lines.append(f"  swap: {best.swapped_bytes / GB:.1f} GB per iteration to the host; predicted peak "
                         f"{best.peak_bytes / GB:.1f} GB of {best.usable_bytes / GB:.1f} GB usable")
        lines.append(f"  free at the peak: {best.free_bytes / GB:.1f} GB of {best.usable_bytes / GB:.1f} GB usable "
                     f"(every plan leaves at least {(best.usable_bytes - best.budget_bytes) / GB:.1f} GB: "
                     f"--memory-margin)")
        lines += ties_text(result)
        lines += ["", comparison_text(result)]
    feasible = [p for p in result.plans if p.status == FEASIBLE]
    shown = feasible[:top]
    extra = [result.comparison()[k] for k, _ in COMPARISON_ROWS] + [result.recommended]
    for plan in extra:
        if plan is not None and plan not in shown:
            shown.append(plan)
    oom = [p for p in result.plans if p.status == OUT_OF_MEMORY]
    pruned = [p for p in result.plans if p.status == PRUNED]
    fastest_oom = sorted(oom, key=lambda p: p.iteration_s)[:3]
    lines += ["", f"alternatives ({len(feasible)} fit, {len(pruned)} pruned, {len(oom)} out of memory; top {len(shown)} "
                  f"that fit and the {len(fastest_oom)} fastest that do not):"]
    rows = [plan_row(p, best) for p in shown + fastest_oom]
    lines.append(table(rows, ["plan", "peak GB", "free GB", "s", "vs best", "swapped, stall", "why not the best"]))
    return "\n".join(_fit(line) for text in lines for line in text.split("\n"))


def sensitivity_text(sensitivity: SearchSensitivity) -> str:
    """The headline speedups as ranges over the assumed inputs, the input that moves each most, and the plans
    that are best somewhere in the ranges."""
    if not sensitivity.inputs:
        return f"sensitivity: {sensitivity.hardware} marks no input as assumed (its `assumed:` block): nothing to sweep"
    inputs = describe_ranges(sensitivity.inputs)
    rows = []
    for name, spread in sensitivity.ranges.items():
        percent = name != BEST_TIME

        def show(value: float | None) -> str:
            return "-" if value is None else (_pct(value) if percent else f"{value:.2f}")

        most = "-" if spread.most is None else (
            f"{spread.most} ({spread.swing * 100:.1f} points)" if percent else f"{spread.most} ({spread.swing:.2f} s)")
        rows.append([name, show(spread.value), f"{show(spread.low)} to {show(spread.high)}", most])
    lines = [f"sensitivity over the assumed inputs of {sensitivity.hardware} ({inputs}):",
             table(rows, ["figure", "at the profile", "range", "moved most by"])]
    if len(sensitivity.best_plans) > 1:
        lines.append("the best plan changes within the ranges:")
        for name, settings in sensitivity.best_plans.items():
            where = "; ".join(describe_inputs(at) for at in settings[:3]) + (" ..." if len(settings) > 3 else "")
            lines.append(f"  {name}: at {where}")
    else:
        lines.append(f"the best plan is the same over the ranges: {next(iter(sensitivity.best_plans))}")
    return "\n".join(_fit(line) for text in lines for line in text.split("\n"))


def result_dict(result: SearchResult, top: int | None = None) -> dict:
    c = result.comparison()
    plans = result.plans if top is None else result.plans[:top]
    return {
        "model": result.model.model_dump(), "hardware": result.hardware.model_dump(),
        "setup": result.setup.model_dump(), "devices": result.world_size,
        "cluster": None if result.cluster is None else result.cluster.model_dump(),
        "elapsed_s": result.elapsed_s, "policy_runs": result.policy_runs,
        "best": None if result.best is None else result.best.to_dict(result.hardware),
        "memory_margin": result.setup.memory_margin,
        "ties": [p.layout.describe() for p in result.ties()],
        "recommended": None if result.recommended is None else result.recommended.layout.describe(),
        "infeasible_message": None if result.best is not None else result.infeasible_message(),
        "comparison": {k: (v.to_dict(result.hardware) if isinstance(v, Plan) else v) for k, v in c.items()},
        "alternatives": [_compact(p) for p in plans],
    }


def _compact(plan: Plan) -> dict:
    return {
        "layout": dataclasses.asdict(plan.layout), "describe": plan.layout.describe(), "status": plan.status,
        "iteration_s": plan.iteration_s, "peak_bytes": plan.peak_bytes, "reason": plan.reason,
        "time": plan.time.to_dict(), "swapped_bytes": plan.swapped_bytes,
        "free_bytes": plan.free_bytes, "budget_bytes": plan.budget_bytes,
        "host_bytes_per_node": [n.host_bytes for n in plan.host_nodes],
    }
