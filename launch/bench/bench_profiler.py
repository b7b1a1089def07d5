"""Profiler overhead on CPU: the lightweight signature, and the detailed recorder vs torch.profiler.

Ratios measured in one run; the variants are interleaved round by round, in balanced orders (every variant
follows every other one equally often), and every figure is a median over rounds.

(a) Steady state: one training iteration (forward + backward + AdamW step) of a plain-PyTorch GPT with
    ``SignatureMode`` active, plus ``Signature.of`` and ``compare`` against the reference as the runtime
    does after every iteration, over the same iteration without it. Goal <= 1.01.
(b) Detailed profiling: the time ``TraceRecorder`` adds to the iteration (creating it, ``watch_modules``,
    the dispatch mode, the saved-tensor notifications from a pack hook that returns ``tensor.detach()``
    inside ``TrainingScope.quiet()`` as the executor's hooks do, ``finish``) over the time
    ``torch.profiler.profile(activities=[CPU], record_shapes=True, profile_memory=True)`` adds (its
    context, exit included; its lazy event parsing is timed apart and not charged). Goal <= 0.15.

Added time = median over rounds of (variant - plain iteration of the same round). Per-op costs come from
(i) a loop of tiny adds and (ii) the same GPT at a tiny size (``--mix-hidden``, sequence <= 32, vocabulary
<= 256: the same op sequence, negligible compute), both with one torch thread; they stay steady on a shared
machine, and the script predicts the large model's ratios from them too. No emulated device meter is used
(a test instrument, not part of the product's cost); ``live_bytes`` is ``lambda: 0``. Objects alive after
the warm-up rounds are moved to gc's permanent generation (``gc.freeze``) so that the collection before
each timed iteration is cheap; the process is restored on return.

    .venv/bin/python -m launch.bench.bench_profiler --json runs/bench_profiler.json   # ~2 min on 2 cores
    .venv/bin/python -m launch.bench.bench_profiler --quick                           # seconds (smoke test)
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from launch.bench.harness import balanced_orders, quartiles, run_benchmark
from launch.models.toy_gpt import GPT

import torch
from torch.nn import functional as F

from chameleon_dist.profiler import OpVocabulary, Signature, SignatureMode, TraceRecorder, TrainingScope, compare
from chameleon_dist.device import EmulatedDevice
from chameleon_dist.executor import SwapExecutor

PLAIN, SIGNATURE, RECORDER, TORCH_PROFILER = "plain", "signature", "recorder", "torch.profiler"
VARIANTS = (PLAIN, SIGNATURE, RECORDER, TORCH_PROFILER)
GOALS = {"signature_ratio": 1.01, "detailed_ratio": 0.15}


def _zero_bytes() -> int:
    return 0


def _identity(value):
    return value


class Workload:
    """One model, optimizer and batch; ``iteration(variant)`` runs and times one training iteration."""

    def __init__(self, hidden: int, heads: int, layers: int, seq: int, batch: int, vocab: int, saved_hooks: bool) -> None:
        torch.manual_seed(0)
        self.model = GPT(vocab, hidden, heads, layers, positions=seq, norms_first=False)
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        data = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
        self.tokens, self.labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        self.saved_hooks = saved_hooks
        # as the runtime does: one vocabulary and one scope per runtime, the scope watching the model
        self.vocabulary = OpVocabulary()
        self.scope = TrainingScope()
        self.scope.watch(self.model)
        # as in the runtime, both modes report in-place writes to a swap executor (nothing is swapped
        # here, so it only looks up what it watches)
        self.note_writes = SwapExecutor(EmulatedDevice(2**40), 0).note_writes
        self.reference: Signature | None = None
        self.ops_per_iteration = 0
        self.recorded_ops = 0
        self.saved_tensors_noted = 0
        self.parse_s: list[float] = []
        self.count = 0

    def _forward_backward(self) -> None:
        logits = self.model(self.tokens)
        F.cross_entropy(logits.flatten(0, 1), self.labels.flatten()).backward()

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def iteration(self, variant: str) -> float:
        """Seconds of one whole iteration, profiler set-up and tear-down included."""
        self.count += 1
        start = time.perf_counter()
        if variant == PLAIN:
            self._forward_backward()
            self._optimizer_step()
        elif variant == SIGNATURE:
            mode = SignatureMode(self.vocabulary, self.scope, on_write=self.note_writes)
            with mode:
                self._forward_backward()
                self._optimizer_step()
            signature = Signature.of(mode.ids)
            compare(signature, self.reference, 0.05, 0.95)
            if self.reference is None:
                self.reference = signature
            self.ops_per_iteration = len(mode.ids)
        elif variant == RECORDER:
            keys = {p.untyped_storage()._cdata for p in self.model.parameters()}
            recorder = TraceRecorder(self.vocabulary, _zero_bytes, keys, self.count, False, self.scope)
            recorder.watch_modules(self.model)
            recorder.on_write = self.note_writes
            with recorder:
                if self.saved_hooks:
                    def pack(tensor: torch.Tensor) -> torch.Tensor:
                        with self.scope.quiet():  # as the executor's hooks: their own ops are not recorded
                            recorder.on_saved(tensor)
                            return tensor.detach()

                    with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
                        self._forward_backward()
                else:
                    self._forward_backward()
                recorder.optimizer_active = True
                self._optimizer_step()
                recorder.optimizer_active = False
            trace = recorder.finish()
            elapsed = time.perf_counter() - start
            self.recorded_ops = len(trace.ops)
            self.saved_tensors_noted = sum(t.saved for t in trace.tensors)
            return elapsed
        elif variant == TORCH_PROFILER:
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
                self._forward_backward()
                self._optimizer_step()
            elapsed = time.perf_counter() - start
            parse_start = time.perf_counter()
            prof.events()  # lazy: parsed only for whoever reads the results
            self.parse_s.append(time.perf_counter() - parse_start)
            return elapsed
        else:
            raise ValueError(variant)
        return time.perf_counter() - start


# ---- the tiny-op loop ---------------------------------------------------------------------------
def op_loop(variant: str, ops: int, vocabulary: OpVocabulary) -> float:
    """Seconds for ``ops`` tiny adds (two inputs, one new 64-byte output each) under ``variant``."""
    a, b = torch.ones(16), torch.ones(16)

    def loop() -> None:
        for _ in range(ops):
            torch.add(a, b)

    start = time.perf_counter()
    if variant == PLAIN:
        loop()
    elif variant == SIGNATURE:
        with SignatureMode(vocabulary):
            loop()
    elif variant == RECORDER:
        recorder = TraceRecorder(vocabulary, _zero_bytes, set(), 0, False)
        with recorder:
            loop()
        recorder.finish()
    elif variant == TORCH_PROFILER:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, profile_memory=True):
            loop()
    return time.perf_counter() - start


# ---- measurement --------------------------------------------------------------------------------
def interleaved(run: Callable[[str], float], rounds: int, warmup: int) -> dict[str, list[float]]:
    """``warmup`` discarded rounds, then ``rounds`` rounds of every variant, in balanced orders."""
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    orders = balanced_orders(len(VARIANTS), mirror_odd=False)
    for r in range(warmup + rounds):
        if r == warmup:
            # Everything alive now (torch's lazily imported modules among it) goes to the permanent
            # generation: the collections below and inside iterations then scan only new objects.
            gc.collect()
            gc.freeze()
        for index in orders[r % len(orders)]:
            variant = VARIANTS[index]
            gc.collect()
            elapsed = run(variant)
            if r >= warmup:
                times[variant].append(elapsed)
    return times


def summarise(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per variant: median/min/max seconds; added = median of paired differences with the plain run of
    the same round (and their quartiles); ratio = 1 + added / plain median."""
    plain = times[PLAIN]
    plain_median = statistics.median(plain)
    out = {}
    for variant, values in times.items():
        diffs = [v - p for v, p in zip(values, plain)]
        q1, q3 = quartiles(diffs, method="inclusive")
        out[variant] = {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "added_s": statistics.median(diffs),
            "added_q1_s": q1,
            "added_q3_s": q3,
            "ratio": 1.0 + statistics.median(diffs) / plain_median,
        }
    return out


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("inf")


def _signature_ratio(times: dict[str, list[float]]) -> float:
    added = statistics.median(s - p for s, p in zip(times[SIGNATURE], times[PLAIN]))
    return 1.0 + added / statistics.median(times[PLAIN])


def _detailed_ratio(times: dict[str, list[float]]) -> float:
    ours = statistics.median(r - p for r, p in zip(times[RECORDER], times[PLAIN]))
    theirs = statistics.median(t - p for t, p in zip(times[TORCH_PROFILER], times[PLAIN]))
    return _ratio(ours, theirs)


def bootstrap(times: dict[str, list[float]], statistic: Callable[[dict[str, list[float]]], float],
              resamples: int = 2000) -> tuple[float, float]:
    """5th and 95th percentiles of ``statistic`` over rounds resampled with replacement (whole rounds, so
    the pairing with the plain run of the same round is kept)."""
    rng = random.Random(0)
    rounds = len(times[PLAIN])
    values = []
    for _ in range(resamples):
        picks = [rng.randrange(rounds) for _ in range(rounds)]
        values.append(statistic({v: [t[i] for i in picks] for v, t in times.items()}))
    values.sort()
    return values[int(0.05 * (resamples - 1))], values[int(0.95 * (resamples - 1))]


def verdict(value: float, interval: tuple[float, float], goal: float) -> str:
    if interval[1] <= goal:
        return "MET"
    if interval[0] > goal:
        return "NOT MET"
    return "MET (within noise)" if value <= goal else "NOT MET (within noise)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=40, help="measured rounds of the GPT iteration (each runs all 4 variants)")
    parser.add_argument("--warmup", type=int, default=2, help="discarded rounds before measuring")
    parser.add_argument("--mix-hidden", type=int, default=64, help="width of the tiny GPT for per-op costs on the same op mix")
    parser.add_argument("--mix-rounds", type=int, default=40)
    parser.add_argument("--loop-ops", type=int, default=20000, help="tiny adds per loop in the per-op measurement")
    parser.add_argument("--loop-rounds", type=int, default=9)
    parser.add_argument("--no-saved-hooks", dest="saved_hooks", action="store_false",
                        help="recorder without the saved-tensor notifications (on by default)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for the large GPT (0: torch's default; the per-op measurements use 1)")
    parser.add_argument("--quick", action="store_true", help="dry mode: tiny sizes and few rounds (seconds)")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.layers, args.seq, args.batch, args.vocab = 64, 4, 1, 16, 2, 128
        args.rounds, args.warmup, args.mix_hidden, args.mix_rounds, args.loop_ops, args.loop_rounds = 3, 1, 32, 3, 500, 3
        args.threads = args.threads or 1
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run_benchmark("launch.bench.bench_profiler", argv, parse_args(argv), torch, _run, print_report, emulated=False)
    finally:  # leave the calling process (a test run, say) as it was
        gc.unfreeze()


def _run(args: argparse.Namespace) -> dict:
    shape = dict(heads=args.heads, layers=args.layers, seq=args.seq, batch=args.batch, vocab=args.vocab,
                 saved_hooks=args.saved_hooks)

    big = Workload(hidden=args.hidden, **shape)
    gpt_times = interleaved(big.iteration, args.rounds, args.warmup)
    gpt = summarise(gpt_times)
    # Per-op costs are work on the calling thread: measured with one torch thread, so that OpenMP wake-ups
    # on a shared machine do not drown them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mix_heads = min(args.heads, args.mix_hidden // 16) or 1
        mix = Workload(hidden=args.mix_hidden, **{**shape, "heads": mix_heads, "seq": min(args.seq, 32), "vocab": min(args.vocab, 256)})
        mix_times = summarise(interleaved(mix.iteration, args.mix_rounds, 2))
        loop_vocabulary = OpVocabulary()
        loop = summarise(interleaved(lambda v: op_loop(v, args.loop_ops, loop_vocabulary), args.loop_rounds, 1))
    finally:
        torch.set_num_threads(threads)

    ops = big.ops_per_iteration
    per_op_loop_us = {v: loop[v]["added_s"] / args.loop_ops * 1e6 for v in VARIANTS}
    per_op_mix_us = {v: mix_times[v]["added_s"] / mix.ops_per_iteration * 1e6 for v in VARIANTS}
    plain_s = gpt[PLAIN]["median_s"]
    results = {
        "model": {"parameters": big.parameters, "ops_per_iteration": ops, "recorded_ops": big.recorded_ops,
                  "saved_tensors_noted": big.saved_tensors_noted, "mix_ops_per_iteration": mix.ops_per_iteration},
        "gpt_iteration": gpt,
        "mix_iteration": mix_times,
        "op_loop": loop,
        "per_op_us": {"loop": per_op_loop_us, "mix": per_op_mix_us},
        "torch_profiler_parse_s_median": statistics.median(big.parse_s) if big.parse_s else 0.0,
        "signature_ratio": gpt[SIGNATURE]["ratio"],
        "signature_ratio_90ci": bootstrap(gpt_times, _signature_ratio),
        "signature_ratio_predicted": 1.0 + per_op_mix_us[SIGNATURE] * 1e-6 * ops / plain_s,
        "detailed_ratio": _ratio(gpt[RECORDER]["added_s"], gpt[TORCH_PROFILER]["added_s"]),
        "detailed_ratio_90ci": bootstrap(gpt_times, _detailed_ratio),
        "detailed_ratio_mix": _ratio(mix_times[RECORDER]["added_s"], mix_times[TORCH_PROFILER]["added_s"]),
        "detailed_ratio_loop": _ratio(per_op_loop_us[RECORDER], per_op_loop_us[TORCH_PROFILER]),
        "goals": GOALS,
    }
    for key in ("signature_ratio", "detailed_ratio"):
        results[f"{key}_verdict"] = verdict(results[key], results[f"{key}_90ci"], GOALS[key])
    results["gpt_iteration_raw_s"] = gpt_times
    return results


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_report(r: dict) -> None:
    c, m, mach = r["config"], r["model"], r["machine"]
    print(f"machine: {mach['cpu']}, {mach['cpus']} CPUs, {mach['torch_threads']} torch threads, torch {mach['torch']}, "
          f"load average {mach['load_average_before']:.2f} before / {mach['load_average_after']:.2f} after")
    print(f"GPT: {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, seq {c['seq']}, batch {c['batch']}, "
          f"vocab {c['vocab']}, {m['parameters'] / 1e6:.1f} M parameters, fp32, AdamW; {m['ops_per_iteration']} aten ops "
          f"per iteration ({m['recorded_ops']} recorded by TraceRecorder, "
          f"{m['saved_tensors_noted']} saved tensors noted)")
    print(f"TraceRecorder: live_bytes = lambda: 0, saved-tensor notifications {'on' if c['saved_hooks'] else 'off'}; "
          f"{c['rounds']} rounds (+{c['warmup']} warm-up), variants interleaved in balanced orders")
    print()
    print(f"{'GPT iteration':<16}{'median ms':>10}{'min':>9}{'max':>9}{'added ms':>10}{'(IQR)':>16}{'ratio':>9}")
    for variant, s in r["gpt_iteration"].items():
        iqr = f"({_ms(s['added_q1_s'])}..{_ms(s['added_q3_s'])})"
        print(f"{variant:<16}{_ms(s['median_s']):>10}{_ms(s['min_s']):>9}{_ms(s['max_s']):>9}{_ms(s['added_s']):>10}"
              f"{iqr:>16}{s['ratio']:>8.4f}x")
    print(f"(torch.profiler's lazy event parsing, not charged: median {_ms(r['torch_profiler_parse_s_median'])} ms)")
    print()
    print(f"per-op cost, us{'':<4}{'tiny adds':>10}{'GPT op mix':>12}   (1 torch thread; loop: {c['loop_ops']} adds x "
          f"{c['loop_rounds']} rounds; op mix: the same GPT at hidden {c['mix_hidden']}, seq <= 32, vocab <= 256, "
          f"{m['mix_ops_per_iteration']} ops, {c['mix_rounds']} rounds)")
    for variant in VARIANTS[1:]:
        print(f"{variant:<20}{r['per_op_us']['loop'][variant]:>10.2f}{r['per_op_us']['mix'][variant]:>12.2f}")
    print(f"(plain iteration of the op-mix GPT: median {_ms(r['mix_iteration'][PLAIN]['median_s'])} ms)")
    print()
    g = r["goals"]
    lo, hi = r["signature_ratio_90ci"]
    print(f"(a) signature: iteration with / without = {r['signature_ratio']:.4f}x, 90% interval {lo:.4f}..{hi:.4f} "
          f"(goal <= {g['signature_ratio']}): {r['signature_ratio_verdict']}; predicted from the op-mix per-op cost: "
          f"{r['signature_ratio_predicted']:.4f}x")
    lo, hi = r["detailed_ratio_90ci"]
    print(f"(b) detailed: added time TraceRecorder / torch.profiler = {r['detailed_ratio']:.3f}, 90% interval "
          f"{lo:.3f}..{hi:.3f} (goal <= {g['detailed_ratio']}): {r['detailed_ratio_verdict']}; on the op-mix GPT: "
          f"{r['detailed_ratio_mix']:.3f}; per tiny add: {r['detailed_ratio_loop']:.3f}")
    print(f"wall time {r['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
