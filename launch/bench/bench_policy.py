"""Policy generator benchmark: Eq. 1's layer-time error on dense and MoE-style layers, and the time to
generate policies for a Llama2-7B-shaped trace.

(1) Eq. 1 (``T_group = T_iter / N_iter * N_group``) against measured forward layer times. A plain-PyTorch
    GPT runs forward + backward on this CPU through ``TraceRecorder`` (module hooks time every
    ``layers.<i>``), after warm-up iterations; per model: the coefficient of variation of the measured
    layer times, Eq. 1's mean and max relative error (``policy.eq1_error`` over ``logical_layers``), and
    the calibrated times' max error (``calibrated_group_times_s``, which uses the measured times), each
    a median over the recorded iterations. Models: dense (every layer attention + MLP) and MoE-style
    (every other layer's MLP replaced by ``--experts`` expert MLPs with top-``--top-k`` routing and a
    skewed router, so token counts per expert are uneven). Figures are CPU figures (emulated/CPU).
(2) ``generate_policies`` on the 7B meta trace (``models.llama``: 32 layers, hidden 4096,
    seq 4096, bf16). Meta tensors do no compute, so the trace's iteration time is replaced by an estimate
    (6 * parameters * tokens + attention FLOPs over a 910B-class peak at a stated efficiency) and its
    meaningless layer times are cleared. Per budget: seconds per generated policy (one call's time over
    the policies it returned, trials dropped as duplicates included; median of repeats), and the best
    policy's feasibility, predicted peak, stall and swapped bytes. The trace build time is reported apart.

    .venv/bin/python -m launch.bench.bench_policy --json runs/bench_policy.json   # ~70 s on 2 cores
    .venv/bin/python -m launch.bench.bench_policy --small                         # seconds (smoke test)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

from launch.bench.harness import config_of, run_benchmark
from launch.models.toy_gpt import GPT, MoEFeedForward

import torch
from torch import nn
from torch.nn import functional as F

from chameleon_dist.models import llama
from chameleon_dist.planner import load_model
from chameleon_dist.policy import (
    Decision,
    PolicySettings,
    calibrated_group_times_s,
    eq1_error,
    find_candidates,
    generate_policies,
    logical_layers,
)
from chameleon_dist.profiler import OpVocabulary, TraceRecorder, TrainingScope
from chameleon_dist.trace import FORWARD, StepTrace
from chameleon_dist.units import format_bytes

GIB = 2**30
MIN_SWAP_BYTES = 2**20


# ---- (1) recording and Eq. 1 ----------------------------------------------------------------------
def record_traces(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, iterations: int,
                  warmup: int) -> list[StepTrace]:
    """``warmup + iterations`` forward + backward passes, each through a fresh recorder (module hooks for
    layer times, a saved-tensor hook that notes what autograd keeps); the last ``iterations`` traces."""
    vocabulary, scope = OpVocabulary(), TrainingScope()
    scope.watch(model)
    parameter_keys = {p.untyped_storage()._cdata for p in model.parameters()}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()

    traces = []
    for iteration in range(1, warmup + iterations + 1):  # warm-ups recorded too (first-use costs), then dropped
        gc.collect()
        gc.disable()  # a collection inside one layer would be charged to that layer
        recorder = TraceRecorder(vocabulary, lambda: 0, parameter_keys, iteration, emulated=True, scope=scope)
        recorder.watch_modules(model)

        def pack(tensor: torch.Tensor, recorder=recorder) -> torch.Tensor:
            with scope.quiet():
                recorder.on_saved(tensor)
                return tensor.detach()

        try:
            with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                step()
        finally:
            traces.append(recorder.finish())
            gc.enable()
    return traces[warmup:]


def calibrated_max_error(trace: StepTrace, groups) -> float:
    """Max relative error of the calibrated forward layer times against the measured ones (0 by design)."""
    per_layer: dict[int, float] = {}
    for g, t in zip(groups, calibrated_group_times_s(trace, groups)):
        if g.phase == FORWARD and g.layer in trace.layer_times_s:
            per_layer[g.layer] = per_layer.get(g.layer, 0.0) + t
    return max(abs(t - trace.layer_times_s[k]) / trace.layer_times_s[k] for k, t in per_layer.items())


def layer_ops_error(trace: StepTrace) -> tuple[float, float]:
    """Eq. 1's mean and max error as ``eq1_error`` computes it (shares of the forward layer total), but with
    each layer's own ops only: ``logical_layers`` adds the ops outside the layers (embedding; final norm,
    head and loss) to the first and last layer, which the measured layer times do not cover."""
    layers = sorted(trace.layer_times_s)
    counts = [sum(op.phase == FORWARD and op.layer == k for op in trace.ops) for k in layers]
    measured = [trace.layer_times_s[k] for k in layers]
    errors = [abs(c / sum(counts) - m / sum(measured)) / (m / sum(measured)) for c, m in zip(counts, measured)]
    return statistics.fmean(errors), max(errors)


def eq1_model(kind: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.hidden, args.heads, args.layers, mlp_module=True,
                experts=args.experts if kind == "moe" else 0, top_k=args.top_k)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    traces = record_traces(model, data[:, :-1], data[:, 1:], args.iterations, args.warmup)
    per_trace = []
    for trace in traces:
        groups, rule = logical_layers(trace)
        error = eq1_error(trace, groups)
        if error is None:
            raise RuntimeError(f"{kind}: the trace has no measured layer times (module paths need layers.<i>)")
        layer_ops_mean, layer_ops_max = layer_ops_error(trace)
        per_trace.append({
            "measured_cv": error.measured_cv, "eq1_mean_error": error.mean_abs_error,
            "eq1_max_error": error.max_abs_error, "eq1_layer_ops_mean_error": layer_ops_mean,
            "eq1_layer_ops_max_error": layer_ops_max, "calibrated_max_error": calibrated_max_error(trace, groups),
            "iteration_s": trace.iteration_s,
        })
    forward_ops = [sum(op.phase == FORWARD and op.layer == k for op in traces[-1].ops) for k in range(args.layers)]
    return {
        "layers": error.layers,
        "label_rule": rule,
        **{key: statistics.median(row[key] for row in per_trace) for key in per_trace[0]},
        "ops": len(traces[-1].ops),
        "layer_forward_ops": forward_ops,
        "outside_forward_ops": sum(op.phase == FORWARD for op in traces[-1].ops) - sum(forward_ops),
        "layer_times_ms": [statistics.median(t.layer_times_s[k] for t in traces) * 1e3 for k in range(args.layers)],
        "expert_token_counts": [layer.mlp.counts for layer in model.layers if isinstance(layer.mlp, MoEFeedForward)],
        "parameters": sum(p.numel() for p in model.parameters()),
    }


# ---- (2) generation time on the 7B meta trace ---------------------------------------------------------
def iteration_estimate(shape: llama.LlamaShape, peak_flops: float, efficiency: float) -> dict:
    """FLOPs of one forward + backward: 6 * parameters * tokens for the weights, plus the attention score
    and probs @ V matmuls (4 * b * s^2 * h per layer forward, x3 with backward, no causal saving)."""
    b, s, h, layers = shape.micro_batch_size, shape.seq_length, shape.hidden_size, shape.num_layers
    dense = 6 * shape.parameter_count() * b * s
    attention = 12 * layers * b * s * s * h
    return {"dense_flops": dense, "attention_flops": attention, "peak_flops": peak_flops, "efficiency": efficiency,
            "iteration_s": (dense + attention) / (peak_flops * efficiency)}


def generation(args: argparse.Namespace) -> dict:
    shape = args.llama_shape
    start = time.perf_counter()
    meta = llama.record_meta_trace(shape)
    trace_s = time.perf_counter() - start
    trace = meta.trace
    estimate = iteration_estimate(shape, args.peak_tflops * 1e12, args.efficiency)
    trace.iteration_s = estimate["iteration_s"]
    trace.layer_times_s = {}
    no_swap_peak = max(trace.no_swap_memory_curve())
    budgets = ([int(f * no_swap_peak) for f in args.budget_fractions] if args.budget_fractions
               else [int(g * GIB) for g in args.budgets_gib])
    rows = []
    for budget in budgets:
        settings = PolicySettings(budget_bytes=budget, d2h_bytes_per_s=args.link_bytes_per_s,
                                  h2d_bytes_per_s=args.link_bytes_per_s, min_swap_bytes=MIN_SWAP_BYTES, trials=5)
        per_policy, bests = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = generate_policies(trace, settings)
            per_policy.append((time.perf_counter() - start) / max(1, len(result.policies)))
            bests.append(result.best)
        best = bests[-1]
        rows.append({
            "budget_bytes": budget,
            "seconds_per_policy": statistics.median(per_policy),
            "seconds_per_policy_all": per_policy,
            "policies": len(result.policies),
            "feasible_policies": sum(p.feasible for p in result.policies),
            "deterministic": all(b.to_json() == best.to_json() for b in bests),
            "best": {"name": best.name, "feasible": best.feasible, "predicted_peak_bytes": best.predicted_peak_bytes,
                     "predicted_stall_s": best.predicted_stall_s, "predicted_recompute_s": best.predicted_recompute_s,
                     "predicted_iteration_s": best.predicted_iteration_s, "swapped_bytes": best.saved_bytes(Decision.SWAP),
                     "recomputed_bytes": best.saved_bytes(Decision.RECOMPUTE),
                     "swapped_tensors": sum(e.decision == Decision.SWAP for e in best.entries), "reason": best.reason},
        })
    return {
        "shape": shape.model_dump(),
        "parameters": shape.parameter_count(),
        "trace": {"wall_s": trace_s, "build_s": meta.build_s, "record_s": meta.record_s, "ops": len(trace.ops),
                  "candidates": len(find_candidates(trace, MIN_SWAP_BYTES)), "no_swap_peak_bytes": no_swap_peak,
                  "model_state_bytes": meta.model_state_bytes},
        "iteration_estimate": estimate,
        "link_bytes_per_s": args.link_bytes_per_s,
        "min_swap_bytes": MIN_SWAP_BYTES,
        "budgets": rows,
    }


# ---- report -----------------------------------------------------------------------------------
def print_report(r: dict) -> None:
    print(f"command: {r['command']}")
    m = r["machine"]
    print(f"date: {r['date']}; {m['cpu']} ({m['cpus']} CPUs), {m['torch_threads']} torch threads, torch {m['torch']}; "
          f"load average {m['load_average_before']:.2f} before, {m['load_average_after']:.2f} after")
    c = r["eq1"]["config"]
    print()
    print(f"(1) Eq. 1 vs measured forward layer times, emulated/CPU (TraceRecorder module hooks; GPT hidden "
          f"{c['hidden']}, {c['heads']} heads, seq {c['seq']}, batch {c['batch']}, vocab {c['vocab']}; MoE: every "
          f"odd layer {c['experts']} experts, top-{c['top_k']}; median of {c['iterations']} recorded iterations "
          f"after {c['warmup']} warm-up)")
    print(f"{'model':<7}{'layers':>7}{'params M':>9}{'iter s':>8}{'CV':>7}{'Eq.1 mean err':>15}{'max err':>9}")
    for kind, m in r["eq1"]["models"].items():
        print(f"{kind:<7}{m['layers']:>7}{m['parameters'] / 1e6:>9.2f}{m['iteration_s']:>8.3f}{m['measured_cv']:>7.3f}"
              f"{m['eq1_mean_error']:>15.1%}{m['eq1_max_error']:>9.1%}")
    for kind, m in r["eq1"]["models"].items():
        print(f"  {kind}: forward ms per layer {' '.join(f'{t:.1f}' for t in m['layer_times_ms'])}; forward ops per "
              f"layer {' '.join(map(str, m['layer_forward_ops']))} (+ {m['outside_forward_ops']} outside the layers)")
        if m["expert_token_counts"]:
            print(f"  {kind}: tokens per expert, first MoE layer, last iteration: {list(m['expert_token_counts'][0])}")
    print("  (errors are on shares of the forward layer total over each layer's own ops, as eq1_error computes "
          "them; CV: coefficient of variation of the measured layer times)")
    g = r["generation"]
    e, t = g["iteration_estimate"], g["trace"]
    print()
    print(f"(2) generate_policies on a Llama-shaped META trace ({llama.LlamaShape(**g['shape']).describe()}); "
          f"generator on this CPU")
    print(f"trace: {t['ops']} ops, {t['candidates']} candidates >= {format_bytes(g['min_swap_bytes'])}, no-swap peak "
          f"{format_bytes(t['no_swap_peak_bytes'])} (model state {format_bytes(t['model_state_bytes'])}); built in "
          f"{t['wall_s']:.2f} s (model {t['build_s']:.2f} s, record {t['record_s']:.2f} s)")
    print(f"iteration time (assumed): 6*P*tokens {e['dense_flops'] / 1e12:.0f} TFLOP + attention "
          f"{e['attention_flops'] / 1e12:.0f} TFLOP over {e['peak_flops'] / 1e12:.0f} TFLOP/s x {e['efficiency']:.0%} "
          f"(910B-class fp16) = {e['iteration_s']:.4g} s; layer times cleared")
    print(f"link {g['link_bytes_per_s'] / 1e9:.0f} GB/s each way; 5 trials; median of {r['config']['repeats']} runs")
    print(f"{'budget':>10}{'s/policy':>10}{'policies':>9}{'best':>20}{'fits':>6}{'pred. peak':>12}{'stall ms':>10}"
          f"{'swapped':>12}{'recomputed':>12}{'pred. iter s':>13}")
    for row in g["budgets"]:
        b = row["best"]
        print(f"{format_bytes(row['budget_bytes']):>10}{row['seconds_per_policy']:>10.3f}{row['policies']:>9}"
              f"{b['name']:>20}{'yes' if b['feasible'] else 'NO':>6}{format_bytes(b['predicted_peak_bytes']):>12}"
              f"{b['predicted_stall_s'] * 1e3:>10.1f}{format_bytes(b['swapped_bytes']):>12}"
              f"{format_bytes(b['recomputed_bytes']):>12}{b['predicted_iteration_s']:>13.3f}"
              + ("" if row["deterministic"] else "  (best policy differed between repeats)"))
        if b["reason"]:
            print(f"{'':>10}{b['reason']}")
    print(f"wall time {r['wall_s']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6, help="(1) transformer layers")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=8, help="(1) experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5, help="(1) recorded iterations per model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budgets-gib", type=float, nargs="+", default=[64, 60, 56, 48, 40], help="(2) memory budgets")
    parser.add_argument("--link-gbps", type=float, default=23.0,
                        help="(2) host link GB/s each way (default: the Ascend 910B pinned-copy rate measured for MindSpeed, configs/hardware/ascend-910b.yaml)")
    parser.add_argument("--peak-tflops", type=float, default=313.0, help="(2) accelerator peak (910B fp16)")
    parser.add_argument("--efficiency", type=float, default=0.5, help="(2) fraction of peak reached")
    parser.add_argument("--repeats", type=int, default=3, help="(2) generate_policies runs per budget")
    parser.add_argument("--small", action="store_true",
                        help="tiny sizes (2 layers, hidden 64, a 2-layer Llama), budgets as fractions of the peak")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    args.llama_shape = llama.LlamaShape.from_profile(load_model("llama2-7b"))
    args.budget_fractions = None
    if args.small:
        args.layers, args.hidden, args.heads, args.seq, args.batch, args.vocab = 2, 64, 4, 32, 2, 256
        args.experts, args.iterations, args.warmup, args.repeats = 4, 2, 1, 2
        args.llama_shape = llama.LlamaShape(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=1024,
                                            micro_batch_size=1, ffn_hidden_size=512, vocab_size=256)
        args.budget_fractions = [0.8, 0.6]
    if args.layers < 2 or args.iterations < 1 or args.repeats < 1 or not 0 < args.top_k <= max(args.experts, 1):
        parser.error("need --layers >= 2, --iterations >= 1, --repeats >= 1 and 0 < --top-k <= --experts")
    args.link_bytes_per_s = args.link_gbps * 1e9
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return run_benchmark("launch.bench.bench_policy", argv, args, torch, run, print_report, emulated=False,
                         config=config_of(args, skip=("llama_shape",)))


def run(args: argparse.Namespace) -> dict:
    return {
        "eq1": {"config": {k: getattr(args, k) for k in ("hidden", "heads", "seq", "batch", "vocab", "experts",
                                                            "top_k", "iterations", "warmup")},
                "models": {kind: eq1_model(kind, args) for kind in ("dense", "moe")}},
        "generation": generation(args),
    }


if __name__ == "__main__":
    main()
