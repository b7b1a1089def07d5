"""Smoke test of the sweep benchmark (launch/bench/bench_sweep.py) on its tiny configuration, and of the pieces it
shares with launch/bench/bench_executor.py (shapes, FLOP count, balanced orders).

Only structure, bit-identity and the printed table: the timings themselves are measured, never asserted against
thresholds."""

import gc
import itertools
import json

import torch

from chameleon_dist.device.presets import get_preset
from launch.bench import bench_executor, bench_sweep
from launch.models.toy_gpt import GPT, forward_matmul_flop


def test_small_sweep_reports_every_cell_and_target(tmp_path, capsys):
    threads, frozen = torch.get_num_threads(), gc.get_freeze_count()
    out_path = tmp_path / "sweep.json"
    results = bench_sweep.main(["--small", "--json", str(out_path)])
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == threads and gc.get_freeze_count() == frozen, "the test process is left as it was"

    assert json.loads(out_path.read_text()) == json.loads(json.dumps(results))
    assert "-m launch.bench.bench_sweep --small" in results["command"] and results["emulated"]
    for key in ("model", "reference_llm", "links", "save_on_cpu", "cells", "rows", "targets"):
        assert key in results, key

    model = results["model"]
    assert model["forward_flop_per_saved_byte"] > 0 and model["saved_activation_bytes"] > 0
    assert model["iteration_matmul_flop"] == 3 * model["forward_matmul_flop"]
    assert set(results["links"]) == {"h100-pcie"}
    link = results["links"]["h100-pcie"]
    assert link["emulated"] and 0 < link["link_share_in_forward"] < link["link_share_in_iteration"]
    assert link["d2h_bytes_per_s"] == get_preset("h100-pcie").d2h_bytes_per_s, "the real link rate, not scaled"
    assert link["physical_bound"] == min(1.0, link["link_share_in_forward"])

    cells = results["cells"]
    assert [(c["link"], c["hide_share"]) for c in cells] == [("h100-pcie", 0.5), ("h100-pcie", 2.0)]
    for cell in cells:
        assert "error" not in cell, cell.get("traceback")
        assert cell["emulated"] and 0 < cell["capacity_bytes"] < model["unswapped_peak_bytes"], "swapping is needed"
        assert set(cell["variants"]) == set(bench_sweep.CELL_VARIANTS)
        for name, v in cell["variants"].items():
            assert v["bit_identical"] and v["losses_equal"] == v["losses_compared"] > 0, (cell["hide_share"], name)
            assert len(v["iteration_s"]) == cell["rounds"]["timed"] == 2
        assert cell["variants"]["baseline"]["losses_compared"] < cell["variants"]["unconstrained"]["losses_compared"], \
            "the baseline joined after the untimed rounds"
        for name in bench_sweep.CHAMELEON_VARIANTS:
            v = cell["variants"][name]
            assert (v["policy"] is None) == (v["predicted_ratio"] is None), (cell["hide_share"], name, v["policy"])
            assert v["policy"] is None or v["predicted_ratio"] > 0 and v["policy"]["compute_s"] > 0
            assert v["fallback_iterations"] >= v["fallback_iterations_timed"] >= 0
    assert results["save_on_cpu"]["h100-pcie"]["variants"]["save_on_cpu"]["bit_identical"]

    rows = results["rows"]
    assert len(rows) == 2 * len(bench_sweep.ROW_VARIANTS)
    for row in rows:
        assert row["emulated"] and "error" not in row and row["bit_identical"], row
        assert row["ratio"] > 0 and row["stall_share"] >= 0 and 0 <= row["moved_share"] <= 1.01, row
        assert 0 <= row["host_bound_share"] < 1 and row["physical_bound"] == link["physical_bound"], row
        assert row["variant"] in bench_sweep.CHAMELEON_VARIANTS or row["predicted_ratio"] is None, row
    assert all(r["moved_share"] > 0.9 for r in rows if r["variant"] in ("baseline", "save_on_cpu")), "they move everything"

    targets = results["targets"]
    assert targets["emulated"] and targets["cells"] == 2
    for key in ("ratio_at_most_1.05_up_to_share_1", "never_slower_than_baseline", "within_10pct_of_prediction",
                "no_fallback_to_swap_everything", "all_bit_identical"):
        assert isinstance(targets[key]["met"], bool) and targets[key]["met"] == (not targets[key]["misses"]), key
    assert targets["all_bit_identical"]["met"]

    assert "ALL FIGURES EMULATED" in printed and "(emulated)" in printed
    assert "compute per saved-activation byte" in printed and "issue 13 targets (emulated):" in printed
    table = [line for line in printed.splitlines() if line.startswith("h100-pcie")]
    assert len(table) == len(rows)
    for label in bench_sweep.LABELS.values():
        assert sum(label in line for line in table) == 2, label


def test_balanced_orders_put_each_variant_right_before_each_other_equally_often():
    assert bench_sweep.balanced_orders(4) == [tuple(r) for r in bench_executor.WILLIAMS_4]
    for n in (2, 3, 4, 5):
        orders = bench_sweep.balanced_orders(n)
        assert all(sorted(order) == list(range(n)) for order in orders)
        follows = [pair for order in orders for pair in zip(order, order[1:])]
        counts = {pair: follows.count(pair) for pair in itertools.permutations(range(n), 2)}
        assert len(set(counts.values())) == 1, (n, counts)


def test_shapes_keep_bench_executor_defaults_and_take_overrides():
    default = bench_executor.parse_args([])
    assert (default.shape, default.layers, default.hidden, default.heads, default.seq, default.batch, default.vocab) == \
        ("executor", 4, 1024, 8, 32, 1, 512)
    wide = bench_executor.parse_args(["--shape", "llm-like", "--layers", "3"])  # an override wins
    assert (wide.layers, wide.hidden, wide.heads, wide.seq) == (3, *[bench_executor.SHAPES["llm-like"][k] for k in
                                                                     ("hidden", "heads", "seq")])
    assert bench_sweep.parse_args([]).shape == "llm-like"
    small = bench_sweep.parse_args(["--small"])
    assert (small.hidden, small.links, small.shares) == (64, ["h100-pcie"], [0.5, 2.0])


def test_forward_matmul_flop_matches_the_model():
    vocab, hidden, heads, layers, seq, batch = 32, 16, 2, 2, 8, 3
    model = GPT(vocab, hidden, heads, layers)
    linear = sum(2 * m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = layers * 2 * 2 * seq * hidden  # per token: QK^T and attention x V
    assert forward_matmul_flop(vocab, hidden, layers, seq, batch) == batch * seq * (linear + attention)
