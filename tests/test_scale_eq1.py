"""``launch/experiments/scale_eq1.py``: per-op device times line up with a trace's ops, Eq. 1's and the calibrated
estimate's errors against them, the policy comparison, and the CLI's JSON (2-layer Llamas on meta tensors)."""

from __future__ import annotations

import json

import pytest
import torch

from chameleon_dist.models.llama import LlamaShape, SwiGLU, build_llama
from chameleon_dist.policy import PolicySettings
from launch.experiments import scale_eq1

SHAPE = LlamaShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=1,
                   ffn_hidden_size=128, vocab_size=256)


def _profile(config: dict, host_op_s: float = 1e-5, wide_layer: int | None = None):
    """Profile one iteration; also every op name the backend ran, with whether it was kept as a trace op."""
    model = build_llama(SHAPE)
    if wide_layer is not None:  # a heterogeneous model: one layer's MLP far wider than the other's
        with torch.device("meta"):
            model.layers[wide_layer].mlp = SwiGLU(SHAPE.model_copy(update={"ffn_hidden_size": 2**18}))
        model.to(SHAPE.torch_dtype)
    runtime, step = scale_eq1.llama_runtime(SHAPE, "h100-pcie", host_op_s, config, model=model)
    backend = runtime.device.backend
    names: list[str] = []
    observers = []
    run_op = backend.run_op

    def spy(func, args, kwargs):  # the name of each op the observer hears
        observers.append(backend.op_times_s)
        before = len(backend.op_times_s)
        out = run_op(func, args, kwargs)
        names.extend([str(func)] * (len(backend.op_times_s) - before))
        return out

    backend.run_op = spy
    trace, times = scale_eq1.profile_iteration(runtime, step)
    assert len({id(o) for o in observers}) == 1
    kept = [name for name, recorded in zip(names, observers[0].recorded) if recorded]
    return trace, times, names, kept, runtime


@pytest.mark.parametrize("min_swap_bytes", [scale_eq1.NEVER_SWAP_BYTES, 1024], ids=["no-swap", "swap-everything"])
def test_op_times_line_up_with_the_trace_ops(min_swap_bytes):
    """One time per trace op, and the op the backend ran there is the trace's op, in order: with nothing
    swapped, and with the WarmUp executor swapping every saved tensor (whose own ops reach the backend but
    not the trace)."""
    trace, times, names, kept, runtime = _profile({"min_swap_bytes": min_swap_bytes})
    assert (runtime.last_report.swap_out_bytes > 0) == (min_swap_bytes == 1024)
    assert len(names) > len(trace.ops), "the saved-tensor hooks' own ops reach the backend too"
    assert kept == [trace.op_names[op.name_id] for op in trace.ops]
    assert len(times) == len(trace.ops) and all(t >= 0 for t in times) and sum(times) > 0


def test_a_runtime_past_warmup_is_refused():
    runtime, step = scale_eq1.llama_runtime(SHAPE, "h100-pcie", 1e-5, {"profiler": {"warmup_iterations": 1}})
    scale_eq1.profile_iteration(runtime, step)
    with pytest.raises(ValueError, match="not one profiled attempt"):
        scale_eq1.profile_iteration(runtime, step)


def test_eq1_rows_one_group_is_exact_and_errors_are_not_negative():
    trace, times, *_ = _profile({"min_swap_bytes": scale_eq1.NEVER_SWAP_BYTES})
    rows = scale_eq1.eq1_rows(trace, times)
    assert [r["groups"] for r in rows[:-1]] == [1, 2, 4, 8]  # 1, L/2, L, 2L, 4L for L = 2 (deduplicated)
    assert rows[-1]["cut"].startswith("logical layers")
    one = rows[0]
    assert one["cv"] == 0.0
    for key in ("eq1_mean_error", "eq1_max_error", "calibrated_mean_error", "calibrated_max_error"):
        assert one[key] == pytest.approx(0.0, abs=1e-9)
    for row in rows:
        assert row["cv"] >= 0 and row["eq1_max_error"] >= row["eq1_mean_error"] >= 0
        assert row["calibrated_max_error"] >= row["calibrated_mean_error"] >= 0
    with pytest.raises(ValueError):
        scale_eq1.eq1_rows(trace, times[:-1])


def test_calibration_does_not_make_the_layer_level_error_worse_on_a_heterogeneous_model():
    """Layer 1's MLP is 2048x wider than layer 0's: the same op count, over twice the time, which Eq. 1 cannot see
    and the measured layer times can (a device-bound host, so the device clock's layer times are kernels)."""
    trace, times, *_ = _profile({"min_swap_bytes": scale_eq1.NEVER_SWAP_BYTES}, host_op_s=1e-9, wide_layer=1)
    assert trace.layer_times_s[1] > 2 * trace.layer_times_s[0]
    rows = {(r["cut"].split(" (")[0], r["groups"]): r for r in scale_eq1.eq1_rows(trace, times)}
    for key in (("even", 2), ("logical layers", next(g for c, g in rows if c == "logical layers"))):
        row = rows[key]
        assert row["calibrated_mean_error"] <= row["eq1_mean_error"], row
    layers = rows[("even", 2)]
    assert layers["cv"] > 0.3 and layers["eq1_mean_error"] > 0.3  # (Eq. 1 is far off here)


def test_policy_stalls_report_each_policy_and_the_true_times_policy_is_its_own_prediction():
    trace, times, *_ = _profile({"min_swap_bytes": scale_eq1.NEVER_SWAP_BYTES}, host_op_s=1e-9, wide_layer=1)
    peak = max(trace.no_swap_memory_curve())
    settings = PolicySettings(budget_bytes=int(0.9 * peak), d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9,
                              min_swap_bytes=1024)
    out = scale_eq1.policy_stalls(trace, times, settings)
    assert list(out) == ["eq1", "calibrated", "true op times"]
    for p in out.values():
        assert p["predicted_stall_s"] >= 0 and p["true_stall_s"] >= 0 and p["swapped_bytes"] + p["recomputed_bytes"] > 0
    truth = out["true op times"]
    assert truth["true_stall_s"] == pytest.approx(truth["predicted_stall_s"])


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "eq1.json"
    result = scale_eq1.main(["--layers", "2", "--seq-length", "64", "--json", str(path)])
    out = capsys.readouterr().out
    assert "| cut | groups |" in out and "| op times from |" in out
    data = json.loads(path.read_text())
    assert data["layers"] == 2 and len(data["rows"]) == 5 and data["ops"] == result["ops"]
    assert set(data["policies"]) == {"eq1", "calibrated", "true op times"}
    assert all(p["measured"] is not None and p["measured"]["stall_s"] >= 0 for p in data["policies"].values())
