"""launch/bench/bench_gpu.py: its ``--dry-run`` runs the GPU benchmark's code path on the CPU (emulated devices,
tiny shape). Checked: the JSON's structure, bit-identity of every variant with the no-swap run, Chameleon's
peaks below the no-swap peak, the time box, and the automatic shape for a GPU's memory. No timing
thresholds: dry-run times mean nothing."""

from __future__ import annotations

import argparse
import json

import torch

from launch.bench import bench_gpu

VARIANT_KEYS = {"median_iteration_s", "ratio", "median_stall_s", "swap_out_bytes", "peak_bytes", "peak_above_start_bytes",
                "bit_identical", "losses_equal", "losses_compared", "parameters_equal", "parameters_compared",
                "max_parameter_difference", "iteration_s"}


def test_dry_run_writes_every_variant_bit_identical_to_no_swap(tmp_path, capsys):
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    path = tmp_path / "bench_gpu.json"
    bench_gpu.main(["--dry-run", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["emulated"] is True and data["gpu"] is None
    assert data["determinism"] == {"mode": "strict", "requested": "strict", "fallback_reason": ""}
    assert torch.are_deterministic_algorithms_enabled() == deterministic_before, "the process's settings are restored"
    rounds = data["rounds"]
    assert rounds["timed"] == 3 and not rounds["stopped_early"]
    assert rounds["stages_when_timing_began"] == {"chameleon_swap": "stable", "chameleon_recompute": "stable"}
    variants = data["variants"]
    assert list(variants) == list(bench_gpu.VARIANTS)
    for name, v in variants.items():
        assert VARIANT_KEYS <= set(v), name
        assert len(v["iteration_s"]) == 3
        assert v["bit_identical"], f"{name}: losses {v['losses_equal']}/{v['losses_compared']}, parameters " \
                                   f"{v['parameters_equal']}/{v['parameters_compared']}"
        assert v["losses_compared"] == rounds["warmup"] + rounds["timed"]
    assert variants["no_swap"]["ratio"] == 1.0
    assert variants["save_on_cpu"]["swap_out_bytes"] > 0 and variants["checkpoint"]["swap_out_bytes"] == 0
    capacity = data["setup"]["capacity_bytes"]
    for name in bench_gpu.CHAMELEON:
        v = variants[name]
        assert v["capacity_bytes"] == capacity and v["iterations_over_capacity"] == 0
        assert v["policy"] is not None and len(v["rounds"]) == v["losses_compared"]
        assert data["checks"][f"{name}_peak_below_no_swap"]
    assert capacity < variants["no_swap"]["peak_bytes"]
    printed = capsys.readouterr().out
    assert all(name in printed for name in bench_gpu.VARIANTS) and "bit-identical" in printed


def test_time_box_stops_rounds_and_still_reports(tmp_path, capsys):
    path = tmp_path / "bench_gpu.json"
    bench_gpu.main(["--dry-run", "--max-minutes", "0.0001", "--json", str(path)])
    data = json.loads(path.read_text())
    rounds = data["rounds"]
    assert rounds["stopped_early"] and "--max-minutes" in rounds["stop_reason"]
    assert rounds["warmup"] == 1 and rounds["timed"] == 0
    assert data["variants"]["chameleon_swap"]["ratio"] is None
    assert all(v["bit_identical"] for v in data["variants"].values())
    assert "STOPPED EARLY" in capsys.readouterr().out


def test_automatic_shape_follows_the_gpus_memory():
    args = argparse.Namespace(layers=None, hidden=None, heads=None, seq=None, batch=None, vocab=32000, max_layers=8)
    big, _ = bench_gpu.auto_shape(141 * 2**30, args, element_bytes=2)  # an H200
    assert (big.hidden, big.seq, big.layers, big.batch) == (4096, 4096, 8, 2)
    small, _ = bench_gpu.auto_shape(24 * 2**30, args, element_bytes=2)
    assert small.estimate_bytes(len(bench_gpu.VARIANTS)) <= bench_gpu.AUTO_MEMORY_SHARE * 24 * 2**30
    assert (small.hidden, small.seq, small.layers) < (big.hidden, big.seq, big.layers)
