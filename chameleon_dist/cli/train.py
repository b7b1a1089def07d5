"""``chameleon-train``: a Megatron-core GPT on the emulated device, without and with Chameleon.

Three runs of the same model and data: (1) a reference on an unconstrained emulated device, (2) without
Chameleon on a device smaller than the model's unswapped peak (runs out of memory), (3) with Chameleon on
that device (trains; losses and final parameters bit-identical to the reference). Writes a run folder
with ``report.json`` and ``memory.png``: live device memory after every op of the model in the first
Stable iteration (under the chosen policy), without and with Chameleon, and the run with Chameleon's
WarmUp iteration 2 (swaps every eligible tensor), all on one x axis of the model's own ops.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import logging
import sys
import warnings
from pathlib import Path

from chameleon_dist.cli.plot import Curve, plot_memory
from chameleon_dist.config import ConfigError
from chameleon_dist.schema_version import versioned
from chameleon_dist.units import format_bytes

MiB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="chameleon-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="YAML job file merged over configs/jobs/train_gpt_cpu.yaml")
    parser.add_argument("--iterations", type=int, help="override train.iterations")
    parser.add_argument("--capacity", help='override chameleon.device.capacity (e.g. "96MiB")')
    parser.add_argument("--run-dir", type=Path, default=Path("runs"), help="where run folders go (default: runs/)")
    parser.add_argument("--log-level", default="WARNING", help="library log level (default: WARNING)")
    return parser.parse_args(argv)


def _overrides(args: argparse.Namespace) -> dict:
    overrides: dict = {}
    if args.iterations is not None:
        overrides["train"] = {"iterations": args.iterations}
    if args.capacity is not None:
        overrides["chameleon"] = {"device": {"capacity": args.capacity}}
    return overrides


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f}"


def _progress_line(result, report, loss) -> None:
    total = len(result.reports) and result.reports[-1].iteration
    swapped = (
        f" | out {_mib(report.swap_out_bytes)} in {_mib(report.swap_in_bytes)} MiB | stall {report.stall_s * 1e3:5.0f} ms"
        if report.enabled
        else ""
    )
    capacity = "" if report.capacity_bytes >= sys.maxsize else f"/{_mib(report.capacity_bytes)}"
    print(
        f"  iter {total:3d} | loss {loss.item():.4f} | stage {report.stage:10s} | peak "
        f"{_mib(report.peak_device_bytes)}{capacity} MiB{swapped} | {report.iteration_s:.2f} s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Megatron warns about optional CUDA packages (Apex, Transformer Engine) and upcoming API changes on
    # every model build; on a CPU demo that is noise.
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    from chameleon_dist.cli import train_job  # imports Megatron: after argument parsing

    try:
        job = train_job.load_job(args.config, _overrides(args))
    except ConfigError as exc:
        print(f"chameleon-train: {exc}", file=sys.stderr)
        return 2
    run_dir = args.run_dir / f"chameleon-train-{dt.datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    shape, settings, config = job.model, job.train, job.chameleon
    disabled = config.model_copy(update={"enabled": False})
    enabled = config.model_copy(update={"enabled": True})

    device = train_job.constrained_device(enabled)
    link = device.describe()
    print(
        f"chameleon-train: Megatron-core GPTModel ({shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads} heads, seq {shape.seq_length}, micro-batch {shape.micro_batch_size} x "
        f"{settings.micro_batches}) for {settings.iterations} iterations on an EMULATED device of "
        f"{format_bytes(device.capacity_bytes)}; {link}",
        flush=True,
    )
    print("[1/3] reference: unconstrained emulated device, no swapping", flush=True)
    reference = train_job.train(
        job, "reference", train_job.for_unconstrained_device(disabled), train_job.unconstrained_device(disabled),
        _progress_line
    )
    print(f"[2/3] without Chameleon on {format_bytes(device.capacity_bytes)}", flush=True)
    without = train_job.train(job, "without", disabled, train_job.constrained_device(disabled))
    print("  " + _outcome(without, settings.iterations), flush=True)
    print(f"[3/3] with Chameleon on {format_bytes(device.capacity_bytes)}", flush=True)
    with_chameleon = train_job.train(job, "with", enabled, device, _progress_line)
    parity = train_job.compare(reference, with_chameleon)

    runs = [("reference (unconstrained)", reference), ("without Chameleon", without), ("with Chameleon", with_chameleon)]
    print(_summary(runs, settings.iterations, parity, device.capacity_bytes))
    if without.out_of_memory is None:
        print(
            f"note: without Chameleon the run fit in {format_bytes(device.capacity_bytes)}; set "
            f"chameleon.device.capacity below the reference peak ({format_bytes(reference.peak_bytes())}) to see the contrast"
        )
    curves = _curves(reference, with_chameleon)
    plot = plot_memory(
        run_dir / "memory.png",
        [curve for curve, _ in curves],
        device.capacity_bytes,
        f"GPT {shape.num_layers}x{shape.hidden_size}: device memory per op of the model (emulated)",
    )
    print(_plot_note(curves, settings, config))
    report = {
        "emulated": True,
        "job": job.model_dump(mode="json"),
        "device": {"name": device.name, "capacity_bytes": device.capacity_bytes,
                   "h2d_bytes_per_s": _json_rate(device.h2d_bytes_per_s),
                   "d2h_bytes_per_s": _json_rate(device.d2h_bytes_per_s),
                   "model": dataclasses.asdict(device.model)},
        "runs": {result.label: _run_json(result) for _, result in runs},
        "parity": {**vars(parity), "bit_identical": parity.bit_identical},
        "plot": {"file": plot.name, "curves": [_curve_json(curve, run, timeline) for curve, (run, timeline) in curves]},
    }
    (run_dir / "report.json").write_text(json.dumps(versioned(report), indent=2))
    print(f"run folder: {run_dir}/ (report.json, {plot.name})")
    return 0 if with_chameleon.completed == settings.iterations and parity.bit_identical else 1


def _json_rate(bytes_per_s: float | None) -> float | None:
    """A link rate for JSON: null for an instant link (JSON has no infinity)."""
    return None if bytes_per_s is None or math.isinf(bytes_per_s) else bytes_per_s


def _outcome(result, iterations: int) -> str:
    oom = result.out_of_memory
    if oom is None:
        return f"completed {result.completed}/{iterations} iterations"
    return (
        f"OUT OF MEMORY in iteration {oom.iteration} at {oom.op_name} (op #{oom.op_index}): tried to allocate "
        f"{format_bytes(oom.requested_bytes)} with {format_bytes(oom.live_bytes)} of {format_bytes(oom.capacity_bytes)} in use"
    )


def _summary(runs, iterations: int, parity, capacity_bytes: int) -> str:
    header = f"{'run':27s} | {'iterations':>10s} | {'peak MiB':>8s} | {'out MiB/it':>10s} | {'stall ms/it':>11s} | {'s/it':>5s} | result"
    lines = ["", f"Summary (emulated device, capacity {_mib(capacity_bytes)} MiB)", header, "-" * len(header)]
    for name, result in runs:
        done = f"{result.completed}/{iterations}"
        oom = result.out_of_memory
        outcome = "ok" if oom is None else f"OOM at iteration {oom.iteration}, {oom.op_name}"
        if result.reports:
            figures = (
                f"{_mib(result.peak_bytes()):>8s} | {_mib(result.mean('swap_out_bytes')):>10s} | "
                f"{result.mean('stall_s') * 1e3:>11.1f} | {result.mean('iteration_s'):>5.2f}"
            )
        else:
            figures = f"{'-':>8s} | {'-':>10s} | {'-':>11s} | {'-':>5s}"
        lines.append(f"{name:27s} | {done:>10s} | {figures} | {outcome}")
    reference, with_chameleon = runs[0][1], runs[-1][1]
    if reference.reports and with_chameleon.reports:
        lines.append(
            f"with Chameleon / reference (emulated, same run): peak memory "
            f"{with_chameleon.peak_bytes() / reference.peak_bytes():.2f}x, time per iteration "
            f"{with_chameleon.mean('iteration_s') / reference.mean('iteration_s'):.2f}x"
        )
    verdict = "yes" if parity.bit_identical else "NO"
    lines.append(
        f"bit-identical to the reference: {verdict} (losses {parity.losses_equal}/{parity.losses_compared} "
        f"torch.equal, final parameters {parity.parameters_equal}/{parity.parameters_compared} torch.equal)"
    )
    return "\n".join(lines)


def _run_json(result) -> dict:
    return {
        "completed_iterations": result.completed,
        "losses": [loss.item() for loss in result.losses],
        "out_of_memory": None if result.out_of_memory is None else vars(result.out_of_memory),
        "peak_device_bytes": result.peak_bytes(),
        "wall_s": result.wall_s,
        "iterations": [r.to_dict() for r in result.reports],
    }


def _curves(reference, with_chameleon) -> list[tuple[Curve, tuple[str, object]]]:
    """What memory.png shows, each curve with its run's label and its ``Timeline``: the reference and the
    run with Chameleon in the plotted iteration (a Stable one under the chosen policy, unless the job is
    too short or ``train.timeline_iteration`` names another), and the WarmUp iteration of the run with
    Chameleon, which swaps every eligible tensor. Each legend peak is the maximum of its own curve."""
    chosen = []
    for name, result, timeline, style in (
        ("without swap (reference)", reference, reference.timeline, "-"),
        ("with Chameleon", with_chameleon, with_chameleon.timeline, "-"),
        ("with Chameleon", with_chameleon, with_chameleon.warmup_timeline, ":"),
    ):
        if timeline is None or any(run == result.label and t.iteration == timeline.iteration for _, (run, t) in chosen):
            continue
        label = (f"{name}, iteration {timeline.iteration} ({timeline.stage}, {_swapping(result.label, timeline)}): "
                 f"peak {_mib(timeline.peak_bytes)} MiB")
        chosen.append((Curve(label, timeline.samples_bytes, style), (result.label, timeline)))
    return chosen


def _swapping(run: str, timeline) -> str:
    if run == "reference":
        return "nothing swapped"
    if timeline.policy:
        return f"policy {timeline.policy}"
    return "swaps every saved activation >= min_swap_bytes" if timeline.stage == "warmup" else "no policy"


def _plot_note(curves, settings, config) -> str:
    """What memory.png shows, in one line, and why it shows no Stable iteration if it does not."""
    shown = "; ".join(f"{run} iteration {t.iteration} ({t.stage}{', policy ' + t.policy if t.policy else ''})"
                      for _, (run, t) in curves)
    line = f"memory.png: device memory after every op of the model: {shown or 'no iteration recorded'}"
    if any(run == "with" and t.stage == "stable" and t.policy for _, (run, t) in curves) or settings.timeline_iteration:
        return line
    first_stable = config.profiler.warmup_iterations + config.profiler.policy_trials + 1
    return (f"{line}\nnote: no Stable iteration under a policy to plot: the first one would be iteration "
            f"{first_stable} (profiler.warmup_iterations + profiler.policy_trials + 1); raise train.iterations")


def _curve_json(curve, run: str, timeline) -> dict:
    return {
        "label": curve.label, "run": run, "iteration": timeline.iteration, "stage": timeline.stage,
        "policy": timeline.policy, "peak_bytes": timeline.peak_bytes, "samples_bytes": timeline.samples_bytes,
    }


if __name__ == "__main__":
    raise SystemExit(main())
