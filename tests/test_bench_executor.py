"""Smoke test of the hidden-transfers benchmark (launch/bench/bench_executor.py) on its tiny configuration.

Only that it runs and reports every variant with sane values: the timings themselves are measured, never
asserted against thresholds."""

import json

import pytest
import torch

from chameleon_dist.device.presets import get_preset
from launch.bench import bench_executor, same_figures
from launch.bench.device_clock import DEFAULT_HOST_OP_S, host_op_s_value


@pytest.mark.slow  # (out of the quick tier: a small run of every variant, 19 s loaded; the option tests below stay quick)
def test_small_run_reports_every_variant(tmp_path, capsys):
    threads = torch.get_num_threads()
    out_path = tmp_path / "bench.json"
    results = bench_executor.main(["--small", "--json", str(out_path)])
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == threads, "the test process is left as it was"

    assert json.loads(out_path.read_text()) == json.loads(json.dumps(results))
    assert "-m launch.bench.bench_executor --small" in results["command"] and results["date"] and results["emulated"]
    assert "ALL FIGURES EMULATED: simulated device (h100-pcie)" in printed and "(emulated)" in printed
    assert "save_on_cpu semantics emulated (synchronous copies, no prefetch)" in printed
    for key in ("device", "link", "model", "chameleon_policy", "trials", "chameleon_rounds", "variants", "checks", "rounds"):
        assert key in results, key

    # the device is the preset at its real link rate (no scaling to this CPU), with the fixed host cost by default
    device, link, model = results["device"], results["link"], results["model"]
    preset = get_preset("h100-pcie")
    assert device["emulated"] and device["preset"] == "h100-pcie" and device["host_op_s"] == DEFAULT_HOST_OP_S
    assert device["d2h_bytes_per_s"] == preset.d2h_bytes_per_s and device["h2d_bytes_per_s"] == preset.h2d_bytes_per_s
    assert device["peak_flop_per_s"]["float32"] == preset.dtype_peaks()["float32"]
    assert 0 < model["capacity_bytes"] < model["unswapped_peak_bytes"], "swapping is needed"
    assert 0 < link["forward_device_s"] <= link["forward_elapsed_s"], "kernels inside the forward's device time"
    assert link["physical_bound"] == min(1.0, preset.d2h_bytes_per_s * link["forward_device_s"]
                                         / link["saved_activation_bytes"])
    assert 0 <= link["unconstrained_host_bound_share"] < 1

    variants = results["variants"]
    assert set(variants) == {"unconstrained", "chameleon", "baseline", "save_on_cpu"}
    assert variants["unconstrained"]["ratio"] == 1.0 and variants["unconstrained"]["swap_out_mib"] == 0
    assert variants["unconstrained"]["moved_share"] == 0
    for name, v in variants.items():
        assert v["median_iteration_s"] > 0 and v["ratio"] > 0 and v["ratio_of_medians"] > 0, name
        assert v["stall_share"] >= 0 and v["peak_mib"] > 0, name
        assert 0 <= v["host_bound_share"] < 1 and 0 < v["compute_busy_s"] < v["median_iteration_s"], name
        assert 0 <= v["moved_share"] <= 1.01 and v["physical_bound"] == link["physical_bound"], name
        assert v["device_ops"] > 0, name
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


@pytest.mark.slow  # (out of the quick tier: two runs, 30 s loaded)
def test_fixed_host_cost_runs_repeat_exactly(tmp_path, capsys):
    """Two runs with the fixed host cost report the same figures, to the last bit (besides the date, the machine
    and wall times): a regression here is a nondeterminism, e.g. a lifetime that follows malloc's addresses (the
    save_on_cpu emulation's peak did, until its copies stopped being held by storage address)."""
    argv = ["--small", "--rounds", "2", "--policy-trials", "1"]
    first = bench_executor.main([*argv, "--json", str(tmp_path / "a.json")])
    second = bench_executor.main([*argv, "--json", str(tmp_path / "b.json")])
    capsys.readouterr()
    assert same_figures.differences(json.loads(json.dumps(first)), json.loads(json.dumps(second))) == []
    assert same_figures.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "agree exactly" in capsys.readouterr().out


def test_host_op_s_option():
    assert host_op_s_value("2e-5") == 2e-5 and host_op_s_value("0") == 0.0
    assert host_op_s_value("measured") is None and host_op_s_value("None") is None
    assert bench_executor.parse_args([]).host_op_s == DEFAULT_HOST_OP_S
    assert bench_executor.parse_args(["--host-op-s", "measured"]).host_op_s is None
    with pytest.raises(SystemExit):
        bench_executor.parse_args(["--host-op-s", "-1"])


def test_same_figures_reports_a_difference():
    a = {"date": "x", "wall_s": 1.0, "variants": {"c": {"ratio": 1.25, "rounds": {"wall_s": 3}}}, "machine": {}}
    b = {"date": "y", "wall_s": 2.0, "variants": {"c": {"ratio": 1.5, "rounds": {"wall_s": 4}}}, "machine": {"x": 1}}
    assert same_figures.differences(a, b) == ["variants/c/ratio: 1.25 != 1.5"]
    assert same_figures.differences(a, a) == []
