"""The output of ``launch/experiments/bench_scale.py``: the planner's predictions beside the simulated rows, the targets'
arithmetic, the markdown table and the plot. Every figure is simulated (emulated device, meta tensors) or predicted
(the planner's cost model)."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("bench_scale")

APPROACH_OF = {  # variant -> the planner's approach (``planner.single_device.APPROACHES``)
    "reference": "none", "chameleon-swap": "swap", "chameleon-swap-recompute": "swap+recompute",
    "megatron-selective": "selective", "megatron-full": "full",
}
PREDICTION_EFFICIENCY = 1.0
"""The emulated device runs every kernel at its roofline (no MFU below peak): the planner predicts at the same."""

TIME_TOLERANCE, PEAK_TOLERANCE = 0.10, 0.03
PAPER_SPEEDUP = 0.3894  # arXiv 2509.11076: "up to 38.94%" faster than recomputation or high-degree parallelism


def prediction_hardware(preset_figures):
    """The one-device profile the planner predicts an emulated preset with (at ``PREDICTION_EFFICIENCY``)."""
    from chameleon_dist.planner import hardware_from_preset

    return hardware_from_preset(preset_figures, efficiency=PREDICTION_EFFICIENCY)


def planner_predictions(case, args, reference, budgets: list[int], hardware=None) -> dict:
    """``(variant, budget_bytes) -> {"iteration_s", "peak_bytes", "fits", "time_error", "peak_error"}`` from the
    planner for one device. The planner's peak counts a full mixed-precision model state (weights, fp32 gradients,
    Adam); the simulated rank holds bf16 weights and the bf16 gradients backward makes. So the planner is given the
    budget's room for activations (``budget - simulated weights and gradients + planner's static bytes``), and its
    peak is reported as ``simulated weights and gradients + (predicted peak - predicted static)``. ``hardware``: the
    profile to predict with (None: the preset's at ``PREDICTION_EFFICIENCY``; ``launch/experiments/planner_calibration.py``
    passes a calibrated one); ``optimizer_s`` is the planner's optimizer term inside ``iteration_s``."""
    from chameleon_dist.planner import load_model, predict_single_device

    if hardware is None:
        hardware = prediction_hardware(args.preset_figures)
    common = dict(seq_length=args.seq_length, micro_batch_size=1, micro_batches=args.micro_batches,
                  num_layers=case.num_layers, pre_process=case.pre_process, post_process=case.post_process)
    profile = load_model(case.profile)
    try:
        unbounded = predict_single_device(profile, hardware, **common, approaches=("none",))["none"]
    except Exception as error:  # noqa: BLE001 - the planner may not model this shape; the rows still stand
        logger.warning("no planner prediction for %s: %s", case.name, error)
        return {}
    out = {}
    for budget in sorted(set(budgets)):
        state_bytes = 2 * reference.model_state_bytes  # weights and their gradients (one dtype)
        room = budget - state_bytes + unbounded.static_bytes
        predicted = predict_single_device(profile, hardware, **common, budget_bytes=max(room, 1))
        for variant, approach in APPROACH_OF.items():
            p = predicted[approach]
            out[(variant, budget)] = {"iteration_s": p.iteration_s, "fits": p.fits, "stall_s": p.stall_s,
                                      "optimizer_s": p.time.optimizer,
                                      "peak_bytes": state_bytes + p.peak_bytes - p.static_bytes}
    return out


def _errors(row: dict) -> None:
    predicted = row.get("predicted")
    if not predicted or not row["iteration_s"]:
        return
    predicted["time_error"] = predicted["iteration_s"] / row["iteration_s"] - 1
    predicted["peak_error"] = predicted["peak_bytes"] / row["peak_bytes"] - 1 if row["peak_bytes"] else None


def targets(result: dict, limit_ratio: float) -> dict:
    """The issue's targets, as arithmetic on the rows: swap + recompute no slower than the fastest Megatron
    recomputation that fits the same budget, its speedup over full recomputation, and the limit's share of the
    physical bound."""
    by_budget: dict[float, dict[str, dict]] = {}
    for row in result["rows"]:
        _errors(row)
        by_budget.setdefault(row["budget"], {})[row["variant"]] = row
    per_budget = []
    for budget, rows in sorted(by_budget.items(), reverse=True):
        ours = rows.get("chameleon-swap-recompute")
        megatron = [r for name, r in rows.items() if name.startswith("megatron-") and "+" not in name and r["fits"]]
        fastest = min(megatron, key=lambda r: r["iteration_s"], default=None)
        full = rows.get("megatron-full")
        entry = {"budget": budget, "chameleon_fits": bool(ours and ours["fits"]),
                 "fastest_megatron": fastest["variant"] if fastest else None}
        if ours and ours["fits"]:
            if fastest is not None:
                entry["no_slower_than_megatron"] = ours["iteration_s"] <= fastest["iteration_s"]
            if full is not None and full["iteration_s"]:
                entry["speedup_over_full"] = full["iteration_s"] / ours["iteration_s"] - 1
        per_budget.append(entry)
    limit = result.get("limit")
    out = {"per_budget": per_budget, "paper_speedup": PAPER_SPEEDUP, "limit_ratio": limit_ratio}
    if limit:
        out["limit_met"] = limit["ratio"] is not None and limit["ratio"] >= limit["target"]
    return out


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.0%}"


def markdown(result: dict) -> str:
    ref, bound = result["reference"], result["bound"]
    lines = [
        f"### {result['describe']} on {result['preset']}, {result['micro_batches']} micro-batches (simulated)",
        "",
        f"Reference (no swap, unbounded): {ref['iteration_s'] * 1e3:.1f} ms, peak {_gib(ref['peak_bytes'])} GiB "
        f"(model state {_gib(ref['model_state_bytes'])} GiB, saved {_gib(ref['saved_bytes'])} GiB). Physical bound: "
        f"the link moves {bound['share']:.1%} of the saved bytes ({_gib(bound['movable_bytes'])} GiB) in the "
        f"forward's shadow ({bound['forward_s'] * 1e3:.1f} ms of layer forward at {bound['d2h_bytes_per_s'] / 1e9:.0f} "
        f"GB/s); at most {_gib(bound['movable_bytes_per_micro_batch'])} GiB off one micro-batch's peak.",
        "",
        "| budget | variant | fits | ratio | peak GiB | stall ms | moved | bound | moved/bound | stages "
        "| planner ms (err) | planner peak GiB (err) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        p = row.get("predicted") or {}
        planner_time = f"{p['iteration_s'] * 1e3:.0f} ({_pct(p.get('time_error'))})" if p else "-"
        planner_peak = f"{_gib(p['peak_bytes'])} ({_pct(p.get('peak_error'))})" if p else "-"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        over = "-" if row["share_over_bound"] is None else f"{row['share_over_bound']:.2f}"
        lines.append(
            f"| {row['budget']:.2f} ({_gib(row['budget_bytes'])}) | {row['variant']} | {'yes' if row['fits'] else 'no'} "
            f"| {ratio} | {_gib(row['peak_bytes'])} | {row['stall_s'] * 1e3:.1f} | {row['moved_share']:.1%} "
            f"| {row['bound_share']:.1%} | {over} | {row['stages'] + ('' if row['settled'] else ' (not settled)') if row['stages'] else row['error'][:30]} "
            f"| {planner_time} | {planner_peak} |")
    limit = result.get("limit")
    if limit:
        lines += ["", f"Limit (Chameleon swap-only within {result['targets']['limit_ratio']}x): budget "
                      f"{_gib(limit['budget_bytes'])} GiB, saves {_gib(limit['saved_bytes'])} GiB of the bound's "
                      f"{_gib(limit['bound_saved_bytes'])} GiB = {limit['ratio']:.1%} (target 90%: "
                      f"{'met' if result['targets'].get('limit_met') else 'missed'})."]
    for entry in result["targets"]["per_budget"]:
        if "speedup_over_full" in entry:
            lines.append(f"- budget {entry['budget']:.2f}: swap + recompute vs full recomputation "
                         f"{entry['speedup_over_full']:+.1%} (paper: up to +{PAPER_SPEEDUP:.2%}); no slower than the "
                         f"fastest Megatron recomputation that fits ({entry['fastest_megatron']}): "
                         f"{entry.get('no_slower_than_megatron', 'none fits')}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Ratio against budget, one line per variant (simulated)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return
    figure, axes = plt.subplots(figsize=(7, 4.5))
    variants = sorted({r["variant"] for r in result["rows"]})
    for variant in variants:
        points = sorted((r["budget"], r["ratio"]) for r in result["rows"] if r["variant"] == variant and r["fits"])
        if points:
            axes.plot(*zip(*points), marker="o", label=variant)
    axes.set_xlabel("budget (fraction of the unswapped peak)")
    axes.set_ylabel("iteration time / reference")
    axes.set_title(f"{result['describe']}, {result['preset']} (simulated)", fontsize=9)
    axes.invert_xaxis()
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
