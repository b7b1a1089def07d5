"""Planner calibration files from the simulated runtime, and the planner's predictions against the simulation
(issue 29, item 6). Every time here is simulated: Megatron-core GPT layers at real shapes on meta tensors, on the
emulated device's roofline clock for a preset (``launch/experiments/scale_runs.py``, docs/llm-scale.md).

Producing a file (``--model CASE --preset PRESET --out FILE``): one profiled iteration of the case through
Megatron's schedule (no swap, no recomputation, ``scale_runs.profiled_iteration``) and a second one of the same
case with one layer; the backend's op-time observer gives each op's kernel seconds. Per micro-batch:

- ``layer_forward_s``: the forward ops inside the transformer layers (the recorder tags them by layer) over the
  layers (their mean: a mixture of experts' layers differ with their routing);
- ``layer_backward_s``: backward ops carry no layer, so the difference of the two runs' backward time over the
  difference of their layer counts (the mean over all but the first layer);
- ``head_forward_s``, ``head_backward_s`` (cases with the output layer): what the forward and backward spend
  outside the layers, which is the final norm, output layer and loss and also the embedding (a gather: small);
- the preset's host link rates. No collective rates (one device) and no optimizer step (the simulated ranks run
  none).

Comparing (``--compare``): for the single-rank settings the LLM-scale runs use (``scale_runs.CASES`` on
h100-pcie, h200 and gh200), the simulated time and peak of no recomputation, Megatron's selective and full
recomputation and Chameleon swap-only at ``--swap-budgets`` (read from ``bench_scale``'s JSON in ``--scale-dir``),
beside the planner's predictions without calibration (the preset's peak FLOP rate, as ``bench_scale`` predicts)
and calibrated from a file this script produces for that case and preset, and (cross-shape) from the llama2-7b
file of the same preset. The simulated ranks run no optimizer step: the predicted times here leave out the
planner's optimizer term (``bench_scale``'s ``time_error`` includes it).

    PYTHONPATH=. .venv/bin/python -m launch.experiments.planner_calibration --model llama2-7b --preset h100-pcie \\
        --out runs/calibration/llama2-7b_h100-pcie.json
    PYTHONPATH=. .venv/bin/python -m launch.experiments.planner_calibration --compare --scale-dir runs/scale \\
        --calibration-dir runs/calibration --markdown runs/calibration/compare.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import types
from pathlib import Path

from launch.experiments.scale_runs import CASES, Case

logger = logging.getLogger("planner_calibration")

PRESETS = ("h100-pcie", "h200", "gh200")
COMPARED = {"none": "reference", "selective": "megatron-selective", "full": "megatron-full", "swap": "chameleon-swap"}
REFERENCE_CASE = "llama2-7b"  # the cross-shape column's calibration


@dataclasses.dataclass(frozen=True)
class PhaseSeconds:
    """One profiled iteration's kernel seconds by where they ran (all micro-batches)."""

    layers: int  # transformer layers the forward ran through
    micro_batches: int
    layers_forward_s: float
    outside_forward_s: float  # embedding, final norm, output layer, loss
    backward_s: float
    other_s: float  # ops in neither phase


def phase_seconds(trace, op_times_s: list[float]) -> PhaseSeconds:
    from chameleon_dist.trace import BACKWARD, FORWARD

    sums = {"layers": 0.0, "outside": 0.0, "backward": 0.0, "other": 0.0}
    layers, micro_batches = set(), set()
    for op, seconds in zip(trace.ops, op_times_s, strict=True):
        if op.phase == FORWARD:
            sums["layers" if op.layer >= 0 else "outside"] += seconds
            micro_batches.add(op.micro_batch)
            if op.layer >= 0:
                layers.add(op.layer)
        else:
            sums["backward" if op.phase == BACKWARD else "other"] += seconds
    return PhaseSeconds(len(layers), max(1, len(micro_batches)), sums["layers"], sums["outside"], sums["backward"],
                        sums["other"])


def case_layers(case: Case) -> int:
    from chameleon_dist.planner import load_model

    return case.num_layers or load_model(case.profile).num_layers


def measure(case: Case, *, preset: str, seq_length: int | None = None, micro_batches: int = 2,
            micro_batch_size: int = 1) -> dict:
    """A calibration mapping (``planner/calibration.py``'s format 1) for ``case`` on ``preset`` (module docstring)."""
    from chameleon_dist.device.presets import get_preset
    from chameleon_dist.integrations.megatron import megatron_meta_session
    from chameleon_dist.planner import load_model
    from launch.experiments.scale_runs import profiled_iteration

    profile = load_model(case.profile)
    seq_length = seq_length or profile.seq_length
    layers = case_layers(case)
    if layers < 2:
        raise ValueError(f"{case.name}: a calibration needs at least 2 layers (the backward is a difference)")
    figures = get_preset(preset)
    started_s = time.perf_counter()
    runs = {}
    with megatron_meta_session():
        for n in (layers, 1):
            trace, op_times_s = profiled_iteration(dataclasses.replace(case, num_layers=n), preset=preset,
                                                   seq_length=seq_length, micro_batches=micro_batches,
                                                   micro_batch_size=micro_batch_size)
            runs[n] = phase_seconds(trace, op_times_s)
            if runs[n].layers != n or runs[n].micro_batches != micro_batches:
                raise ValueError(f"{case.name} with {n} layers: the trace has {runs[n].layers} layers and "
                                 f"{runs[n].micro_batches} micro-batches")
    full, one = runs[layers], runs[1]
    m = micro_batches
    layer_backward_s = (full.backward_s - one.backward_s) / ((layers - 1) * m)
    out = {
        "format": 1, "source": f"simulated: {preset}",
        "shape": {"model": case.profile, "seq_length": seq_length, "micro_batch": micro_batch_size, "tp": 1,
                  "num_layers": layers, "attention": "flash", "precision": "bf16"},
        "layer_forward_s": full.layers_forward_s / (layers * m),
        "layer_backward_s": layer_backward_s,
    }
    if case.post_process:
        out["head_forward_s"] = full.outside_forward_s / m
        out["head_backward_s"] = (full.backward_s - layers * m * layer_backward_s) / m
    out.update({"h2d_bytes_per_s": figures.h2d_bytes_per_s, "d2h_bytes_per_s": figures.d2h_bytes_per_s,
                "h2d_concurrent_bytes_per_s": figures.h2d_bytes_per_s * figures.duplex_factor})
    out["command"] = (f"python -m launch.experiments.planner_calibration --model {case.name} --preset {preset} "
                      f"--layers {layers} --seq-length {seq_length} --micro-batches {m}")
    out["notes"] = (f"simulated (emulated device, meta tensors): kernel seconds of one profiled iteration of "
                    f"{case.describe(seq_length)} and of the same with 1 layer, {m} micro-batches of "
                    f"{micro_batch_size}; {full.other_s:.3g} s outside forward and backward; "
                    f"{time.perf_counter() - started_s:.1f} s to measure."
                    + (" Head times include the embedding's." if case.post_process else ""))
    return out


# ---- comparison ----------------------------------------------------------------------------------------
def _args_for(result: dict, preset: str):
    from chameleon_dist.device.presets import get_preset

    return types.SimpleNamespace(preset_figures=get_preset(preset), seq_length=result["seq_length"],
                                 micro_batches=result["micro_batches"])


def predictions(case: Case, result: dict, preset: str, budgets: list[int], hardware=None) -> dict:
    """``scale_report.planner_predictions`` for ``result``'s rows (``hardware``: None, the preset's uncalibrated)."""
    from launch.experiments.scale_report import planner_predictions

    reference = types.SimpleNamespace(model_state_bytes=result["reference"]["model_state_bytes"])
    return planner_predictions(case, _args_for(result, preset), reference, budgets, hardware=hardware)


def preset_hardware(preset: str):
    from chameleon_dist.device.presets import get_preset
    from launch.experiments.scale_report import prediction_hardware

    return prediction_hardware(get_preset(preset))


def compare_rows(case: Case, preset: str, result: dict, calibrations: dict, swap_budgets: tuple[float, ...]) -> list:
    """One row per approach of ``COMPARED`` (swap: one per budget in ``swap_budgets`` that the JSON has):
    simulated, predicted uncalibrated and calibrated ``(iteration_s, peak_bytes)``; ``calibrations`` maps
    ``"own"`` and ``"cross"`` to calibrated hardware profiles (either may be missing)."""
    wanted = []
    for approach, variant in COMPARED.items():
        rows = [r for r in result["rows"] if r["variant"] == variant]
        if approach != "swap":
            rows = rows[:1]  # (budget-independent: the same run on every budget's row)
        else:
            rows = [r for r in rows if any(abs(r["budget"] - b) < 1e-9 for b in swap_budgets)]
        wanted += [(approach, r) for r in rows]
    budgets = [r["budget_bytes"] for _, r in wanted]
    predicted = {"planner": predictions(case, result, preset, budgets)}
    for key, hardware in calibrations.items():
        predicted[key] = predictions(case, result, preset, budgets, hardware=hardware)
    out = []
    for approach, row in wanted:
        entry = {"case": case.name, "preset": preset, "approach": approach,
                 "budget": row["budget"] if approach == "swap" else None, "fits": row["fits"], "error": row["error"],
                 "simulated_s": row["iteration_s"], "simulated_peak_bytes": row["peak_bytes"]}
        for key, table in predicted.items():
            p = table.get((row["variant"], row["budget_bytes"]))
            if p is None:
                continue
            seconds = p["iteration_s"] - p["optimizer_s"]  # (the simulated ranks run no optimizer step)
            entry[f"{key}_s"], entry[f"{key}_peak_bytes"] = seconds, p["peak_bytes"]
            if row["iteration_s"] and row["peak_bytes"]:  # (a run that failed has neither)
                entry[f"{key}_time_error"] = seconds / row["iteration_s"] - 1
                entry[f"{key}_peak_error"] = p["peak_bytes"] / row["peak_bytes"] - 1
        out.append(entry)
    return out


def _cell(entry: dict, key: str) -> str:
    if f"{key}_s" not in entry:
        return "-"
    error = entry.get(f"{key}_time_error")
    return f"{entry[f'{key}_s'] * 1e3:.0f}" + ("" if error is None else f" ({error:+.0%})")


def markdown(rows: list[dict]) -> str:
    lines = ["| setting | preset | approach | simulated ms | planner ms (err) | calibrated ms (err) "
             f"| calibrated from {REFERENCE_CASE} ms (err) | simulated peak GiB | planner peak GiB (err) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in rows:
        approach = e["approach"] + (f" at {e['budget']:.2f}" if e["budget"] is not None else "")
        if e["error"]:
            approach += f" (failed: {e['error'][:40]})"
        elif e["approach"] == "swap" and not e["fits"]:
            approach += " (does not fit)"
        peak = "-" if "planner_peak_bytes" not in e else f"{e['planner_peak_bytes'] / 2**30:.2f}" + (
            f" ({e['planner_peak_error']:+.0%})" if "planner_peak_error" in e else "")
        simulated = "-" if not e["simulated_s"] else f"{e['simulated_s'] * 1e3:.0f}"
        simulated_peak = "-" if not e["simulated_peak_bytes"] else f"{e['simulated_peak_bytes'] / 2**30:.2f}"
        lines.append(f"| {e['case']} | {e['preset']} | {approach} | {simulated} | "
                     f"{_cell(e, 'planner')} | {_cell(e, 'own')} | {_cell(e, 'cross')} | {simulated_peak} | {peak} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """The range of each column's errors, by approach."""
    lines = []
    for approach in COMPARED:
        chosen = [e for e in rows if e["approach"] == approach and not e["error"] and (approach != "swap" or e["fits"])]
        parts = []
        for key, label in (("planner", "planner"), ("own", "calibrated"), ("cross", f"from {REFERENCE_CASE}")):
            errors = [e[f"{key}_time_error"] for e in chosen if f"{key}_time_error" in e]
            if errors:
                parts.append(f"{label} {min(errors):+.1%} to {max(errors):+.1%}")
        peaks = [e["planner_peak_error"] for e in chosen if "planner_peak_error" in e]
        if peaks:
            parts.append(f"peak {min(peaks):+.1%} to {max(peaks):+.1%}")
        if parts:
            lines.append(f"- {approach} ({len(chosen)} settings): time error " + ", ".join(parts))
    return "\n".join(lines)


def compare(scale_dir: Path, calibration_dir: Path, swap_budgets: tuple[float, ...], cases=None, presets=PRESETS,
            remeasure: bool = False) -> list[dict]:
    """The comparison rows for every case of ``cases`` (default all) on ``presets`` whose ``bench_scale`` JSON is
    in ``scale_dir``; calibration files are read from ``calibration_dir`` or produced there (``remeasure``:
    always produced)."""
    from chameleon_dist.planner.calibration import apply_calibration, load_calibration

    rows = []
    for preset in presets:
        files = {}
        for name in cases or CASES:
            if not (scale_dir / f"{name}_{preset}.json").is_file():
                continue
            files[name] = _produced(name, preset, calibration_dir, remeasure)
        reference = files.get(REFERENCE_CASE) or _produced(REFERENCE_CASE, preset, calibration_dir, remeasure)
        hardware = preset_hardware(preset)
        cross = apply_calibration(hardware, load_calibration(reference), source=str(reference))
        for name, path in files.items():
            result = json.loads((scale_dir / f"{name}_{preset}.json").read_text())
            if result.get("quick"):
                logger.warning("%s: a --quick run (2 layers): its figures are not the case's", name)
            own = apply_calibration(hardware, load_calibration(path), source=str(path))
            rows += compare_rows(CASES[name], preset, result, {"own": own, "cross": cross}, swap_budgets)
    return rows


def _produced(name: str, preset: str, calibration_dir: Path, remeasure: bool) -> Path:
    path = calibration_dir / f"{name}_{preset}.json"
    if remeasure or not path.is_file():
        write_calibration(measure(CASES[name], preset=preset), path)
    return path


def write_calibration(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    logger.info("wrote %s (layer forward %.2f ms, backward %.2f ms)", path, data["layer_forward_s"] * 1e3,
                data["layer_backward_s"] * 1e3)


def _budgets(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give budget fractions, e.g. 0.9,0.7") from None
    if any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each budget is a fraction in (0, 1]")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launch.experiments.planner_calibration", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama2-7b", choices=sorted(CASES), help="the case to calibrate from")
    parser.add_argument("--preset", default="h100-pcie", help="the emulated accelerator")
    parser.add_argument("--layers", type=int, help="layers of the case's profile (default: the case's; >= 2)")
    parser.add_argument("--seq-length", type=int, help="default: the profile's")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the calibration file here (default: print it)")
    parser.add_argument("--compare", action="store_true", help="the predicted-vs-simulated table (module docstring)")
    parser.add_argument("--scale-dir", type=Path, default=Path("runs/scale"), help="bench_scale's JSON files")
    parser.add_argument("--calibration-dir", type=Path, default=Path("runs/calibration"),
                        help="calibration files, read or produced (--compare)")
    parser.add_argument("--remeasure", action="store_true", help="--compare: produce every calibration afresh")
    parser.add_argument("--swap-budgets", type=_budgets, default=(0.9, 0.7), help="--compare: swap rows' budgets")
    parser.add_argument("--markdown", type=Path, help="--compare: write the table here too")
    parser.add_argument("--json", type=Path, help="--compare: write the rows here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    args = parse_args(argv)
    if args.compare:
        rows = compare(args.scale_dir, args.calibration_dir, args.swap_budgets, remeasure=args.remeasure)
        if not rows:
            print(f"planner_calibration: no bench_scale JSON in {args.scale_dir} (python -m launch.experiments.bench_scale "
                  "--model CASE --preset PRESET --json runs/scale/CASE_PRESET.json)", file=sys.stderr)
            return 2
        text = f"{markdown(rows)}\n\n{summary(rows)}"
        print(text)
        if args.markdown:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(text + "\n")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    case = CASES[args.model]
    if args.layers is not None:
        case = dataclasses.replace(case, num_layers=args.layers)
    try:
        data = measure(case, preset=args.preset, seq_length=args.seq_length, micro_batches=args.micro_batches)
    except ValueError as error:
        print(f"planner_calibration: {error}", file=sys.stderr)
        return 2
    if args.out:
        write_calibration(data, args.out)
    else:
        print(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
