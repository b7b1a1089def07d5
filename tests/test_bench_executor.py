"""Smoke test of the hidden-transfers benchmark (launch/bench_executor.py) on its tiny configuration.

Only that it runs and reports every variant with sane values: the timings themselves are measured, never
asserted against thresholds."""

import json

import torch

from launch import bench_executor


def test_small_run_reports_every_variant(tmp_path, capsys):
    threads = torch.get_num_threads()
    out_path = tmp_path / "bench.json"
    results = bench_executor.main(["--small", "--json", str(out_path)])
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == threads, "the test process is left as it was"

    assert json.loads(out_path.read_text()) == json.loads(json.dumps(results))
    assert "bench_executor.py --small" in results["command"] and results["date"] and results["emulated"]
    assert "emulated (CPU), link = h100-pcie calibrated:" in printed
    assert "save_on_cpu semantics emulated (synchronous copies, no prefetch)" in printed
    for key in ("calibration", "model", "chameleon_policy", "trials", "chameleon_rounds", "variants", "checks", "rounds"):
        assert key in results, key

    calibration, model = results["calibration"], results["model"]
    assert calibration["h2d_bytes_per_s"] > 0 and calibration["cpu_flop_per_s"] > 0
    assert 0 < model["capacity_bytes"] < model["unswapped_peak_bytes"], "swapping is needed"

    variants = results["variants"]
    assert set(variants) == {"unconstrained", "chameleon", "baseline", "save_on_cpu"}
    assert variants["unconstrained"]["ratio"] == 1.0 and variants["unconstrained"]["swap_out_mib"] == 0
    for name, v in variants.items():
        assert v["median_iteration_s"] > 0 and v["ratio"] > 0 and v["ratio_of_medians"] > 0, name
        assert v["stall_share"] >= 0 and v["peak_mib"] > 0, name
        assert v["bit_identical"] and v["losses_equal"] == v["losses_compared"] > 0, name
        assert len(v["iteration_s"]) == results["rounds"]["timed"] == 4, name
    for name in ("chameleon", "baseline"):
        assert variants[name]["peak_mib"] * 2**20 <= model["capacity_bytes"], name
    for name in ("baseline", "save_on_cpu"):
        assert variants[name]["swap_out_mib"] > 0, name
    # Chameleon takes bytes off the device by swapping them, or by recomputing them (executor.allow_recompute)
    policy = results["chameleon_policy"]
    assert variants["chameleon"]["swap_out_mib"] > 0 or (policy is not None and policy["recompute_mib"] > 0)
    assert variants["baseline"]["swap_out_mib"] >= variants["chameleon"]["swap_out_mib"]

    assert any(r["stage"] == "stable" and r["policy"] for r in results["chameleon_rounds"]), "Stable reached"
    assert results["chameleon_policy"]["name"] and results["trials"]
    assert results["checks"]["all_bit_identical"]
