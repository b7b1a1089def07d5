"""LLM shapes in simulation (issue 28): real Megatron-core layers at real shapes on meta tensors, through the same
runtime on the emulated device, measured against the host link's physical bound and against recomputation.

For each budget (a fraction of the unswapped peak) it runs every variant of ``scale_runs.VARIANTS`` and writes one
row per variant: the simulated iteration time and its ratio to the reference (no swap on an unbounded device), the
peak against the budget, the stall, the share of saved bytes moved off the device, and the physical bound for that
shape and preset (``scale_bound.link_bound``: the share the link can move in the forward pass's shadow, from the
same roofline) with Chameleon's achieved share over it; beside each, the planner's prediction
(``planner.single_device``) and its error. ``--find-limit`` bisects for the smallest budget at which Chameleon
swap-only stays within ``LIMIT_RATIO`` of the reference. Every figure is simulated (emulated device, meta tensors).

    python -m launch.experiments.bench_scale --model llama2-7b --preset h100-pcie --budgets 0.9,0.8,0.7 --find-limit \\
        --json runs/scale_llama2-7b_h100-pcie.json
    python -m launch.experiments.bench_scale --quick    # CI: 2 layers, a short sequence (checks the script, not the figures)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from chameleon_dist.schema_version import versioned
from launch.experiments.scale_bound import link_bound
from launch.experiments.scale_report import markdown, planner_predictions, plot, targets
from launch.experiments.scale_runs import CASES, VARIANTS, Case, VariantRun, model_state_bytes, run_variant, settings_of

logger = logging.getLogger("bench_scale")

LIMIT_RATIO = 1.03
"""``--find-limit``: the slowest Chameleon swap-only may be against the reference."""

LIMIT_SEARCH_OVER_BOUND = 1.5
"""``--find-limit`` searches savings up to this multiple of the physical bound's."""

QUICK = {"num_layers": 2, "seq_length": 1024, "budgets": (0.95, 0.9), "micro_batches": 2, "limit_steps": 3}


class BadInput(ValueError):
    """A command-line value that cannot run: the message names the flag."""


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise BadInput(f"--budgets {text!r}: give fractions of the unswapped peak, e.g. 0.9,0.8,0.7") from None
    bad = [v for v in values if not 0 < v <= 1]
    if not values or bad:
        raise BadInput(f"--budgets {text!r}: every budget must be in (0, 1] (a fraction of the unswapped peak)")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launch.experiments.bench_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama2-7b", help=f"one of {', '.join(CASES)}")
    parser.add_argument("--preset", default="h100-pcie", help="the emulated accelerator (device.preset)")
    parser.add_argument("--budgets", default="0.9,0.8,0.7,0.6", help="fractions of the unswapped peak, in (0, 1]")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per iteration (Megatron's schedule)")
    parser.add_argument("--seq-length", type=int, default=None, help="default: the model profile's")
    parser.add_argument("--layers", type=int, default=None, help="layers on the device (default: the case's)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    parser.add_argument("--find-limit", action="store_true", help="bisect for the smallest budget within "
                        f"{LIMIT_RATIO}x of the reference (Chameleon swap-only)")
    parser.add_argument("--limit-steps", type=int, default=6, help="bisection steps of --find-limit")
    parser.add_argument("--max-iterations", type=int, default=14, help="iterations per Chameleon variant at most")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table here too")
    parser.add_argument("--png", type=Path, default=None, help="plot ratio against budget per variant")
    parser.add_argument("--quick", action="store_true", help="CI size: 2 layers, seq 256, two budgets")
    args = parser.parse_args(argv)
    if args.model not in CASES:
        raise BadInput(f"--model {args.model!r} does not exist; choose one of {', '.join(CASES)}")
    from chameleon_dist.device.presets import get_preset

    try:
        args.preset_figures = get_preset(args.preset)
    except ValueError as error:
        raise BadInput(f"--preset: {error}") from None
    args.budget_fractions = QUICK["budgets"] if args.quick and args.budgets == parser.get_default("budgets") \
        else _fractions(args.budgets)
    args.variant_list = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    for variant in args.variant_list:
        if variant not in VARIANTS:
            raise BadInput(f"--variants: {variant!r} is not one of {', '.join(VARIANTS)}")
    if args.micro_batches < 1:
        raise BadInput(f"--micro-batches {args.micro_batches}: must be >= 1")
    if args.quick:
        args.layers = args.layers or QUICK["num_layers"]
        args.seq_length = args.seq_length or QUICK["seq_length"]
        args.limit_steps = min(args.limit_steps, QUICK["limit_steps"])
    from chameleon_dist.planner import load_model

    profile = load_model(CASES[args.model].profile)
    args.seq_length = args.seq_length or profile.seq_length
    if args.seq_length < 1:
        raise BadInput(f"--seq-length {args.seq_length}: must be >= 1")
    if args.layers is not None and not 1 <= args.layers <= profile.num_layers:
        raise BadInput(f"--layers {args.layers}: {profile.name} has 1..{profile.num_layers} layers")
    return args


def _case(args: argparse.Namespace) -> Case:
    case = CASES[args.model]
    return dataclasses.replace(case, num_layers=args.layers) if args.layers is not None else case


def _row(args, case: Case, fraction: float, budget_bytes: int, run: VariantRun, reference: VariantRun,
         bound_share: float) -> dict:
    fits = run.completed and run.peak_bytes <= budget_bytes
    moved_share = run.swap_out_bytes / run.saved_bytes if run.saved_bytes else 0.0
    return {
        "model": case.name, "preset": args.preset, "budget": fraction, "budget_bytes": budget_bytes,
        "variant": run.variant, "fits": fits,
        "ratio": run.iteration_s / reference.iteration_s if run.completed and reference.iteration_s else None,
        "iteration_s": run.iteration_s, "peak_bytes": run.peak_bytes, "stall_s": run.stall_s,
        "moved_share": moved_share, "bound_share": bound_share,
        "share_over_bound": moved_share / bound_share if bound_share else None,
        "swap_out_bytes": run.swap_out_bytes, "recomputed_bytes": run.recomputed_bytes,
        "saved_bytes": run.saved_bytes, "stages": run.stages, "oom_retries": run.oom_retries, "error": run.error,
        "passive_swaps": run.passive_swaps, "figure_lag": run.figure_lag,
        # (a Chameleon run that did not end in Stable reports a WarmUp or GenPolicy iteration's figure)
        "settled": run.stages.endswith("M") or run.stages.endswith("SS"),
    }


def _run(case: Case, variant: str, budget_bytes: int | None, args) -> VariantRun:
    return run_variant(case, variant, budget_bytes, preset=args.preset, seq_length=args.seq_length,
                       micro_batches=args.micro_batches, max_iterations=args.max_iterations)


def find_limit(case: Case, args, reference: VariantRun, bound_movable_bytes: int) -> dict:
    """Bisect the budget for the smallest one at which Chameleon swap-only fits within ``LIMIT_RATIO`` of the
    reference, between the unswapped peak (fits unswapped) and ``LIMIT_SEARCH_OVER_BOUND`` times the bound's saving
    below it (swap-only cannot hide more than the link moves: the steps go where the answer is)."""
    high = reference.peak_bytes
    low = max(reference.model_state_bytes, high - int(LIMIT_SEARCH_OVER_BOUND * max(bound_movable_bytes, 1 << 20)))
    best: VariantRun | None = None
    for step in range(args.limit_steps):
        budget = (low + high) // 2
        run = _run(case, "chameleon-swap", budget, args)
        ratio = run.iteration_s / reference.iteration_s if run.completed else float("inf")
        ok = run.completed and run.peak_bytes <= budget and ratio <= LIMIT_RATIO
        logger.info("limit step %d: budget %.2f GiB -> %s (ratio %.3f)", step + 1, budget / 2**30,
                    "holds" if ok else "misses", ratio)
        if ok:
            high, best = budget, run
        else:
            low = budget
    saved = reference.peak_bytes - high
    return {"budget_bytes": high, "saved_bytes": saved, "bound_saved_bytes": bound_movable_bytes,
            "ratio": saved / bound_movable_bytes if bound_movable_bytes else None,
            "iteration_ratio": best.iteration_s / reference.iteration_s if best is not None else 1.0,
            "steps": args.limit_steps, "target": 0.9}


def run(args: argparse.Namespace) -> dict:
    from chameleon_dist.integrations.megatron import megatron_meta_session

    case = _case(args)
    preset = args.preset_figures
    with megatron_meta_session():
        state_bytes = model_state_bytes(case, args.seq_length)
        if state_bytes > preset.memory_bytes:
            raise BadInput(f"{case.describe(args.seq_length)}: its parameters and gradients alone "
                           f"({state_bytes / 1e9:.1f} GB) exceed {args.preset}'s {preset.memory_bytes / 1e9:.0f} GB: "
                           "choose fewer --layers or a larger --preset")
        reference = _run(case, "reference", None, args)
        bound = link_bound(reference.saved_segments, reference.trace.layer_times_s, preset.d2h_bytes_per_s)
        alone = {v: _run(case, v, None, args) for v in ("megatron-selective", "megatron-full")
                 if v in args.variant_list or f"{v}+chameleon" in args.variant_list}
        rows = []
        for fraction in args.budget_fractions:
            budget_bytes = int(fraction * reference.peak_bytes)
            for variant in args.variant_list:
                recompute, chameleon_on, _ = settings_of(variant)
                if variant == "reference":
                    result = reference
                elif not chameleon_on:
                    result = alone[variant]
                elif recompute is not None and alone[f"megatron-{recompute}"].peak_bytes <= budget_bytes:
                    continue  # Megatron's recomputation fits by itself: no Chameleon row needed
                else:
                    result = _run(case, variant, budget_bytes, args)
                rows.append(_row(args, case, fraction, budget_bytes, result, reference, bound.share))
        limit = find_limit(case, args, reference, bound.movable_bytes_per_micro_batch) if args.find_limit else None
    predictions = planner_predictions(case, args, reference, [r["budget_bytes"] for r in rows])
    for row in rows:
        row["predicted"] = predictions.get((row["variant"], row["budget_bytes"]))
    result = {
        "simulated": True, "model": case.name, "describe": case.describe(args.seq_length), "preset": args.preset,
        "seq_length": args.seq_length, "micro_batches": args.micro_batches, "quick": args.quick,
        "reference": {"iteration_s": reference.iteration_s, "peak_bytes": reference.peak_bytes,
                      "model_state_bytes": reference.model_state_bytes, "saved_bytes": bound.saved_bytes},
        "bound": {"share": bound.share, "movable_bytes": bound.movable_bytes, "saved_bytes": bound.saved_bytes,
                  "movable_bytes_per_micro_batch": bound.movable_bytes_per_micro_batch,
                  "forward_s": bound.forward_s, "d2h_bytes_per_s": preset.d2h_bytes_per_s},
        "rows": rows, "limit": limit,
    }
    result["targets"] = targets(result, LIMIT_RATIO)
    return result


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args = parse_args(argv)
        result = run(args)
    except BadInput as error:
        print(f"bench_scale: {error}", file=sys.stderr)
        return 2
    table = markdown(result)
    print(table)
    for path, text in ((args.json, json.dumps(versioned(result), indent=1)), (args.markdown, table)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
    if args.png is not None:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
