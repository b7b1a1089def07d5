"""The figures of one case of ``launch/bench/bench_dynamic.py`` from its three variants' records (the untimed
measurement pass, the plain loop, chameleon): ratios and stalls over Stable iterations, the physical bound,
bit-identity, and one row per chameleon iteration. ``case`` is a ``bench_dynamic.Case``, the variants its
``CaseVariant``s; ``moes`` the model's MoE layers."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from launch.bench.device_clock import median_of, physical_bound
from launch.bench.swap_variants import MIB, Variant


def first_plan_end(stages: list[str]) -> int:
    """The index of the first iteration after the opening WarmUp stretch and the GenPolicy stretch after it."""
    i = 0
    for stage in ("warmup", "gen_policy"):
        while i < len(stages) and stages[i] == stage:
            i += 1
    return i


def identity(measure: Variant, plain: Variant, cham: Variant, failure: dict | None) -> dict:
    """Chameleon's losses and final parameters against the plain loop's, and the measurement pass's."""
    ref_params = list(plain.model.parameters())
    losses_equal = sum(torch.equal(a, b) for a, b in zip(cham.losses, plain.losses))
    params_equal = sum(torch.equal(a.detach(), b.detach()) for a, b in zip(ref_params, cham.model.parameters()))
    identical = losses_equal == len(plain.losses) == len(cham.losses) and params_equal == len(ref_params)
    measure_equal = (all(torch.equal(a, b) for a, b in zip(measure.losses, plain.losses))
                     and (failure is not None or all(torch.equal(a.detach(), b.detach())
                                                     for a, b in zip(measure.model.parameters(), ref_params))))
    return {
        "losses_equal": losses_equal,
        "losses_compared": min(len(plain.losses), len(cham.losses)),
        "parameters_equal": None if failure else params_equal,
        "parameters_compared": 0 if failure else len(ref_params),
        # None when chameleon failed: the losses before are compared, the final parameters cannot be
        "bit_identical": None if failure else identical,
        "measurement_pass_identical": measure_equal,
    }


def iteration_rows(case: Any, plain: Variant, cham: Variant) -> list[dict]:
    """One row per chameleon iteration, beside the plain loop's time."""
    return [{"iteration": i, "seq": case.seq_lengths[i], "stage": r["stage"],
             "policy": r["policy"],
             "iteration_s": r["iteration_s"], "plain_s": plain.records[i]["iteration_s"],
             "stall_s": r["stall_s"], "host_bound_share": r["host_bound_share"],
             "device_ops": r["device_ops"], "peak_mib": r["peak_bytes"] / MIB,
             "swap_out_mib": r["swap_out_bytes"] / MIB, "passive_swaps": r["passive_swaps"],
             "oom_retries": r["oom_retries"], "unmatched": r["unmatched"],
             "matched_fuzzy": r["matched_fuzzy"], "sequence_changed": r["sequence_changed"],
             "sequence_differs": r["sequence_differs"], "num_ops": r["num_ops"],
             "stage_transition": r["stage_transition"]}
            for i, r in enumerate(cham.records)]


def case_result(case: Any, args: argparse.Namespace, measure: Variant, plain: Variant, cham: Variant,
                idle: list[int], moes: int, capacity_bytes: int, failure: dict | None) -> dict:
    """The case's figures (but its wall times) from the three variants' records."""
    peaks = [r["peak_bytes"] for r in measure.records]
    saved_bytes = [r["saved_bytes"] for r in measure.records]
    stages = [r["stage"] for r in cham.records]
    begin = first_plan_end(stages)
    return {
        "description": case.description,
        "iterations": args.iterations,
        "failed": failure,  # None, or the iteration in which chameleon raised (the case stopped there)
        "seq_lengths": list(case.seq_lengths),
        "model": {"parameters": sum(p.numel() for p in plain.model.parameters()),
                  "parameter_bytes": sum(p.numel() * p.element_size() for p in plain.model.parameters()),
                  "moe_layers": moes, "experts": case.experts},
        "idle_experts": idle if moes else None,
        "iterations_with_idle_experts": sum(x > 0 for x in idle) if moes else None,
        "unswapped_peak_bytes": max(peaks),
        "unswapped_peaks_mib": [b / MIB for b in peaks],
        "capacity_bytes": capacity_bytes,
        "plain_peaks_match_measurement": [r["peak_bytes"] for r in plain.records] == peaks[:len(plain.records)],
        "first_plan_end": begin,
        "stages": {s: stages.count(s) for s in sorted(set(stages))},
        **stable_figures(plain, cham, saved_bytes, begin, capacity_bytes),
        **identity(measure, plain, cham, failure),
        "chameleon_iterations": iteration_rows(case, plain, cham),
    }


def stable_figures(plain: Variant, cham: Variant, saved_bytes: list[int], begin: int,
                    capacity_bytes: int) -> dict:
    """Ratios, stalls, bounds, swaps and transitions: medians over Stable iterations (after the first plan)."""
    done = len(cham.records)  # n, or the iteration in which chameleon failed
    # the physical bound per iteration: the plain loop's forward device time, the measurement pass's saved bytes
    d2h_bytes_per_s = plain.device.d2h_bytes_per_s
    bounds = [physical_bound(d2h_bytes_per_s, r["forward_busy_s"], b) for r, b in zip(plain.records, saved_bytes)]
    gap_bounds = [physical_bound(d2h_bytes_per_s, r["forward_elapsed_s"], b) for r, b in zip(plain.records, saved_bytes)]
    stages = [r["stage"] for r in cham.records]
    after = range(begin, done)
    stable = [i for i in after if stages[i] == "stable"]
    ratios = [cham.records[i]["iteration_s"] / plain.records[i]["iteration_s"] for i in range(done)]
    transitions = [(i, r["stage_transition"]) for i, r in enumerate(cham.records) if r["stage_transition"]]
    return {
        "stable_iterations": len(stable),
        "stable_share": len(stable) / len(after) if after else None,
        "ratio": statistics.median(ratios[i] for i in stable) if stable else None,
        "ratio_after_first_plan": statistics.median(ratios[i] for i in after) if after else None,
        "stall_share_stable": statistics.median(cham.records[i]["stall_s"] / plain.records[i]["iteration_s"]
                                                for i in stable) if stable else None,
        "plain_median_s": statistics.median(r["iteration_s"] for r in plain.records[:done]) if done else None,
        "chameleon_median_stable_s": (statistics.median(cham.records[i]["iteration_s"] for i in stable)
                                      if stable else None),
        "swap_out_mib_stable": (statistics.median(cham.records[i]["swap_out_bytes"] for i in stable) / MIB
                                if stable else None),
        # moved = swap-out bytes / the iteration's saved activation bytes; bound = min(1, d2h x forward device time /
        # saved bytes), both per iteration (the length changes them), medians over Stable (the bound: every iteration)
        "moved_share_stable": (statistics.median(cham.records[i]["swap_out_bytes"] / saved_bytes[i] for i in stable)
                               if stable else None),
        "physical_bound": statistics.median(bounds) if bounds else None,
        "physical_bound_range": [min(bounds), max(bounds)] if bounds else None,
        "bound_with_host_gaps": statistics.median(gap_bounds) if gap_bounds else None,
        "forward_device_s": median_of(plain.records, "forward_busy_s"),
        "forward_elapsed_s": median_of(plain.records, "forward_elapsed_s"),
        "saved_activation_bytes": statistics.median(saved_bytes),
        "host_bound_share_stable": median_of([cham.records[i] for i in stable], "host_bound_share"),
        "plain_host_bound_share": median_of(plain.records[:done], "host_bound_share"),
        "device_ops_stable": median_of([cham.records[i] for i in stable], "device_ops"),
        "plain_device_ops": median_of(plain.records[:done], "device_ops"),
        "passive_swaps": sum(r["passive_swaps"] for r in cham.records),
        "passive_swaps_stable": sum(cham.records[i]["passive_swaps"] for i in stable),
        "oom_retries": sum(r["oom_retries"] for r in cham.records),
        "peak_bytes": max((r["peak_bytes"] for r in cham.records), default=0),
        "peak_over_capacity": max((r["peak_bytes"] for r in cham.records), default=0) / capacity_bytes,
        "transitions": transitions,
        "transitions_to_warmup": sum("-> warmup" in t for _, t in transitions),
        "policies": sorted({r["policy"] for r in cham.records if r["policy"]}),
        # the policy each Stable iteration applied ("" = none: every eligible tensor swapped)
        "stable_policies": {name: [cham.records[i]["policy"] for i in stable].count(name)
                            for name in sorted({cham.records[i]["policy"] for i in stable})},
        "sequence_changed": sum(r["sequence_changed"] for r in cham.records),
        "sequence_differs": sum(r["sequence_differs"] for r in cham.records),
    }
