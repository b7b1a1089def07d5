"""Test of the profiler-overhead benchmark (launch/bench/bench_profiler.py) in its CPU dry mode.

That it runs and reports both ratios, and that the report is consistent with itself: each ratio is the one
its raw rounds give, its 90% interval is the bootstrap of those rounds, and its verdict is the one that the
ratio and the interval call for against the goal. The figures themselves are measured, never compared with
thresholds."""

import gc
import json
import math
import statistics

import pytest
import torch

from launch.bench import bench_profiler

GOAL = 1.01


@pytest.mark.parametrize("value,interval,expected", [
    (1.005, (1.001, 1.009), "MET"),  # the whole interval is within the goal
    (1.005, (1.001, 1.01), "MET"),  # (an upper bound on the goal is within it)
    (1.02, (1.011, 1.03), "NOT MET"),  # the whole interval is above it
    (1.005, (1.0, 1.02), "MET (within noise)"),  # the goal is inside the interval: the ratio decides
    (1.015, (1.0, 1.02), "NOT MET (within noise)"),
    (1.01, (1.01, 1.02), "MET (within noise)"),  # a lower bound on the goal is not clear of it
])
def test_verdict_reads_the_interval_against_the_goal(value, interval, expected):
    assert bench_profiler.verdict(value, interval, GOAL) == expected


@pytest.mark.slow  # (out of the quick tier: 3.5 s loaded; the verdict cases stay quick)
def test_quick_mode_prints_and_returns_both_ratios(tmp_path, capsys):
    out_path = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    results = bench_profiler.main(["--quick", "--json", str(out_path)])
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == threads and gc.get_freeze_count() == 0, "the test process is left as it was"

    for key in ("signature_ratio", "detailed_ratio"):
        assert isinstance(results[key], float) and not math.isnan(results[key]), key
        low, high = results[f"{key}_90ci"]
        assert low <= high
    assert "(a) signature: iteration with / without = " in printed
    assert "(b) detailed: added time TraceRecorder / torch.profiler = " in printed
    for variant in ("plain", "signature", "recorder", "torch.profiler"):
        assert variant in results["gpt_iteration"] and variant in printed
    assert results["model"]["ops_per_iteration"] > 0 and results["model"]["recorded_ops"] > 0
    assert results["model"]["saved_tensors_noted"] > 0, "the saved-tensor notifications are on by default"
    assert set(results["per_op_us"]["loop"]) == set(results["per_op_us"]["mix"]) >= {"signature", "recorder", "torch.profiler"}

    written = json.loads(out_path.read_text())
    assert written["signature_ratio"] == results["signature_ratio"]
    assert written["detailed_ratio"] == results["detailed_ratio"]
    assert written["goals"] == {"signature_ratio": 1.01, "detailed_ratio": 0.15}

    # the ratios are those of the raw rounds: added time = median over rounds of (variant - plain, same round)
    raw = results["gpt_iteration_raw_s"]
    assert set(raw) == set(bench_profiler.VARIANTS)
    assert all(len(times) == results["config"]["rounds"] for times in raw.values())

    def added(variant: str) -> float:
        return statistics.median(t - p for t, p in zip(raw[variant], raw["plain"]))

    signature = 1 + added("signature") / statistics.median(raw["plain"])
    detailed = added("recorder") / added("torch.profiler") if added("torch.profiler") > 0 else math.inf
    assert results["signature_ratio"] == pytest.approx(signature, rel=1e-12)
    assert results["gpt_iteration"]["signature"]["ratio"] == results["signature_ratio"]
    assert results["detailed_ratio"] == pytest.approx(detailed, rel=1e-12)

    # each interval is the bootstrap of the same rounds, and each verdict follows from ratio, interval and goal
    statistics_of = {"signature_ratio": bench_profiler._signature_ratio, "detailed_ratio": bench_profiler._detailed_ratio}
    for key, statistic in statistics_of.items():
        interval, verdict, goal = results[f"{key}_90ci"], results[f"{key}_verdict"], results["goals"][key]
        assert tuple(interval) == pytest.approx(bench_profiler.bootstrap(raw, statistic), rel=1e-12), key
        assert verdict == bench_profiler.verdict(results[key], interval, goal), key
        assert written[f"{key}_verdict"] == verdict and written[f"{key}_90ci"] == list(interval), key
        assert f"(goal <= {goal}): {verdict};" in printed, key
