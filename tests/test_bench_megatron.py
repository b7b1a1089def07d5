"""Smoke test of the Megatron layouts benchmark (launch/bench/bench_megatron.py): its dry run (one 2-rank layout,
3 iterations, two torchrun jobs, ~35 s on 2 cores) reports the fields of the table and bit-identity; and the
window/time/swap arithmetic on hand-written reports. Timings and ratios are measured, never asserted."""

import importlib.util
import json

import pytest

from launch.bench import bench_megatron

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def _rank(rank, stages, times, swaps, peak=100, capacity=200, sha="a"):
    return {"rank": rank, "tp_rank": 0, "pp_rank": rank, "dp_rank": 0, "capacity_bytes": capacity,
            "peak_device_bytes": peak, "params_sha256": sha,
            "iterations": [{"stage": s, "iteration_s": t, "swap_out_bytes": b} for s, t, b in zip(stages, times, swaps)]}


def _report(ranks, losses=("0x1.0p+0",), device=None):
    return {"losses": list(losses), "ranks": ranks,
            "chameleon": {"config": {"device": device or {"h2d_bytes_per_s": None, "d2h_bytes_per_s": None}}}}


def test_the_window_is_the_trailing_run_stable_on_every_rank_and_times_are_max_over_ranks_of_medians():
    on = _report([_rank(1, ["warmup", "stable", "stable", "stable", "stable"], [9, 9, 3, 5, 4], [0, 0, 10, 20, 30],
                        peak=150),
                  _rank(0, ["warmup", "gen_policy", "stable", "stable", "stable"], [9, 9, 2, 2, 2], [0, 0, 1, 1, 1])])
    off = _report([_rank(0, ["warmup"] * 5, [1, 1, 1, 1, 1], [0] * 5, peak=300),
                   _rank(1, ["warmup"] * 5, [1, 1, 2, 2, 2], [0] * 5, peak=400)])
    assert bench_megatron.stable_window(on["ranks"]) == [2, 3, 4]
    got = bench_megatron.compare(off, on)
    assert got["stable_window"] == [2, 3, 4]
    assert got["chameleon_iteration_s"] == 4 and got["reference_iteration_s"] == 2 and got["time_ratio"] == 2
    assert got["swap_out_bytes_per_iteration"] == 20 + 1
    assert got["unswapped_peak_bytes"] == 400 and got["chameleon_peak_bytes"] == 150 and got["peak_ratio"] == 150 / 400
    assert got["bit_identical"] and got["last_stage"] == {"rank0": "stable", "rank1": "stable"} and got["link"] == "instant"

    on["ranks"][0]["iterations"][-1]["stage"] = "gen_policy"  # the last iteration is not Stable everywhere
    on["ranks"][0]["params_sha256"] = "b"
    got = bench_megatron.compare(off, on)
    assert got["stable_window"] == [] and got["time_ratio"] is None
    assert got["swap_out_bytes_per_iteration"] == 30 + 1  # the last iteration's
    assert got["losses_identical"] and not got["params_identical"] and not got["bit_identical"]


@needs_megatron
def test_the_layouts_are_the_multi_rank_tests_table():
    from tests import test_megatron_ranks

    assert bench_megatron.tested_layouts() == test_megatron_ranks.LAYOUTS
    assert bench_megatron.DRY_RUN_LAYOUT in test_megatron_ranks.LAYOUTS
    assert bench_megatron.parse_args([]).unlimited == test_megatron_ranks.UNLIMITED


@needs_megatron
@pytest.mark.multirank  # (two torchrun jobs: NOTE [The multi-rank tier] in tests/conftest.py)
def test_dry_run_reports_one_layout_bit_identical(tmp_path, capsys):
    out_path = tmp_path / "bench.json"
    results = bench_megatron.main(["--dry-run", "--json", str(out_path)])
    printed = capsys.readouterr().out

    assert json.loads(out_path.read_text()) == json.loads(json.dumps(results))
    assert "-m launch.bench.bench_megatron --dry-run" in results["command"] and results["date"] and results["emulated"]
    for key in ("layouts", "checks", "config", "machine", "wall_s"):
        assert key in results, key
    assert results["config"]["iterations"] == bench_megatron.DRY_RUN_ITERATIONS
    assert "emulated (CPU)" in printed and "all bit-identical: yes" in printed

    [layout] = results["layouts"]
    assert "error" not in layout, layout
    world_size, args, capacity = bench_megatron.tested_layouts()[bench_megatron.DRY_RUN_LAYOUT]
    assert (layout["name"], layout["world_size"], layout["layout_args"], layout["capacity"]) == (
        bench_megatron.DRY_RUN_LAYOUT, world_size, args, capacity)
    assert layout["reference"]["returncode"] == layout["chameleon"]["returncode"] == 0
    assert "--no-chameleon" in layout["reference"]["command"] and "--no-chameleon" not in layout["chameleon"]["command"]
    assert layout["chameleon"]["command"].startswith(
        ".venv/bin/torchrun --standalone --nproc-per-node 2 -m launch.train_megatron")
    assert layout["layout"]["iterations"] == 3 and layout["layout"]["world_size"] == world_size

    assert layout["chameleon_peak_bytes"] <= layout["capacity_bytes"] < layout["unswapped_peak_bytes"]
    assert layout["peak_ratio"] == layout["chameleon_peak_bytes"] / layout["unswapped_peak_bytes"]
    assert layout["within_capacity"] and layout["swap_out_bytes_per_iteration"] > 0
    assert layout["bit_identical"] is True and layout["losses_identical"] and layout["params_identical"]
    assert set(layout["last_stage"]) == {"rank0", "rank1"}
    assert set(layout["last_stage"].values()) <= {"warmup", "gen_policy", "stable"}
    window = layout["stable_window"]
    assert (layout["time_ratio"] is None) == (not window) and (layout["time_ratio"] is None or layout["time_ratio"] > 0)
    assert len(layout["per_rank"]) == 2 and all(len(r["stages"]) == 3 for r in layout["per_rank"])
    assert results["checks"] == {"all_completed": True, "all_bit_identical": True, "all_within_capacity": True}
