"""Eq. 1 at scale (issue 28, item 4): how far the paper's ``T_group = T_iter / N_iter * N_group`` is from
each op's simulated device time on an LLM's meta trace, next to the generator's calibration with measured
layer times, and how much calibration changes the chosen policy's stall.

One iteration of a model runs through ``Chameleon`` on the emulated device with meta tensors
(``EmulatedDevice(meta_tensors=True)``) and a memory budget it never reaches and a ``min_swap_bytes`` no
tensor reaches, so the profiled iteration swaps nothing: its ops are the program's own, with no copies or
host work of a swap-everything WarmUp among them (its layer times leave out the waits on copies either way:
``LayerTimes.resolve``). The backend's per-op observer
(``SimulatedBackend.op_times_s``) gives each op's kernel seconds on the device clock: the roofline cost
``device/cost.py`` charges, 0.0 for ops that launch no kernel. ``T_iter`` is their sum.

How the observer's ops line up with the trace's: ``launch/experiments/op_times.py``.

Per G (default 1, L/2, L, 2L, 4L for L transformer layers), the iteration's ops are cut into G consecutive
groups of (nearly) equal op counts, and a last row uses the generator's own cut (``logical_layers``). Per
row: the coefficient of variation of the true group times, and the mean and max of ``|estimate - true| /
true`` over groups, for Eq. 1 (``T_iter / N_iter * N_group``) and for the generator's calibrated estimate
(``calibrated_group_times_s`` over its logical layers, from the trace's device-clock iteration time and
measured forward layer times, spread over their ops, summed per group and scaled to add up to ``T_iter``:
both are compared as shares of the same total; the device clock also counts the device's idle time while
the host is behind, so its times can exceed the kernels').

Policies (``policy_stalls``): the best of ``generate_policies`` from the trace without its layer times (Eq. 1
alone), from the trace as it is (the generator calibrates whenever the trace has measured layer times), and
from the true op times; each with the simulator's predicted stall, the simulator's stall when it is given
the true op times, and (``--no-measure`` skips it) the stall measured by running it for one iteration on a
fresh runtime, whose WarmUp applies the controller's chosen policy.

    .venv/bin/python -m launch.experiments.scale_eq1 --model llama2-7b --json runs/scale_eq1.json

``eq1_rows`` and ``policy_stalls`` take any trace and its op times (e.g. the Megatron benchmark's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from chameleon_dist import Chameleon
from chameleon_dist.device import EmulatedDevice
from chameleon_dist.models.llama import LlamaShape, build_llama
from chameleon_dist.planner import load_model
from chameleon_dist.policy import (
    Decision,
    PolicySettings,
    calibrated_group_times_s,
    generate_policies,
    logical_layers,
    find_candidates,
    op_times_s as spread,
    Planned,
    simulate,
)
from chameleon_dist.schema_version import versioned
from chameleon_dist.trace import StepTrace
from chameleon_dist.units import format_bytes
from launch.experiments.op_times import profile_iteration  # noqa: F401  (scale_eq1.profile_iteration, as before)
from launch.experiments.scale_runs import HOST_OP_S, Case, profiled_iteration

MIN_SWAP_BYTES = 2**20
NEVER_SWAP_BYTES = 2**60  # the profiled iteration's min_swap_bytes: nothing is swapped
CAPACITY_BYTES = 2**40


def _layers(trace: StepTrace) -> int:
    return len({op.layer for op in trace.ops if op.layer >= 0}) or len(trace.layer_times_s)


def default_group_counts(trace: StepTrace) -> list[int]:
    n = _layers(trace)
    return list(dict.fromkeys(min(len(trace.ops), max(1, g)) for g in (1, n // 2, n, 2 * n, 4 * n)))


def _errors(estimate: list[float], true: list[float]) -> list[float]:
    return [abs(e - t) / t for e, t in zip(estimate, true) if t > 0]


def _row(cut: str, bounds: list[tuple[int, int]], true_s, eq1_s, calibrated_s) -> dict:
    per = [[sum(times[a:b]) for a, b in bounds] for times in (true_s, eq1_s, calibrated_s)]
    mean = statistics.fmean(per[0])
    eq1, cal = _errors(per[1], per[0]), _errors(per[2], per[0])
    return {"cut": cut, "groups": len(bounds), "ops_per_group": statistics.fmean(b - a for a, b in bounds),
            "cv": statistics.pstdev(per[0]) / mean if mean > 0 else 0.0,
            "eq1_mean_error": statistics.fmean(eq1) if eq1 else 0.0, "eq1_max_error": max(eq1, default=0.0),
            "calibrated_mean_error": statistics.fmean(cal) if cal else 0.0,
            "calibrated_max_error": max(cal, default=0.0), "zero_time_groups": len(bounds) - len(eq1)}


def calibrated_op_times_s(trace: StepTrace) -> list[float]:
    """The generator's per-op times: its logical layers, calibrated with the trace's measured layer times
    (Eq. 1 alone when it has none), spread over their ops (``generate_policies`` without ``op_times_s``)."""
    groups, _ = logical_layers(trace)
    return spread(groups, calibrated_group_times_s(trace, groups))


def eq1_rows(trace: StepTrace, op_times_s: list[float], group_counts: list[int] | None = None) -> list[dict]:
    """Eq. 1 and the calibrated estimate against ``op_times_s`` (true seconds per trace op), per G in
    ``group_counts`` (default ``default_group_counts``) and over the generator's logical layers."""
    n = len(trace.ops)
    if len(op_times_s) != n or n == 0:
        raise ValueError(f"op_times_s has {len(op_times_s)} entries for {n} trace ops")
    total_s = sum(op_times_s)
    calibrated_s = calibrated_op_times_s(trace)
    scale = total_s / sum(calibrated_s) if sum(calibrated_s) > 0 else 0.0
    eq1_s, calibrated_s = [total_s / n] * n, [t * scale for t in calibrated_s]
    rows = []
    for g in group_counts or default_group_counts(trace):
        if not 1 <= g <= n:
            raise ValueError(f"group count {g} is not within 1..{n} (the trace's ops)")
        cuts = [round(k * n / g) for k in range(g + 1)]
        rows.append(_row("even", list(zip(cuts, cuts[1:])), op_times_s, eq1_s, calibrated_s))
    groups, rule = logical_layers(trace)
    rows.append(_row(f"logical layers ({rule})", [(x.start, x.end) for x in groups], op_times_s, eq1_s,
                     calibrated_s))
    return rows


def megatron_eq1(case: Case, *, preset: str, seq_length: int, micro_batches: int) -> list[dict]:
    """Eq. 1 against each op's simulated time (``eq1_rows``) for one profiled iteration of
    ``case`` through Megatron's schedule, nothing swapped (inside a ``megatron_meta_session``)."""
    trace, op_times_s = profiled_iteration(case, preset=preset, seq_length=seq_length, micro_batches=micro_batches)
    return eq1_rows(trace, op_times_s)


def _true_stall_s(trace: StepTrace, policy, op_times_s: list[float], settings: PolicySettings) -> float:
    """``policy``'s stall in the simulator when it knows every op's true time (a recomputation costs its
    producer's true time); its decisions in the generator's order (the links are FIFO)."""
    by_storage = {c.storage_id: c for c in find_candidates(trace, settings.min_swap_bytes)}
    by_ordinal = list(dict.fromkeys(trace.tensors[t].storage_id for t, _ in trace.saves))  # (policy/assemble.py)
    keyed = []
    for e in policy.entries:
        c = by_storage[by_ordinal[e.save_ordinal]]
        recompute_s = op_times_s[c.created_at] if e.decision == Decision.RECOMPUTE else 0.0
        keyed.append(((c.save_op_index, c.storage_id), Planned(
            e.nbytes, e.decision, e.last_forward_use, e.first_backward_use, e.swap_out_at, e.swap_in_at, recompute_s)))
    planned = [p for _, p in sorted(keyed, key=lambda item: item[0])]
    return simulate(trace.no_swap_memory_curve(), op_times_s, planned, settings.d2h_bytes_per_s,
                    settings.h2d_bytes_per_s).stall_s


def policy_stalls(trace: StepTrace, op_times_s: list[float], settings: PolicySettings) -> dict[str, dict]:
    """The best policy generated with Eq. 1 alone (the trace without its layer times), with calibration
    (the trace as it is: the generator calibrates when it has measured layer times), and from the true op
    times; each one's predicted stall and its stall in the simulator under the true times."""
    inputs = {"eq1": (dataclasses.replace(trace, layer_times_s={}), None), "calibrated": (trace, None),
              "true op times": (trace, list(op_times_s))}
    out = {}
    for name, (source, times) in inputs.items():
        best = generate_policies(source, settings, op_times_s=times).best
        out[name] = {"policy": best, "name": best.name, "feasible": best.feasible,
                     "predicted_peak_bytes": best.predicted_peak_bytes, "predicted_stall_s": best.predicted_stall_s,
                     "true_stall_s": _true_stall_s(trace, best, op_times_s, settings),
                     "swapped_bytes": best.saved_bytes(Decision.SWAP),
                     "recomputed_bytes": best.saved_bytes(Decision.RECOMPUTE)}
    return out


# ---- our Llama on the emulated device ------------------------------------------------------------
def llama_runtime(shape: LlamaShape, preset: str, host_op_s: float, config: dict, model=None):
    """A meta Llama (``model``, default a fresh ``build_llama(shape)``) attached to a fresh runtime on a fresh
    emulated device; (runtime, closure)."""
    model = build_llama(shape) if model is None else model
    tokens = torch.zeros(shape.micro_batch_size, shape.seq_length, dtype=torch.long, device="meta")
    device = EmulatedDevice(CAPACITY_BYTES, preset=preset, host_op_s=host_op_s, meta_tensors=True)
    runtime = Chameleon(config, device=device)
    runtime.attach(model)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(tokens, tokens)
        loss.backward()
        return loss.detach()

    return runtime, step


def measured_stall(make: Callable[[dict], tuple[Chameleon, Callable]], policy, budget_bytes: int) -> dict:
    """Run ``policy`` for one iteration on a fresh runtime (``make(config)``): WarmUp applies the
    controller's chosen policy."""
    runtime, closure = make({"memory_budget": budget_bytes, "min_swap_bytes": MIN_SWAP_BYTES})
    runtime.controller.chosen = policy
    runtime.run_iteration(closure)
    r = runtime.last_report
    return {"stall_s": r.stall_s, "peak_bytes": r.peak_device_bytes, "passive_swaps": r.passive_swaps,
            "policy": r.policy, "unmatched": r.unmatched}


def run(args: argparse.Namespace) -> dict:
    start_s = time.perf_counter()
    shape = LlamaShape.from_profile(load_model(args.model))
    shape = shape.model_copy(update={k: v for k, v in (("num_layers", args.layers), ("seq_length", args.seq_length))
                                     if v is not None})
    make = lambda config: llama_runtime(shape, args.preset, args.host_op_s, config)  # noqa: E731
    runtime, closure = make({"min_swap_bytes": NEVER_SWAP_BYTES})
    trace, op_times_s = profile_iteration(runtime, closure)
    profiled_s = time.perf_counter() - start_s
    rows = eq1_rows(trace, op_times_s)
    no_swap_peak = max(trace.no_swap_memory_curve())
    budget = int(args.budget_fraction * no_swap_peak)
    device = runtime.device
    settings = PolicySettings(budget_bytes=budget, d2h_bytes_per_s=device.d2h_bytes_per_s,
                              h2d_bytes_per_s=device.h2d_bytes_per_s, min_swap_bytes=MIN_SWAP_BYTES)
    policies = policy_stalls(trace, op_times_s, settings)
    for p in policies.values():
        p["measured"] = measured_stall(make, p.pop("policy"), budget) if args.measure else None
    return {"model": args.model, "shape": shape.describe(), "preset": args.preset, "host_op_s": args.host_op_s,
            "ops": len(trace.ops), "layers": _layers(trace), "iteration_s": trace.iteration_s,
            "op_time_sum_s": sum(op_times_s), "layer_times_s": list(trace.layer_times_s.values()),
            "rows": rows, "budget_fraction": args.budget_fraction, "budget_bytes": budget,
            "no_swap_peak_bytes": no_swap_peak, "link_bytes_per_s": [settings.d2h_bytes_per_s, settings.h2d_bytes_per_s],
            "policies": policies, "profile_wall_s": profiled_s, "wall_s": time.perf_counter() - start_s}


def print_report(r: dict) -> None:
    layer_ms = [t * 1e3 for t in r["layer_times_s"]]
    print(f"{r['model']} ({r['shape']}), {r['preset']}, host {r['host_op_s'] * 1e6:g} us/op, emulated: {r['ops']} ops, "
          f"T_iter (sum of kernels) {r['op_time_sum_s'] * 1e3:.1f} ms, device clock {r['iteration_s'] * 1e3:.1f} ms; "
          f"forward layer times {min(layer_ms, default=0):.2f}-{max(layer_ms, default=0):.2f} ms")
    print()
    print("| cut | groups | ops/group | CV of true times | Eq. 1 mean err | Eq. 1 max err | calibrated mean err "
          "| calibrated max err |")
    print("|---|---|---|---|---|---|---|---|")
    for w in r["rows"]:
        print(f"| {w['cut']} | {w['groups']} | {w['ops_per_group']:.1f} | {w['cv']:.3f} | {w['eq1_mean_error']:.1%} | "
              f"{w['eq1_max_error']:.1%} | {w['calibrated_mean_error']:.1%} | {w['calibrated_max_error']:.1%} |")
    print()
    print(f"Policies at {r['budget_fraction']:.0%} of the no-swap peak {format_bytes(r['no_swap_peak_bytes'])} = "
          f"{format_bytes(r['budget_bytes'])}, link {r['link_bytes_per_s'][0] / 1e9:.1f} GB/s d2h, "
          f"{r['link_bytes_per_s'][1] / 1e9:.1f} GB/s h2d:")
    print()
    print("| op times from | best | fits | predicted peak | predicted stall | stall, true op times | swapped | "
          "recomputed | measured stall | measured peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, p in r["policies"].items():
        m = p["measured"]
        measured = (f"{m['stall_s'] * 1e3:.1f} ms | {format_bytes(m['peak_bytes'])}" if m else "- | -")
        print(f"| {name} | {p['name']} | {'yes' if p['feasible'] else 'no'} | {format_bytes(p['predicted_peak_bytes'])} | "
              f"{p['predicted_stall_s'] * 1e3:.1f} ms | {p['true_stall_s'] * 1e3:.1f} ms | "
              f"{format_bytes(p['swapped_bytes'])} | {format_bytes(p['recomputed_bytes'])} | {measured} |")
    print()
    print(f"wall time {r['wall_s']:.1f} s (profiled iteration {r['profile_wall_s']:.1f} s)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama2-7b", help="a Llama-architecture profile of configs/models/")
    parser.add_argument("--layers", type=int, help="transformer layers (default: the profile's)")
    parser.add_argument("--seq-length", type=int, help="(default: the profile's)")
    parser.add_argument("--preset", default="h100-pcie")
    parser.add_argument("--host-op-s", type=float, default=HOST_OP_S, help="host seconds per op")
    parser.add_argument("--budget-fraction", type=float, default=0.7, help="memory budget / no-swap peak")
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="skip running each policy (predicted stalls only)")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    if not 0 < args.budget_fraction <= 1:
        parser.error("--budget-fraction must be in (0, 1]")
    result = run(args)
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(versioned(result), indent=1))
    return result


if __name__ == "__main__":
    main()
