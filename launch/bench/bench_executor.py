"""Hidden transfers (issue 5): iteration time and stall with Chameleon against an unconstrained run on the
same simulated device (an accelerator preset at its real rates, on the device clock); the same ratios for
the baseline executor (swap every eligible tensor, bring it back on demand) and for PyTorch's ``save_on_cpu``.

Every variant trains its own copy of one plain-PyTorch GPT (identical initialisation, the same batches,
plain SGD) on its own ``EmulatedDevice`` built from ``--preset`` at the preset's real link rate, with
``--host-op-s`` host seconds per op (default 2e-5: every run repeats exactly; ``measured``: the host's own
time). See launch/bench/device_clock.py for what every figure means; all are emulated device-clock figures.

1. unconstrained: ``enabled: false`` (metering and the cheap signature only, nothing swapped), capacity
   unbounded: the reference time.
2. chameleon: capacity = the unswapped peak minus ``--hide-share`` of the bytes the link moves in one
   forward pass's device time (the compute stream's busy seconds in the unconstrained forward), or
   ``--capacity-fraction`` x the peak: swapping is needed, and what must leave the device fits in the
   link's time. WarmUp + GenPolicy trials run in the untimed rounds (more rounds while the runtime is not
   in Stable, up to twice as many), then the timed rounds follow.
3. baseline: the same capacity, ``profiler.warmup_iterations: 0`` (no trace, hence no policy: every saved
   tensor >= ``min_swap_bytes`` leaves the device and comes back on demand with a look-ahead of
   ``executor.prefetch_depth``). ``warmup_iterations`` huge would keep it too, but then every iteration
   records a detailed trace, whose cost is not the executor's; see ``--baseline-profiled``.
4. save_on_cpu semantics emulated (synchronous copies, no prefetch): ``torch.autograd.graph.save_on_cpu``
   is a no-op for CPU tensors, so a ``saved_tensors_hooks`` pair does what it does on a GPU: every saved
   activation goes to the host when autograd saves it and comes back when backward unpacks it, each copy
   waited for at once over the emulated link. Capacity unbounded (it cannot choose what to keep); no
   runtime, only ``device.active()`` metering, its iteration timed by two marks on the compute stream.
   Two simplifications, both in its favour: views that share a storage share one copy (PyTorch copies
   every saved tensor on its own), and parameters saved by matmuls stay (PyTorch copies them too).

Gradients stay allocated between steps (``zero_grad(set_to_none=False)``, like a framework's gradient
buffer), so the peak is where activations are live, not where fresh gradients pile up at the end of
backward. One torch thread by default: on a shared 2-core machine two threads stall each other.

Iterations are interleaved in rounds (Williams-balanced orders; with a fixed host cost the order changes
nothing, with the measured one it spreads the machine's noise). Per variant: median iteration device time,
the median over rounds of its time over the unconstrained time of the same round, stall as a share of the
unconstrained time, the host-bound share (device idle waiting for the host), bytes swapped out per
iteration and their share of the saved activation bytes next to the physical bound (the share the link
could move in the forward's compute shadow), peak device memory. Losses of every step and the final
parameters are compared with ``torch.equal`` to the unconstrained run's.

    .venv/bin/python -m launch.bench.bench_executor --json runs/bench_executor.json   # a few minutes on 2 cores
    .venv/bin/python -m launch.bench.bench_executor --host-op-s measured              # the host's measured time
    .venv/bin/python -m launch.bench.bench_executor --small                           # seconds (smoke test)
    .venv/bin/python -m launch.bench.bench_executor --shape llm-like                  # wider layers (see SHAPES)

The variants, the unswapped measurement, the capacity and the summary are launch/bench/swap_variants.py's, which
launch/bench/bench_sweep.py (this benchmark over hide-shares and links) and launch/bench/bench_dynamic.py use too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from launch.bench.device_clock import (
    add_device_arguments, device_figures, host_bound_label, make_device, print_device,
)
from launch.bench.harness import VariantSpec, run_benchmark
from launch.bench.swap_variants import (
    MIB, REDUCTION_CAP, SAVE_ON_CPU_LABEL, SHAPES, Variant, add_model_arguments, add_moved_shares, apply_shape,
    baseline_config, chameleon_config, host_batch, link_figures, measure_swap_floor_bytes, measure_unswapped,
    model_flop, plan_capacity, summarize,
)

import torch

from chameleon_dist.device import UNBOUNDED_CAPACITY_BYTES, EmulatedDevice
from chameleon_dist.policy import Decision

VARIANTS = ("unconstrained", "chameleon", "baseline", "save_on_cpu")
WILLIAMS_4 = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))  # harness.balanced_orders(4): each before each other once


# ---- run ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    unswapped = measure_unswapped(args)
    d2h_bytes_per_s = make_device(args, 1).d2h_bytes_per_s
    link = link_figures(d2h_bytes_per_s, unswapped)
    link_in_forward_bytes = link["link_bytes_in_forward"]
    floor_bytes = measure_swap_floor_bytes(args)
    plan = plan_capacity(unswapped, floor_bytes, link_in_forward_bytes, args.hide_share)
    if args.capacity_fraction is not None:
        capacity_bytes = int(args.capacity_fraction * unswapped["peak_bytes"])
    else:  # take off the peak a share of what the link can move while the forward pass computes (capped)
        capacity_bytes = plan["capacity_bytes"]

    def device(capacity: int) -> EmulatedDevice:
        return make_device(args, capacity)

    variants = {
        "unconstrained": Variant(VariantSpec("unconstrained", {"enabled": False}, reference=True), args,
                                 device(UNBOUNDED_CAPACITY_BYTES)),
        "chameleon": Variant(VariantSpec("chameleon", chameleon_config(args)), args, device(capacity_bytes)),
        "baseline": Variant(VariantSpec("baseline", baseline_config(args)), args, device(capacity_bytes)),
        "save_on_cpu": Variant(VariantSpec("save_on_cpu", saving="save_on_cpu"), args, device(UNBOUNDED_CAPACITY_BYTES)),
    }
    cham = variants["chameleon"].chameleon
    rounds = _play_rounds(args, variants)
    timed = range(rounds["warmup"], rounds["warmup"] + args.rounds)
    summary = summarize(variants, timed)
    add_moved_shares(summary, link["saved_activation_bytes"], link["physical_bound"])
    trials = [{"policy": t.policy.name, "iteration_s": t.iteration_s, "peak_mib": t.peak_bytes / MIB, "held": t.held}
              for t in cham.controller.results]
    return {
        "device": device_figures(args),
        "link": link,
        "model": _model_figures(args, variants, unswapped, link, plan, capacity_bytes, floor_bytes),
        "chameleon_policy": _policy_figures(cham),
        "trials": trials,
        "chameleon_rounds": [{"round": i, "stage": x["stage"], "policy": x["policy"], "iteration_s": x["iteration_s"],
                              "stall_s": x["stall_s"], "peak_mib": x["peak_bytes"] / MIB,
                              "swap_out_mib": x["swap_out_bytes"] / MIB, "passive_swaps": x["passive_swaps"],
                              "oom_retries": x["oom_retries"], "on_demand_fetches": x["on_demand_fetches"]}
                             for i, x in enumerate(variants["chameleon"].records)],
        "min_swap_bytes_after": {n: variants[n].chameleon.executor.min_swap_bytes for n in ("chameleon", "baseline")},
        "variants": summary,
        "checks": _checks(summary, timed, rounds.pop("stage_when_timing_began"), capacity_bytes),
        "rounds": rounds,
    }


def _play_rounds(args: argparse.Namespace, variants: dict[str, Variant]) -> dict:
    """The untimed then the timed rounds, each variant once a round in Williams-balanced order; the rounds'
    record (counts, the first orders, wall time) and the stage chameleon was in when timing began."""
    cham = variants["chameleon"].chameleon
    # untimed rounds: at least --warmup-rounds and all of chameleon's WarmUp + GenPolicy iterations; then more
    # (up to as many again) while chameleon is not yet in Stable (a trial's passive swap restarts WarmUp)
    warm_rounds = max(args.warmup_rounds, cham.config.profiler.warmup_iterations + args.policy_trials)
    order_log = []

    def play(r: int) -> None:
        batch = host_batch(args, r)
        order = [VARIANTS[i] for i in WILLIAMS_4[r % 4]]
        order_log.append(order)
        for name in order:
            variants[name].step(batch)
        if args.verbose:
            print(f"round {r:3d} " + " ".join(f"{n} {variants[n].records[-1]['iteration_s']:.3f}" for n in VARIANTS)
                  + f" | chameleon {variants['chameleon'].records[-1]['stage']}", flush=True)

    start_s = time.perf_counter()
    for r in range(warm_rounds):
        play(r)
    planned_warm_rounds = warm_rounds
    while cham.stage != "stable" and warm_rounds < 2 * planned_warm_rounds:
        play(warm_rounds)
        warm_rounds += 1
    ready_stage = cham.stage
    rounds = warm_rounds + args.rounds
    for r in range(warm_rounds, rounds):
        play(r)
    rounds_s = time.perf_counter() - start_s
    return {"warmup": warm_rounds, "warmup_planned": planned_warm_rounds, "timed": args.rounds, "orders": order_log[:4],
            "wall_s": rounds_s, "stage_when_timing_began": ready_stage}


def _checks(summary: dict, timed: range, ready_stage: str, capacity_bytes: int) -> dict:
    """Issue 5's targets for chameleon, and bit-identity of every variant."""
    c = summary["chameleon"]
    return {
        "chameleon_stable_throughout": c["stages"] == {"stable": len(timed)} and bool(c["policies"])
        and c["passive_swaps"] == 0 and c["oom_retries"] == 0,
        "stage_when_timing_began": ready_stage,
        "chameleon_ratio_at_most_1.05": c["ratio"] <= 1.05,
        "chameleon_stall_at_most_2pct": c["stall_share"] <= 0.02,
        "chameleon_peak_within_capacity": c["peak_mib"] * MIB <= capacity_bytes,
        "all_bit_identical": all(summary[n]["bit_identical"] for n in VARIANTS),
    }


def _policy_figures(cham) -> dict | None:
    """The policy chameleon chose (None: none), with its predictions and what it swaps and recomputes."""
    chosen = cham.controller.chosen
    return None if chosen is None else {
            "name": chosen.name, "feasible": chosen.feasible, "predicted_peak_mib": chosen.predicted_peak_bytes / MIB,
            "predicted_stall_s": chosen.predicted_stall_s, "predicted_iteration_s": chosen.predicted_iteration_s,
            "swap_mib": chosen.saved_bytes(Decision.SWAP) / MIB, "swapped_storages": sum(e.decision == Decision.SWAP for e in chosen.entries),
            "recompute_mib": chosen.saved_bytes(Decision.RECOMPUTE) / MIB,
            "recomputed_storages": sum(e.decision == Decision.RECOMPUTE for e in chosen.entries),
            "version": cham.controller.version}


def _model_figures(args: argparse.Namespace, variants: dict[str, Variant], unswapped: dict, link: dict, plan: dict,
                   capacity_bytes: int, floor_bytes: int) -> dict:
    """The model, its unswapped peak, the capacity and how it was chosen, and what the link moves."""
    link_in_forward_bytes = link["link_bytes_in_forward"]
    flop = model_flop(args)
    return {"parameters": sum(p.numel() for p in variants["unconstrained"].model.parameters()),
                  "parameter_bytes": unswapped["parameter_bytes"], "unswapped_peak_bytes": unswapped["peak_bytes"],
                  "capacity_bytes": capacity_bytes, "capacity_fraction": capacity_bytes / unswapped["peak_bytes"],
                  "capacity_rule": (f"--capacity-fraction {args.capacity_fraction}" if args.capacity_fraction is not None
                                    else f"peak - {args.hide_share:g} x link bytes in one forward pass"
                                    + (f", capped at {REDUCTION_CAP:.0%} of (peak - swap floor): hide-share "
                                       f"{plan['effective_hide_share']:.3g} in effect" if plan["reduction_capped"] else "")),
                  "swap_floor_bytes": floor_bytes,
                  "reduction_capped": args.capacity_fraction is None and plan["reduction_capped"],
                  "forward_device_s": unswapped["forward_device_s"], "forward_elapsed_s": unswapped["forward_elapsed_s"],
                  "iteration_s": unswapped["iteration_s"], "iteration_busy_s": unswapped["iteration_busy_s"],
                  "reduction_needed_bytes": unswapped["peak_bytes"] - capacity_bytes,
                  "link_bytes_in_forward": link_in_forward_bytes,
                  "link_bytes_in_iteration": link["link_bytes_in_iteration"],
                  "saved_activation_bytes": sum(unswapped["saved_storage_bytes"]),
                  **flop, "forward_flop_per_saved_byte": flop["forward_matmul_flop"] / sum(unswapped["saved_storage_bytes"]),
                  "eligible_bytes": sum(b for b in unswapped["saved_storage_bytes"] if b >= args.min_swap_bytes),
                  "eligible_storages": sum(b >= args.min_swap_bytes for b in unswapped["saved_storage_bytes"])}


# ---- report -------------------------------------------------------------------------------------
def print_report(r: dict) -> None:
    m, dev, link, mod = r["machine"], r["device"], r["link"], r["model"]
    print(f"command: {r['command']}")
    print(f"date: {r['date']}; {m['cpu']} ({m['cpus']} CPUs), {m['torch_threads']} torch threads, torch {m['torch']}; "
          f"load average {m['load_average_before']:.2f} before, {m['load_average_after']:.2f} after "
          f"(other jobs share this machine)")
    print_device(dev)
    c = r["config"]
    print(f"model: GPT {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, seq {c['seq']}, batch "
          f"{c['batch']}, vocab {c['vocab']}, fp32, SGD; {mod['parameters'] / 1e6:.2f} M parameters "
          f"({mod['parameter_bytes'] / MIB:.1f} MiB)")
    print(f"unswapped peak {mod['unswapped_peak_bytes'] / MIB:.2f} MiB; capacity {mod['capacity_bytes'] / MIB:.2f} MiB "
          f"({mod['capacity_fraction']:.2%}; {mod['capacity_rule']}): {mod['reduction_needed_bytes'] / MIB:.2f} MiB to take "
          f"off the peak")
    print_link(link)
    print(f"saved activations {mod['saved_activation_bytes'] / MIB:.2f} MiB per iteration, {mod['eligible_bytes'] / MIB:.2f} "
          f"MiB in {mod['eligible_storages']} storages >= min_swap_bytes {c['min_swap_bytes'] / 1024:.0f} KiB; "
          f"prefetch depth {c['prefetch_depth']}; {mod['forward_flop_per_saved_byte']:,.0f} forward matmul FLOP per "
          f"saved byte")
    print(f"rounds: "
          f"{r['rounds']['warmup']} untimed (planned {r['rounds']['warmup_planned']}; more while chameleon was not in "
          f"Stable) + {r['rounds']['timed']} timed, Williams-balanced order; "
          f"ratio = median over rounds of (variant / unconstrained, same round)")
    print()
    _print_variants(r)
    _print_chameleon(r)


def _print_variants(r: dict) -> None:
    """The variants' table and what its columns and variants mean."""
    dev, c = r["device"], r["config"]
    print(f"{'variant':<15}{'median ms':>10}{'ratio':>7}{'IQR':>13}{'stall ms':>9}{'stall %':>8}{'host-bd %':>10}"
          f"{'ops/it':>7}{'out MiB/it':>11}{'moved %':>8}{'bound %':>8}{'peak MiB':>9}{'capacity':>9}{'bit-identical':>15}"
          "   (emulated)")
    for name, v in r["variants"].items():
        cap = "unbound" if v["capacity_mib"] is None else f"{v['capacity_mib']:.2f}"
        iqr = f"{v['ratio_iqr'][0]:.2f}-{v['ratio_iqr'][1]:.2f}"
        same = f"{'yes' if v['bit_identical'] else 'NO'} {v['losses_equal']}/{v['losses_compared']}"
        print(f"{name:<15}{v['median_iteration_s'] * 1e3:>10.3f}{v['ratio']:>7.3f}{iqr:>13}{v['median_stall_s'] * 1e3:>9.3f}"
              f"{v['stall_share']:>8.1%}{v['host_bound_share']:>10.1%}{v['device_ops']:>7.0f}{v['swap_out_mib']:>11.2f}"
              f"{v['moved_share']:>8.1%}{v['physical_bound']:>8.1%}{v['peak_mib']:>9.2f}{cap:>9}{same:>15}")
    print(f"  device times (emulated); stall % = stall / unconstrained time of the same round; host-bd % = device idle "
          f"waiting for the host (iteration - compute busy - stall) / iteration, "
          f"{host_bound_summary(r['variants'])}; ops/it = aten ops dispatched per iteration (each costs the host "
          f"{host_cost_text(dev)}); moved % = swap-out bytes / saved activation bytes; bound % = physical bound (the "
          f"link's bytes in the forward's compute shadow / saved bytes)")
    print(f"  save_on_cpu = {SAVE_ON_CPU_LABEL}; capacity unbounded, no runtime (no signature), views share one "
          f"copy and parameters stay (both favour it)")
    base = r["config"]["baseline_profiled"]
    print(f"  baseline = swap every saved tensor >= min_swap_bytes, on-demand fetch + prefetch depth "
          f"{c['prefetch_depth']} ({'WarmUp forever: a detailed trace every iteration' if base else 'warmup_iterations 0: no trace, no policy'})")


def _print_chameleon(r: dict) -> None:
    """Chameleon's policy, its untimed rounds and transitions, issue 5's targets and the wall time."""
    c = r["config"]
    cv = r["variants"]["chameleon"]
    pol = r["chameleon_policy"]
    if pol:
        print(f"chameleon: policy {pol['name']} (v{pol['version']}, feasible {pol['feasible']}): swaps "
              f"{pol['swapped_storages']} storages, {pol['swap_mib']:.2f} MiB, recomputes {pol['recomputed_storages']} "
              f"storages, {pol['recompute_mib']:.2f} MiB; predicted peak {pol['predicted_peak_mib']:.2f} "
              f"MiB, stall {pol['predicted_stall_s'] * 1e3:.1f} ms; measured stages {cv['stages']}, passive swaps "
              f"{cv['passive_swaps']}, OOM retries {cv['oom_retries']}, on-demand fetches/it {cv['on_demand_fetches']:.0f}, "
              f"pressure waits {cv['pressure_waits']}, unmatched (max) {cv['unmatched']}")
    else:
        print(f"chameleon: NO policy chosen (stages {cv['stages']})")
    warm = [x for x in r["chameleon_rounds"] if x["stage"] == "warmup"]
    if warm:
        share = sum(x["stall_s"] for x in warm) / max(1e-30, sum(x["iteration_s"] for x in warm))
        print(f"  WarmUp iterations (swap all, detailed trace): {len(warm)}, {share:.0%} of their time was stall; the "
              f"trace's iteration time, which calibrates the policy's op times, includes it")
    if cv.get("stable_rounds"):
        print(f"  over the {cv['stable_rounds']} timed rounds in Stable only: ratio {cv['ratio_stable']:.3f}, stall "
              f"{cv['stall_share_stable']:.1%} of the unconstrained time (policy predicted "
              f"{(pol or {}).get('predicted_stall_s', 0) * 1e3:.1f} ms stall)")
    print("  trials: " + "; ".join(f"{t['policy']} {t['iteration_s'] * 1e3:.3f} ms peak {t['peak_mib']:.2f} MiB "
                                   f"{'held' if t['held'] else 'did not hold'}" for t in r["trials"]))
    print("  untimed rounds: " + "; ".join(
        f"{x['stage']}{'/' + x['policy'] if x['policy'] else ''} {x['iteration_s'] * 1e3:.3f} ms out {x['swap_out_mib']:.2f} MiB"
        + (f" passive {x['passive_swaps']}" if x['passive_swaps'] else "") + (f" OOM-retry {x['oom_retries']}" if x['oom_retries'] else "")
        for x in r["chameleon_rounds"][:r["rounds"]["warmup"]]))
    lowered = {n: b for n, b in r["min_swap_bytes_after"].items() if b != c["min_swap_bytes"]}
    if lowered:
        print(f"  NOTE: an out-of-memory retry lowered min_swap_bytes for good: {lowered}")
    for i, transition in cv["transitions"]:
        print(f"  after round {i}{' (timed)' if i >= r['rounds']['warmup'] else ''}: {transition}")
    k = r["checks"]
    print(f"issue 5 targets (emulated): chameleon ratio {cv['ratio']:.3f} <= 1.05: {'met' if k['chameleon_ratio_at_most_1.05'] else 'NOT met'}; "
          f"stall {cv['stall_share']:.1%} <= 2%: {'met' if k['chameleon_stall_at_most_2pct'] else 'NOT met'}; stable throughout "
          f"with its policy: {'yes' if k['chameleon_stable_throughout'] else 'NO'}; peak within capacity: "
          f"{'yes' if k['chameleon_peak_within_capacity'] else 'NO'}; all bit-identical: {'yes' if k['all_bit_identical'] else 'NO'}")
    print(f"wall time {r['wall_s']:.0f} s (rounds {r['rounds']['wall_s']:.0f} s)")


def print_link(link: dict, name: str = "the link") -> None:
    print(f"{name} ({link['d2h_bytes_per_s'] / 1e9:.3g} GB/s device-to-host, real rate) moves "
          f"{link['link_bytes_in_forward'] / MIB:.2f} MiB in the forward's device time "
          f"({link['forward_device_s'] * 1e3:.3f} ms of kernels; {link['forward_elapsed_s'] * 1e3:.3f} ms elapsed with "
          f"the host's gaps) and {link['link_bytes_in_iteration'] / MIB:.2f} MiB in one unconstrained iteration; saved "
          f"activations {link['saved_activation_bytes'] / MIB:.2f} MiB: physical bound "
          f"{link['physical_bound']:.1%} of them in the compute's shadow ({link['bound_with_host_gaps']:.1%} counting "
          f"the host's gaps); unconstrained run {link['unconstrained_host_bound_share']:.1%} host-bound (emulated)")


def host_cost_text(dev: dict) -> str:
    return "its measured time" if dev["host_op_s"] is None else f"{dev['host_op_s'] * 1e6:g} us"


def host_bound_summary(variants: dict) -> str:
    """Which variants the host's pace set (a label for the report: more than half the iteration idle)."""
    bound = [name for name, v in variants.items() if host_bound_label(v.get("host_bound_share")) == "host-bound"]
    return f"host-bound (> 50%): {', '.join(bound)}" if bound else "no variant host-bound (> 50%)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(parser)
    add_model_arguments(parser, "executor")
    parser.add_argument("--capacity-fraction", type=float, default=None,
                        help="capacity / unswapped peak (default: peak - --hide-share x the bytes the link moves in the "
                             "measured forward time)")
    parser.add_argument("--hide-share", type=float, default=0.25,
                        help="without --capacity-fraction: share of the link's bytes in one forward pass to take off")
    parser.add_argument("--min-swap-kib", type=float, default=None, help="min_swap_bytes in KiB (default 128)")
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument("--policy-trials", type=int, default=None, help="default 5")
    parser.add_argument("--warmup-rounds", type=int, default=None, help="default 3")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds (a multiple of 4 balances the order; default 16)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on a shared 2-core machine two threads stall each other)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-profiled", action="store_true",
                        help="baseline as WarmUp forever (warmup_iterations 10**6: a detailed trace every iteration)")
    parser.add_argument("--small", action="store_true", help="tiny model and few rounds (smoke test)")
    parser.add_argument("--verbose", action="store_true", help="one line per round")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    apply_shape(args)
    if args.small:
        args.shape = "small"
        for name, value in SHAPES["small"].items():
            setattr(args, name, value)
    # --small's values for what the command line left unset (``--small --rounds 2`` runs 2 rounds), else these
    for name, (default, small) in {"min_swap_kib": (128, 4), "rounds": (16, 4), "warmup_rounds": (3, 1),
                                   "policy_trials": (5, 2)}.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else default)
    if args.capacity_fraction is not None and not 0 < args.capacity_fraction <= 1 or args.hide_share <= 0 or args.rounds < 1 or args.hidden % args.heads:
        parser.error("need 0 < --capacity-fraction <= 1, --rounds >= 1 and --hidden divisible by --heads")
    args.min_swap_bytes = int(args.min_swap_kib * 1024)
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run_benchmark("launch.bench.bench_executor", argv, parse_args(argv), torch, run, print_report)


if __name__ == "__main__":
    main()
