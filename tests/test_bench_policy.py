"""Smoke test of the policy generator benchmark (launch/bench/bench_policy.py) on its tiny configuration.

Only that it runs and reports both results with sane values: the figures themselves are measured, never
asserted against thresholds."""

import gc
import json

from chameleon_dist.schema_version import SCHEMA_VERSION
from launch.bench import bench_policy


def test_small_run_reports_eq1_errors_and_generation_time(tmp_path, capsys):
    out_path = tmp_path / "bench.json"
    results = bench_policy.main(["--small", "--json", str(out_path)])
    printed = capsys.readouterr().out
    assert gc.isenabled(), "the test process is left as it was"

    assert json.loads(out_path.read_text()) == json.loads(json.dumps(results))
    assert "-m launch.bench.bench_policy --small" in results["command"] and results["date"]
    assert list(results)[0] == "schema_version" and results["schema_version"] == SCHEMA_VERSION
    assert "emulated/CPU" in printed and "(1) Eq. 1" in printed and "(2) generate_policies" in printed

    models = results["eq1"]["models"]
    assert set(models) == {"dense", "moe"}
    for kind, m in models.items():
        assert m["layers"] == 2 and m["label_rule"] == "module", kind
        assert m["measured_cv"] >= 0 and m["iteration_s"] > 0
        for key in ("eq1_mean_error", "eq1_max_error", "eq1_layer_ops_mean_error", "eq1_layer_ops_max_error",
                    "calibrated_max_error"):
            assert m[key] >= 0, (kind, key)
        assert m["eq1_max_error"] >= m["eq1_mean_error"]
        assert len(m["layer_times_ms"]) == 2 and all(t > 0 for t in m["layer_times_ms"])
    assert models["dense"]["expert_token_counts"] == []
    counts = models["moe"]["expert_token_counts"]
    assert len(counts) == 1 and sum(counts[0]) == 2 * 32 * 2, "every token goes to top_k=2 experts"
    assert models["moe"]["layer_forward_ops"][1] > models["moe"]["layer_forward_ops"][0], "the MoE layer has more ops"

    g = results["generation"]
    assert g["trace"]["ops"] > 0 and g["trace"]["candidates"] > 0 and g["trace"]["wall_s"] > 0
    assert g["iteration_estimate"]["iteration_s"] > 0
    assert len(g["budgets"]) == 2
    for row in g["budgets"]:
        assert row["seconds_per_policy"] > 0 and 1 <= row["policies"] <= 5 and row["deterministic"]
        best = row["best"]
        assert best["predicted_peak_bytes"] <= g["trace"]["no_swap_peak_bytes"]
        assert best["predicted_stall_s"] >= 0 and best["swapped_bytes"] >= 0
        assert isinstance(best["feasible"], bool)
