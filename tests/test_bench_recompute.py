"""Smoke test of launch/bench_recompute.py on its tiny configuration: every variant reports, and every one
trains bit-identically to the unconstrained run. Timings are measured, never asserted."""

import torch

from launch import bench_recompute


def test_small_run_reports_every_variant_bit_identically(tmp_path, capsys):
    threads = torch.get_num_threads()
    results = bench_recompute.main(["--small", "--json", str(tmp_path / "r.json")])
    assert torch.get_num_threads() == threads
    variants = results["variants"]
    assert set(variants) == set(bench_recompute.VARIANTS)
    assert all(v["bit_identical"] for v in variants.values()), {k: v["bit_identical"] for k, v in variants.items()}
    assert results["capacity_mib"] < results["unswapped_peak_mib"]
    assert variants["swap_only"]["recomputed_mib"] == 0
    assert variants["layer_recompute"]["peak_mib"] < variants["unconstrained"]["peak_mib"]
    assert (tmp_path / "r.json").exists() and "swap_recompute" in capsys.readouterr().out
