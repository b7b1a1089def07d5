"""``launch/experiments/bench_scale.py --quick`` (issue 28): the script runs every variant end to end on a 2-layer Megatron-core
Llama on meta tensors, writes the JSON contract, the table and the plot, and its targets' arithmetic follows from
its own rows. The figures themselves are not checked here (they are BENCHMARKS.md's)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from launch.experiments import bench_scale  # noqa: E402
from launch.experiments.scale_runs import VARIANTS  # noqa: E402

ROW_KEYS = {"model", "preset", "budget", "variant", "fits", "ratio", "peak_bytes", "stall_s", "moved_share",
            "bound_share"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    argv = ["--quick", "--find-limit", "--json", str(out / "scale.json"), "--markdown", str(out / "scale.md"),
            "--png", str(out / "scale.png")]
    assert bench_scale.main(argv) == 0
    return json.loads((out / "scale.json").read_text()), out


@pytest.mark.slow  # (out of the quick tier: reads the module's quick run, 29 s loaded; the bad-input cases stay quick)
def test_quick_run_writes_the_json_contract(quick):
    result, out = quick
    assert result["simulated"] is True
    rows = result["rows"]
    assert rows and all(ROW_KEYS <= set(row) for row in rows)
    assert {row["variant"] for row in rows} <= set(VARIANTS)
    assert {"reference", "chameleon-swap", "chameleon-swap-recompute", "megatron-selective",
            "megatron-full"} <= {row["variant"] for row in rows}
    assert {row["budget"] for row in rows} == set(bench_scale.QUICK["budgets"])
    assert set(result["limit"]) >= {"budget_bytes", "saved_bytes", "bound_saved_bytes", "ratio"}
    assert (out / "scale.md").read_text().startswith("### ")
    assert (out / "scale.png").stat().st_size > 1000


@pytest.mark.slow  # (out of the quick tier: reads the module's quick run, 29 s loaded; the bad-input cases stay quick)
def test_quick_rows_follow_from_their_runs(quick):
    result, _ = quick
    reference = result["reference"]
    for row in result["rows"]:
        assert row["figure_lag"] == 0, row  # each figure is its own iteration's (the host waits once per step)
        assert 0 < row["bound_share"] <= 1
        assert 0 <= row["moved_share"] <= 1
        if row["fits"]:
            assert row["peak_bytes"] <= row["budget_bytes"]
            assert row["ratio"] == pytest.approx(row["iteration_s"] / reference["iteration_s"])
        if row["variant"].startswith("chameleon-") and row["fits"]:
            assert row["settled"] == row["stages"].endswith("SS"), row
        if row["variant"] == "reference":
            assert row["ratio"] == 1.0 and row["moved_share"] == 0.0
            assert row["fits"] == (reference["peak_bytes"] <= row["budget_bytes"])
        if row["variant"].startswith("chameleon-") and row["fits"]:
            assert row["share_over_bound"] == pytest.approx(row["moved_share"] / row["bound_share"])


@pytest.mark.slow  # (out of the quick tier: reads the module's quick run, 29 s loaded; the bad-input cases stay quick)
def test_quick_targets_are_the_rows_arithmetic(quick):
    result, _ = quick
    limit = result["limit"]
    assert limit["saved_bytes"] == result["reference"]["peak_bytes"] - limit["budget_bytes"]
    assert limit["ratio"] == pytest.approx(limit["saved_bytes"] / limit["bound_saved_bytes"])
    assert limit["bound_saved_bytes"] == result["bound"]["movable_bytes_per_micro_batch"] > 0
    assert limit["bound_saved_bytes"] * result["micro_batches"] >= result["bound"]["movable_bytes"] - result["micro_batches"]
    by = {(r["budget"], r["variant"]): r for r in result["rows"]}
    for entry in result["targets"]["per_budget"]:
        ours, full = by.get((entry["budget"], "chameleon-swap-recompute")), by.get((entry["budget"], "megatron-full"))
        if "speedup_over_full" in entry:
            assert entry["speedup_over_full"] == pytest.approx(full["iteration_s"] / ours["iteration_s"] - 1)
        if "no_slower_than_megatron" in entry:
            fastest = by[(entry["budget"], entry["fastest_megatron"])]
            assert entry["no_slower_than_megatron"] == (ours["iteration_s"] <= fastest["iteration_s"])


@pytest.mark.slow  # (out of the quick tier: reads the module's quick run, 29 s loaded; the bad-input cases stay quick)
def test_quick_rows_carry_the_planners_prediction_and_its_error(quick):
    result, _ = quick
    predicted = [row for row in result["rows"] if row.get("predicted") and row["iteration_s"]]
    assert predicted, "no completed row has the planner's prediction"
    for row in predicted:
        p = row["predicted"]
        assert p["iteration_s"] > 0 and p["peak_bytes"] > 0
        assert p["time_error"] == pytest.approx(p["iteration_s"] / row["iteration_s"] - 1)


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama9-1t"], "--model 'llama9-1t' does not exist"),
    (["--preset", "h900"], "unknown device.preset"),
    (["--budgets", "0.9,1.5"], "must be in (0, 1]"),
    (["--budgets", "0"], "must be in (0, 1]"),
    (["--budgets", "half"], "fractions of the unswapped peak"),
    (["--variants", "chameleon-magic"], "--variants"),
    (["--micro-batches", "0"], "--micro-batches 0"),
    (["--model", "llama2-70b-stage", "--layers", "80", "--preset", "a100-pcie"], "exceed a100-pcie"),
])
def test_bad_input_is_a_clear_message_and_a_nonzero_exit(argv, message, capsys):
    assert bench_scale.main(argv) == 2
    assert message in capsys.readouterr().err
