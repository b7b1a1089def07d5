"""Smoke test of launch/bench/bench_recompute.py on its tiny configuration: every variant reports, and every one
trains bit-identically to the unconstrained run. Timings are measured, never asserted."""

import pytest
import torch

from chameleon_dist.device.presets import get_preset
from launch.bench import bench_recompute


@pytest.mark.slow  # (out of the quick tier: 23 s loaded; the mid-size inputs test stays quick)
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
    # the preset at its real link rate (no scaling to this CPU); every figure on the device clock
    assert results["device"]["emulated"] and results["link"]["d2h_bytes_per_s"] == get_preset("h100-pcie").d2h_bytes_per_s
    assert 0 < results["link"]["physical_bound"] <= 1 and results["link"]["forward_device_s"] > 0
    for name, v in variants.items():
        assert 0 <= v["host_bound_share"] < 1 and 0 <= v["moved_share"] <= 1.01 and v["device_ops"] > 0, name


def test_recompute_inputs_are_the_tensors_they_were_at_a_mid_size_shape(tmp_path):
    """At hidden 256 a storage address freed by a swapped input gets reused by another storage within an
    iteration: a recipe input found by address alone rebuilt a tensor from the wrong bytes (wrong losses).
    Inputs are found through what held their storage, checked against the storage itself."""
    results = bench_recompute.main(["--layers", "3", "--hidden", "256", "--seq", "128", "--batch", "2",
                                    "--vocab", "256", "--warmup-rounds", "8", "--rounds", "2", "--variants", "swap_recompute",
                                    "--json", str(tmp_path / "r.json")])
    assert set(results["variants"]) == {"unconstrained", "swap_recompute"}
    recompute = results["variants"]["swap_recompute"]
    assert recompute["recomputed_mib"] > 0 or recompute["policies"], recompute
    assert all(v["bit_identical"] for v in results["variants"].values()), \
        {k: v["bit_identical"] for k, v in results["variants"].items()}
