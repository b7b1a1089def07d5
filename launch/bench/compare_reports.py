"""Compare two launcher reports (``--report`` of ``launch/train_megatron.py`` or ``launch/train_deepspeed.py``):
a reference run (``--no-chameleon``: metered, nothing swapped) and a run with Chameleon.

    python -m launch.bench.compare_reports runs/reference.json runs/chameleon.json

Prints whether the two trained bit-identically (equal ``losses``, exact, and equal ``params_sha256`` on every
rank), every rank's unswapped peak, peak with Chameleon and capacity, and the swap-out and time figures;
exits 1 when the runs differ or a rank went over its capacity. ``compare`` is what ``bench_megatron.py``
tabulates:

- the *window* is the trailing run of iterations in which every rank of the Chameleon job reports the
  Stable stage; per job, each rank's median ``iteration_s`` over the window, then the maximum over the
  ranks (a synchronous job goes at its slowest rank); the time ratio divides the two jobs' figures. No
  window (the last iteration is not Stable on every rank): no ratio;
- swap-out bytes per iteration: the sum over the ranks of each rank's mean ``swap_out_bytes`` over the
  window (over the last iteration when there is no window).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

MIB = 2**20


def stable_window(ranks: list[dict]) -> list[int]:
    """The trailing iterations in which every rank reports the Stable stage (oldest first)."""
    count = min(len(r["iterations"]) for r in ranks)
    window: list[int] = []
    for i in range(count - 1, -1, -1):
        if not all(r["iterations"][i]["stage"] == "stable" for r in ranks):
            break
        window.insert(0, i)
    return window


def job_time_s(ranks: list[dict], window: list[int]) -> float:
    """Max over ranks of each rank's median ``iteration_s`` over ``window``."""
    return max(statistics.median(r["iterations"][i]["iteration_s"] for i in window) for r in ranks)


def by_rank(report: dict) -> list[dict]:
    return sorted(report["ranks"], key=lambda r: r["rank"])


def compare(reference: dict, chameleon: dict) -> dict:
    """The table's figures from the two jobs' reports."""
    off, on = by_rank(reference), by_rank(chameleon)
    window = stable_window(on)
    rows = window or [min(len(r["iterations"]) for r in on) - 1]
    unswapped = max(r["peak_device_bytes"] for r in off)
    peak = max(r["peak_device_bytes"] for r in on)
    capacity = max(r["capacity_bytes"] for r in on)
    reference_s = job_time_s(off, window) if window else None
    chameleon_s = job_time_s(on, window) if window else None
    losses_identical = reference["losses"] == chameleon["losses"]
    params_identical = [r["params_sha256"] for r in off] == [r["params_sha256"] for r in on]
    return {
        "unswapped_peak_bytes": unswapped,
        "chameleon_peak_bytes": peak,
        "capacity_bytes": capacity,
        "peak_ratio": peak / unswapped,
        "within_capacity": all(r["peak_device_bytes"] <= r["capacity_bytes"] for r in on),
        "stable_window": window,
        "reference_iteration_s": reference_s,
        "chameleon_iteration_s": chameleon_s,
        "time_ratio": chameleon_s / reference_s if window else None,
        "swap_out_bytes_per_iteration": sum(statistics.fmean(r["iterations"][i]["swap_out_bytes"] for i in rows)
                                            for r in on),
        "losses_identical": losses_identical,
        "params_identical": params_identical,
        "bit_identical": losses_identical and params_identical,
        "last_stage": {f"rank{r['rank']}": r["iterations"][-1]["stage"] for r in on},
        "per_rank": [
            {"rank": b["rank"], "tp_rank": b["tp_rank"], "pp_rank": b["pp_rank"], "dp_rank": b["dp_rank"],
             "unswapped_peak_bytes": a["peak_device_bytes"], "chameleon_peak_bytes": b["peak_device_bytes"],
             "reference_median_s": statistics.median(a["iterations"][i]["iteration_s"] for i in window) if window else None,
             "chameleon_median_s": statistics.median(b["iterations"][i]["iteration_s"] for i in window) if window else None,
             "stages": [it["stage"] for it in b["iterations"]]}
            for a, b in zip(off, on)
        ],
        "link": link_of(chameleon),
        "emulated": any(row.get("emulated", True) for r in on for row in r["iterations"]),
    }


def link_of(report: dict) -> str:
    device = report["chameleon"]["config"]["device"]
    if device.get("preset"):
        return f"{device['preset']} preset (scaled to each rank's CPU)"
    if device.get("h2d_bytes_per_s") is None and device.get("d2h_bytes_per_s") is None:
        return "instant"
    return f"{device.get('h2d_bytes_per_s')} B/s h2d, {device.get('d2h_bytes_per_s')} B/s d2h"


def summary(result: dict) -> str:
    lines = [f"bit-identical: {'yes' if result['bit_identical'] else 'NO'} (losses "
             f"{'equal' if result['losses_identical'] else 'differ'}, parameters "
             f"{'equal' if result['params_identical'] else 'differ'} on every rank)",
             f"within capacity on every rank: {'yes' if result['within_capacity'] else 'NO'}"]
    for r in result["per_rank"]:
        lines.append(f"rank {r['rank']} (tp {r['tp_rank']} pp {r['pp_rank']} dp {r['dp_rank']}): unswapped peak "
                     f"{r['unswapped_peak_bytes'] / MIB:.2f} MiB, with Chameleon {r['chameleon_peak_bytes'] / MIB:.2f} MiB, "
                     f"stages {' '.join(r['stages'])}")
    ratio = result["time_ratio"]
    lines.append(f"capacity {result['capacity_bytes'] / MIB:.2f} MiB; peak ratio {result['peak_ratio']:.2f}; swap-out "
                 f"{result['swap_out_bytes_per_iteration'] / MIB:.2f} MiB per iteration; time ratio "
                 f"{'-' if ratio is None else format(ratio, '.2f')}; link {result['link']}")
    if result["emulated"]:
        lines.append("all figures are emulated: memory metered exactly, times on this machine's CPU cores (not a GPU's)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path, help="The report of the run without Chameleon (--no-chameleon).")
    parser.add_argument("chameleon", type=Path, help="The report of the run with Chameleon.")
    args = parser.parse_args(argv)
    result = compare(json.loads(args.reference.read_text()), json.loads(args.chameleon.read_text()))
    sys.stdout.write(summary(result) + "\n")
    return 0 if result["bit_identical"] and result["within_capacity"] else 1


if __name__ == "__main__":
    sys.exit(main())
