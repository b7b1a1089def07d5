"""Smoke test of the profiler-overhead benchmark (launch/bench_profiler.py) in its CPU dry mode.

Only that it runs and reports both ratios: the figures themselves are measured, never asserted."""

import gc
import importlib.util
import json
import math
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "bench_profiler.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_profiler", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_mode_prints_and_returns_both_ratios(tmp_path, capsys):
    out_path = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    results = _load_script().main(["--quick", "--json", str(out_path)])
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == threads and gc.get_freeze_count() == 0, "the test process is left as it was"

    for key in ("signature_ratio", "detailed_ratio"):
        assert isinstance(results[key], float) and not math.isnan(results[key]), key
        low, high = results[f"{key}_90ci"]
        assert low <= high and "MET" in results[f"{key}_verdict"]
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
