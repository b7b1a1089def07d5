"""``chameleon-trace``: record the detailed ``StepTrace`` of one training iteration and summarise it.

Default: the main job's Megatron-core GPT (``configs/jobs/train_gpt_cpu.yaml``, ``--config`` merged over
it) on an unconstrained emulated device with Chameleon enabled, so saved tensors are marked and swaps are
recorded; the first (WarmUp) iteration of a new runtime is the one traced. ``--model llama2-7b``: a
plain-PyTorch Llama-shaped model (``chameleon_dist.models.llama``, shaped by ``configs/models/llama2-7b.yaml``)
on the ``meta`` device (no memory, no compute), one forward and backward, compared with the Korthikanti
activation estimate. The trace is written as JSON (``StepTrace.save``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

from pydantic import ValidationError

from chameleon_dist.config import ConfigError
from chameleon_dist.models import llama
from chameleon_dist.planner.profiles import load_model
from chameleon_dist.trace.step_trace import StepTrace
from chameleon_dist.units import format_bytes

JOB_MODEL = "job"
LLAMA_OVERRIDES = (  # (option, LlamaShape field, help)
    ("--layers", "num_layers", "number of decoder layers"),
    ("--hidden", "hidden_size", "hidden size"),
    ("--heads", "num_attention_heads", "attention heads"),
    ("--seq", "seq_length", "sequence length"),
    ("--batch", "micro_batch_size", "micro-batch size"),
    ("--ffn", "ffn_hidden_size", "SwiGLU hidden size"),
    ("--vocab", "vocab_size", "vocabulary size"),
)


@dataclasses.dataclass
class TraceRun:
    """What ``run`` recorded: the trace, where it was written, and how long things took."""

    trace: StepTrace
    path: Path
    record_s: float
    unrecorded_s: list[float]
    meta: llama.MetaTraceResult | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="chameleon-trace", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=JOB_MODEL, choices=(JOB_MODEL, *llama.LLAMA_MODELS),
        help="job: the main job's Megatron-core GPT (default); llama2-7b: a Llama-shaped model on meta tensors",
    )
    parser.add_argument("--config", type=Path, help="YAML job file merged over configs/jobs/train_gpt_cpu.yaml (--model job)")
    parser.add_argument(
        "--compare-iterations", type=int, default=2,
        help="iterations run after the traced one without recording, for the time comparison (default: 2)",
    )
    for option, field, text in LLAMA_OVERRIDES:
        parser.add_argument(option, type=int, dest=field, help=f"{text} (overrides the --model preset)")
    parser.add_argument("--out", type=Path, help="where the JSON trace goes (default: runs/trace-<time>.json)")
    parser.add_argument("--log-level", default="WARNING", help="library log level (default: WARNING)")
    args = parser.parse_args(argv)
    overrides = {field: getattr(args, field) for _, field, _ in LLAMA_OVERRIDES if getattr(args, field) is not None}
    if args.model == JOB_MODEL and overrides:
        parser.error("--layers/--hidden/--heads/--seq/--batch/--ffn/--vocab shape a Llama model (--model llama2-7b); "
                     "for the job model pass --config with a model section")
    if args.model != JOB_MODEL and args.config is not None:
        parser.error("--config sets the job model; use --layers/--hidden/... to shape --model " + args.model)
    if args.compare_iterations < 0:
        parser.error("--compare-iterations must be >= 0")
    args.llama_shape = None
    if args.model != JOB_MODEL:
        preset = llama.LlamaShape.from_profile(load_model(args.model))  # configs/models/<name>.yaml
        try:
            args.llama_shape = llama.LlamaShape(**{**preset.model_dump(), **overrides})
        except ValidationError as exc:
            parser.error(_shape_problems(exc))
    return args


def _shape_problems(exc: ValidationError) -> str:
    """``num_layers must be a positive integer, got 0``: one line per problem of an overridden shape."""
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        if error["type"] == "greater_than":
            problems.append(f"{field} must be a positive integer, got {error['input']!r}")
        else:
            problems.append(error["msg"].removeprefix("Value error, "))
    return "; ".join(problems)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        run(args)
    except ConfigError as exc:
        print(f"chameleon-trace: {exc}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> TraceRun:
    """Record, write and print; returns what was recorded (tests compare it with the file)."""
    out = args.out or Path("runs") / f"trace-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    if args.model == JOB_MODEL:
        result = _record_job(args.config, args.compare_iterations)
    else:
        shape = args.llama_shape
        print(f"chameleon-trace: Llama-shaped model on META tensors (no memory, no compute): {shape.describe()}", flush=True)
        meta = llama.record_meta_trace(shape)
        unrecorded = [llama.time_meta_iteration(shape) for _ in range(args.compare_iterations)]
        result = TraceRun(meta.trace, out, meta.record_s, unrecorded, meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.path = result.trace.save(out)
    _print_summary(result)
    if result.meta is not None:
        _print_llama_estimate(result.meta)
    print(f"trace written to {result.path} ({result.path.stat().st_size / 2**20:.1f} MiB)")
    return result


def _record_job(config: Path | None, compare_iterations: int) -> TraceRun:
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    import torch

    from chameleon_dist.cli import train_job  # imports Megatron: only for this model
    from chameleon_dist.integrations.megatron.gpt import build_gpt, gpt_loss, megatron_cpu_session, synthetic_batch
    from chameleon_dist.runtime import Chameleon

    job = train_job.load_job(config)
    shape, settings = job.model, job.train
    # Exactly the first iteration is profiled in detail; the next ones run the same executor unrecorded.
    profiler = job.chameleon.profiler.model_copy(update={"warmup_iterations": 1})
    chameleon_config = job.chameleon.model_copy(update={"enabled": True, "profiler": profiler})
    print(
        f"chameleon-trace: Megatron-core GPTModel ({shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads} heads, seq {shape.seq_length}, micro-batch {shape.micro_batch_size} x "
        f"{settings.micro_batches}) on an unconstrained EMULATED device, Chameleon enabled "
        f"(min_swap_bytes {format_bytes(chameleon_config.min_swap_bytes)})",
        flush=True,
    )
    times_s: list[float] = []
    trace = None
    with megatron_cpu_session(seed=settings.seed):
        model = build_gpt(shape, seed=settings.seed)
        chameleon = Chameleon(train_job.for_unconstrained_device(chameleon_config), device=train_job.unconstrained_device(chameleon_config))
        chameleon.attach(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        for iteration in range(1, compare_iterations + 2):
            host_batches = [
                synthetic_batch(shape, (iteration - 1) * settings.micro_batches + micro, settings.seed)
                for micro in range(settings.micro_batches)
            ]

            def closure() -> None:
                for host_batch in host_batches:
                    batch = {name: tensor.clone() for name, tensor in host_batch.items()}
                    (gpt_loss(model, batch) / settings.micro_batches).backward()

            start_s = time.perf_counter()
            chameleon.run_iteration(closure, optimizer=optimizer)
            times_s.append(time.perf_counter() - start_s)
            optimizer.zero_grad(set_to_none=True)
            if iteration == 1:
                trace = chameleon.last_trace
    if trace is None:
        raise RuntimeError("the first iteration of a new runtime recorded no trace (profiler.warmup_iterations)")
    return TraceRun(trace, Path(), times_s[0], times_s[1:])


def _print_summary(result: TraceRun) -> None:
    trace = result.trace
    print(trace.summary())
    phases = ", ".join(f"{phase} {count}" for phase, count in trace.phase_counts().items())
    print(f"ops per phase: {phases} (other: grad mode off outside backward, e.g. the saved-tensor hooks' detach)")
    counts = collections.Counter(trace.op_names[op.name_id] for op in trace.ops)
    print("top-10 ops by count: " + ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in counts.most_common(10)))
    saved = sum(t.saved for t in trace.tensors)
    print(f"saved for backward: {format_bytes(trace.saved_bytes())} ({saved} tensors; parameters excluded)")
    by_layer = llama.saved_bytes_by_layer(trace)
    if len(by_layer) > 1:
        print("saved by the layer that made it: " + _layer_groups(by_layer))
    curve, measured = trace.no_swap_memory_curve(), trace.memory_curve()
    print(
        f"peak: {format_bytes(max(curve, default=0))} without swap, {format_bytes(max(measured, default=0))} measured "
        f"({len(trace.swaps)} storages, {format_bytes(sum(s.nbytes for s in trace.swaps))} swapped); "
        f"{format_bytes(trace.start_live_bytes)} live at the start"
    )
    for micro_batch, peak, index in trace.micro_batch_peaks(curve):
        op = trace.ops[index]
        where = trace.module_paths[op.module_id] if op.module_id >= 0 else "-"
        print(f"  micro-batch {micro_batch}: peak {format_bytes(peak)} at op {index} "
              f"({trace.op_names[op.name_id]}, {op.phase}, module {where})")
    unrecorded = (
        f"{statistics.median(result.unrecorded_s):.3f} s median of {len(result.unrecorded_s)} unrecorded"
        if result.unrecorded_s else "no unrecorded iterations (--compare-iterations 0)"
    )
    print(f"time: {result.record_s:.3f} s for the recorded iteration, {unrecorded}")


def _layer_groups(by_layer: dict[int, int]) -> str:
    """``outside layers 6 MiB, layers 0-3 20 MiB each``: runs of equal layers folded together."""
    parts = [f"outside layers {format_bytes(by_layer[-1])}"] if -1 in by_layer else []
    runs: list[list[int]] = []  # [first, last, bytes]
    for layer, nbytes in sorted((k, v) for k, v in by_layer.items() if k >= 0):
        if runs and runs[-1][1] == layer - 1 and runs[-1][2] == nbytes:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, nbytes])
    for first, last, nbytes in runs:
        parts.append(f"layer {first} {format_bytes(nbytes)}" if first == last else f"layers {first}-{last} {format_bytes(nbytes)} each")
    return ", ".join(parts)


def _print_llama_estimate(meta: llama.MetaTraceResult) -> None:
    shape, trace = meta.shape, meta.trace
    by_layer = {layer: n for layer, n in llama.saved_bytes_by_layer(trace).items() if layer >= 0}
    per_layer = statistics.mean(by_layer.values()) if by_layer else 0
    adjusted, korthikanti = llama.llama_layer_bytes(shape), llama.korthikanti_layer_bytes(shape)
    outside = llama.llama_outside_layers_bytes(shape)
    layers = shape.num_layers
    peak = max(trace.no_swap_memory_curve(), default=0)
    end = llama.end_of_forward(trace)
    forward_bytes = trace.ops[end].live_bytes - trace.start_live_bytes if end >= 0 else 0
    print(f"recorded on meta: {len(trace.ops)} ops, {len(trace.tensors)} tensors, {len(trace.storages)} storages; "
          f"build {meta.build_s:.2f} s, record {meta.record_s:.2f} s")
    print(f"activations (saved for backward) per layer: {format_bytes(per_layer)} measured "
          f"(min {format_bytes(min(by_layer.values(), default=0))}, max {format_bytes(max(by_layer.values(), default=0))})")
    print(f"  Korthikanti s*b*h*(34 + 5*a*s/h): {format_bytes(korthikanti)} (measured / formula {per_layer / korthikanti:.3f})")
    print(f"  adjusted for this model (no dropout, SwiGLU, RMSNorm): 20sbh + 8sbF + 2as^2b + 4sb = {format_bytes(adjusted)} "
          f"(measured / adjusted {per_layer / adjusted:.3f})")
    print(f"all saved activations: {format_bytes(trace.saved_bytes())} measured; {layers} x adjusted + outside the layers "
          f"({format_bytes(outside)}) = {format_bytes(layers * adjusted + outside)}; {layers} x Korthikanti = "
          f"{format_bytes(layers * korthikanti)}")
    print(f"no-swap peak: {format_bytes(peak)} = parameters and buffers {format_bytes(meta.model_state_bytes)} + "
          f"{format_bytes(peak - meta.model_state_bytes)} (activations, gradients and temporaries at the peak; "
          f"{format_bytes(forward_bytes)} live above the start at the end of forward)")
    print(f"  peak above parameters / ({layers} x Korthikanti) = {(peak - meta.model_state_bytes) / (layers * korthikanti):.3f}; "
          f"/ ({layers} x adjusted + outside) = {(peak - meta.model_state_bytes) / (layers * adjusted + outside):.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
