"""Where the host link is too slow for swapping alone (issue 13 item 2): Chameleon swap-only, Chameleon
swap + per-tensor recompute, and whole-layer recomputation (``torch.utils.checkpoint`` per block), against
an unconstrained run, each on its own simulated device: ``--preset`` at its real rates, on the device clock,
with ``--host-op-s`` host seconds per op (default 2e-5: runs repeat exactly; ``measured``: the host's own
time). See launch/bench/device_clock.py for what each figure means.

The model (launch/models/swiglu_lm.py) is full of ops that are cheap to rebuild and costly to copy (RMSNorm,
SwiGLU, LayerNorm, GELU). The capacity takes ``--cut`` of the saved activations off the unswapped peak;
whether the link can carry that in the compute's shadow is what the physical bound says (the share of the
saved bytes the link moves in the forward's device time: at a real accelerator link and this fp32 model it
can be all of them, so swap-only may fit where the old scaled link said it could not). Whole-layer
recomputation keeps only each layer's input and runs every layer's forward twice.

Rounds are interleaved; per variant: median iteration device time over the unconstrained time of the same
round, stall over the unconstrained time, the host-bound share (device idle waiting for the host), peak
device memory against the capacity, bytes swapped (and their share of the saved activation bytes, next to
the physical bound) and recomputed per iteration, and whether losses and final parameters are
``torch.equal`` to the unconstrained run's. Every number is emulated.

    .venv/bin/python -m launch.bench.bench_recompute --json runs/bench_recompute.json   # a few minutes on 2 cores
    .venv/bin/python -m launch.bench.bench_recompute --host-op-s measured                 # the host's measured time
    .venv/bin/python -m launch.bench.bench_recompute --small                              # seconds
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

from launch.bench.device_clock import (  # noqa: E402
    DeviceSpan, add_device_arguments, clock_delta, clock_mark, device_figures, host_bound_label, iteration_figures,
    make_device, median_of, physical_bound, restart_host_clock,
)
from launch.bench.harness import VariantSpec, report_fields, rotated, run_benchmark  # noqa: E402
from launch.bench.saved_activations import SavedActivations  # noqa: E402
from launch.models.swiglu_lm import SwiGLULM  # noqa: E402

import torch
from torch.nn import functional as F

from chameleon_dist import Chameleon
from chameleon_dist.device import UNBOUNDED_CAPACITY_BYTES, EmulatedDevice

MIB = 2**20
VARIANTS = ("unconstrained", "swap_only", "swap_recompute", "layer_recompute")


class Runner:
    """One model copy for ``spec``, its optimizer and device: a Chameleon runtime with ``spec.config``, else the
    plain loop; ``spec.saving`` "checkpoint" checkpoints every layer. ``step`` trains one batch and returns its
    record."""

    def __init__(self, spec: VariantSpec, args: argparse.Namespace, device: EmulatedDevice) -> None:
        if spec.saving == "save_on_cpu":
            raise ValueError(f"variant {spec.name!r}: this benchmark has no save_on_cpu semantics")
        torch.manual_seed(args.seed)
        self.spec, self.device = spec, device
        self.model = SwiGLULM(args.vocab, args.hidden, args.layers, checkpoint_layers=spec.saving == "checkpoint")
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.chameleon = Chameleon(spec.config, device=device) if spec.config is not None else None
        if self.chameleon is not None:
            self.chameleon.attach(self.model)
        else:
            device.track_module(self.model)
        self.losses: list[torch.Tensor] = []
        self.records: list[dict] = []

    def step(self, batch: torch.Tensor) -> None:
        """One iteration; its record's times are device seconds (launch/bench/device_clock.py), with the forward pass's
        compute-busy and elapsed device time."""
        gc.collect()
        forward = {}

        def closure() -> torch.Tensor:
            span = DeviceSpan(self.device).start(stall=False)  # inside the iteration: resolve nothing
            data = batch.clone()
            loss = F.cross_entropy(self.model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
            forward.update(span.stop())
            loss.backward()
            return loss.detach()

        device = self.device
        if self.chameleon is not None:
            before = clock_mark(device)
            restart_host_clock(device)
            loss = self.chameleon.run_iteration(closure, optimizer=self.optimizer)
            r = self.chameleon.last_report
            record = {**report_fields(r, "iteration_s", "peak_bytes=peak_device_bytes", "stage", "policy",
                                      "swap_out_bytes", "recomputed_bytes", "stall_s", "passive_swaps"),
                      **iteration_figures(r.iteration_s, r.stall_s, clock_delta(device, before), device)}
        else:
            device.reset_peak()
            span = DeviceSpan(device).start()
            restart_host_clock(device)
            with device.active():
                loss = closure()
                self.optimizer.step()
            f = span.stop()
            record = {"iteration_s": f["elapsed_s"], "peak_bytes": device.peak_bytes(),
                      "stage": "", "policy": "", "swap_out_bytes": 0, "recomputed_bytes": 0, "stall_s": f["stall_s"],
                      "passive_swaps": 0, **iteration_figures(f["elapsed_s"], f["stall_s"], f, device)}
        record.update(forward_busy_s=forward["compute_busy_s"], forward_elapsed_s=forward["elapsed_s"])
        self.optimizer.zero_grad(set_to_none=False)
        self.losses.append(loss.clone())
        self.records.append(record)


def batch_for(args: argparse.Namespace, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed * 7919 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)


def run(args: argparse.Namespace) -> dict:
    probe = Runner(VariantSpec("probe", {"enabled": False}), args, make_device(args, UNBOUNDED_CAPACITY_BYTES))
    saved = SavedActivations(probe.model.parameters())
    with saved.hooks():
        probe.step(batch_for(args, 0))
    probe.step(batch_for(args, 1))
    activation_bytes = sum(saved.bytes_by_storage.values())
    peak_bytes = probe.records[-1]["peak_bytes"]
    capacity_bytes = int(peak_bytes - args.cut * activation_bytes)

    def device(spec: VariantSpec) -> EmulatedDevice:
        """The capacity for a runtime that swaps; the reference and the plain loop run unbounded."""
        return make_device(args, capacity_bytes if spec.config is not None and not spec.reference
                           else UNBOUNDED_CAPACITY_BYTES)

    def config(allow_recompute: bool) -> dict:
        return {"memory_budget": 1.0, "min_swap_bytes": args.min_swap_bytes,
                "executor": {"allow_recompute": allow_recompute}, "profiler": {"policy_trials": args.policy_trials}}

    specs = (VariantSpec("unconstrained", {"enabled": False}, reference=True),
             VariantSpec("swap_only", config(False)), VariantSpec("swap_recompute", config(True)),
             VariantSpec("layer_recompute", saving="checkpoint"))
    assert tuple(spec.name for spec in specs) == VARIANTS
    chosen = [spec for spec in specs if spec.reference or spec.name in args.variants]  # the reference always runs
    runners = {spec.name: Runner(spec, args, device(spec)) for spec in chosen}
    names = list(runners)
    rounds = args.warmup_rounds + args.rounds
    for r in range(rounds):
        batch = batch_for(args, r)
        for name in rotated(names, r):  # the order rotates every round
            runners[name].step(batch)
        if args.verbose:
            print(f"round {r:3d} " + " ".join(f"{n} {runners[n].records[-1]['iteration_s']:.3f}" for n in names)
                  + " | " + " ".join(f"{n} {runners[n].records[-1]['stage']}" for n in names
                                     if runners[n].chameleon is not None), flush=True)
    timed = range(args.warmup_rounds, rounds)
    [reference] = [runner for runner in runners.values() if runner.spec.reference]
    ref_rows = [reference.records[i] for i in timed]
    d2h_bytes_per_s = make_device(args, 1).d2h_bytes_per_s
    forward_device_s = median_of(ref_rows, "forward_busy_s")
    forward_elapsed_s = median_of(ref_rows, "forward_elapsed_s")
    bound = physical_bound(d2h_bytes_per_s, forward_device_s, activation_bytes)
    out = {name: _variant_figures(runner, reference, timed, activation_bytes, bound)
           for name, runner in runners.items()}
    return {"device": device_figures(args),
            "link": {"emulated": True, "preset": args.preset, "d2h_bytes_per_s": d2h_bytes_per_s,
                     "forward_device_s": forward_device_s, "forward_elapsed_s": forward_elapsed_s,
                     "link_mib_in_forward": d2h_bytes_per_s * forward_device_s / MIB,
                     "physical_bound": bound,
                     "bound_with_host_gaps": physical_bound(d2h_bytes_per_s, forward_elapsed_s, activation_bytes),
                     "unconstrained_host_bound_share": out["unconstrained"]["host_bound_share"]},
            "unswapped_peak_mib": peak_bytes / MIB, "activation_mib": activation_bytes / MIB,
            "capacity_mib": capacity_bytes / MIB, "link_mib_per_iteration":
                d2h_bytes_per_s * statistics.median(row["iteration_s"] for row in ref_rows) / MIB,
            "variants": out}


def _variant_figures(runner: Runner, reference: Runner, timed: range, activation_bytes: int, bound: float) -> dict:
    """One variant's medians over the timed rounds, against the reference of the same round."""
    ref_params = list(reference.model.parameters())
    rows = [runner.records[i] for i in timed]
    ratios = [row["iteration_s"] / reference.records[i]["iteration_s"] for row, i in zip(rows, timed)]
    cham = runner.chameleon
    chosen = cham.controller.chosen if cham is not None else None
    return {
        "ratio": statistics.median(ratios),
        "median_iteration_s": statistics.median(row["iteration_s"] for row in rows),
        "peak_mib": max(row["peak_bytes"] for row in rows) / MIB,
        "swap_out_mib": statistics.median(row["swap_out_bytes"] for row in rows) / MIB,
        "recomputed_mib": statistics.median(row["recomputed_bytes"] for row in rows) / MIB,
        "stall_share": statistics.median(row["stall_s"] / reference.records[i]["iteration_s"]
                                         for row, i in zip(rows, timed)),
        "passive_swaps": sum(row["passive_swaps"] for row in rows),
        "median_stall_s": statistics.median(row["stall_s"] for row in rows),
        "host_bound_share": median_of(rows, "host_bound_share"),
        "compute_busy_s": median_of(rows, "compute_busy_s"),
        "device_ops": median_of(rows, "device_ops"),
        "moved_share": statistics.median(row["swap_out_bytes"] for row in rows) / activation_bytes,
        "physical_bound": bound,
        "iteration_s": [row["iteration_s"] for row in rows],
        "stages": sorted({row["stage"] for row in rows if row["stage"]}),
        "policies": sorted({row["policy"] for row in rows if row["policy"]}),
        "chosen_feasible": chosen.feasible if chosen is not None else None,
        "chosen_reason": chosen.reason if chosen is not None else "",
        "best_generated_reason": _best_reason(cham),
        "bit_identical": all(torch.equal(a, b) for a, b in zip(runner.losses, reference.losses, strict=True))
        and all(torch.equal(a, b) for a, b in zip(runner.model.parameters(), ref_params, strict=True)),
    }


def _best_reason(chameleon: Chameleon | None) -> str:
    """Why the best policy generated last does not fit ("" when it fits or none was generated)."""
    if chameleon is None or not chameleon.controller.candidates:
        return ""
    best = min(chameleon.controller.candidates, key=lambda p: (not p.feasible, p.shortfall_bytes))
    return best.reason


def report(r: dict) -> None:
    dev, link = r["device"], r["link"]
    print(f"command: {r['command']}")
    print(f"date: {r['date']}; load average {r['machine']['load_average_before']:.2f} before, "
          f"{r['machine']['load_average_after']:.2f} after (other jobs share this machine)")
    print(f"ALL FIGURES EMULATED: {dev['text']}; {dev['host']}")
    print(f"unswapped peak {r['unswapped_peak_mib']:.2f} MiB, saved activations {r['activation_mib']:.2f} MiB; capacity "
          f"{r['capacity_mib']:.2f} MiB; the link ({link['d2h_bytes_per_s'] / 1e9:.3g} GB/s, real rate) moves "
          f"{link['link_mib_in_forward']:.2f} MiB in the forward's device time ({link['forward_device_s'] * 1e3:.3f} ms of "
          f"kernels, {link['forward_elapsed_s'] * 1e3:.3f} ms elapsed) and {r['link_mib_per_iteration']:.2f} MiB in one "
          f"unconstrained iteration: physical bound {link['physical_bound']:.1%} of the saved bytes "
          f"({link['bound_with_host_gaps']:.1%} counting the host's gaps)")
    print(f"{'variant':16s} {'ratio':>6s} {'ms/it':>8s} {'peak MiB':>9s} {'out MiB':>8s} {'moved %':>7s} {'bound %':>7s} "
          f"{'recomp MiB':>10s} {'stall %':>7s} {'host-bd %':>9s} {'ops/it':>6s}  bit-identical  policies   (emulated)")
    for name, v in r["variants"].items():
        print(f"{name:16s} {v['ratio']:6.3f} {v['median_iteration_s'] * 1e3:8.3f} {v['peak_mib']:9.2f} "
              f"{v['swap_out_mib']:8.2f} {100 * v['moved_share']:6.1f}% {100 * v['physical_bound']:6.1f}% "
              f"{v['recomputed_mib']:10.2f} {100 * v['stall_share']:6.1f}% {100 * v['host_bound_share']:8.1f}% "
              f"{v['device_ops']:6.0f}  {'yes' if v['bit_identical'] else 'NO':13s}  {','.join(v['policies'])}")
    bound = [name for name, v in r["variants"].items() if host_bound_label(v["host_bound_share"]) == "host-bound"]
    print(f"  device times (emulated); ratio = median over rounds of variant / unconstrained; stall % of the unconstrained "
          f"time; host-bd % = device idle waiting for the host (iteration - compute busy - stall) / iteration: "
          + (f"host-bound (> 50%): {', '.join(bound)}" if bound else "no variant host-bound (> 50%)"))
    reason = r["variants"].get("swap_only", {}).get("best_generated_reason")
    if reason:
        print(f"swap_only: {reason}")
    print(f"wall time {r['wall_s']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arguments(parser)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--cut", type=float, default=0.3, help="share of the saved activations to take off the peak")
    parser.add_argument("--min-swap-bytes", type=int, default=16 * 1024)
    parser.add_argument("--policy-trials", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=10, help="untimed rounds (WarmUp + GenPolicy)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", type=lambda text: text.split(","), default=list(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (unconstrained, the reference, always runs)")
    parser.add_argument("--small", action="store_true", help="tiny model and few rounds (smoke test)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.small:
        args.layers, args.hidden, args.seq, args.batch, args.vocab = 2, 64, 32, 1, 64
        args.min_swap_bytes, args.warmup_rounds, args.rounds = 1024, 8, 3
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return run_benchmark("launch.bench.bench_recompute", argv, args, torch, run, report)


if __name__ == "__main__":
    main()
