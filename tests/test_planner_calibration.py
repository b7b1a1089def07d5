"""Calibration files (issue 29, item 6): the format's validation, what applying one changes in the planner's cost
model, ``chameleon-plan --calibration``'s report and exit codes, and the simulated producer on a tiny model."""

from __future__ import annotations

import json

import pytest

from chameleon_dist.cli import plan
from chameleon_dist.config import ConfigError
from chameleon_dist.planner.calibration import apply_calibration, calibration_from_mapping, load_calibration
from chameleon_dist.planner.layout import Layout, RecomputeMode
from chameleon_dist.planner.profiles import load_hardware, load_model, make_setup
from chameleon_dist.planner.search import evaluate, search
from chameleon_dist.planner.single_device import predict_single_device
from chameleon_dist.planner.timing import layer_flops, layer_times, optimizer_s, stage_timing

SHAPE = {"model": "llama2-7b", "seq_length": 4096, "micro_batch": 1, "tp": 1}
TIMES = {"layer_forward_s": 0.01, "layer_backward_s": 0.0225, "head_forward_s": 0.006, "head_backward_s": 0.01}


def _file(**changes) -> dict:
    data = {"format": 1, "source": "simulated: h100-pcie", "shape": dict(SHAPE), **TIMES}
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}


def _problems(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        calibration_from_mapping(data, source="cal.json")
    return str(caught.value)


# ---- the format -------------------------------------------------------------------------------------------
def test_json_and_yaml_files_load_with_rate_strings(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(_file(d2h_bytes_per_s="20GB/s")))
    (tmp_path / "c.yaml").write_text("format: 1\nsource: 'measured: H100 SXM'\nh2d_bytes_per_s: 25GB/s\n")
    from_json, from_yaml = load_calibration(tmp_path / "c.json"), load_calibration(tmp_path / "c.yaml")
    assert from_json.d2h_bytes_per_s == 20e9 and from_json.layer_forward_s == 0.01 and from_json.kind == "simulated"
    assert from_yaml.h2d_bytes_per_s == 25e9 and from_yaml.shape is None and from_yaml.kind == "measured"


@pytest.mark.parametrize("data, named", [
    (_file(bogus=1), "bogus: unknown setting"),
    (_file(shape={**SHAPE, "batch": 2}), "shape.batch: unknown setting"),
    (_file(layer_forward_s=-0.1), "layer_forward_s"),
    (_file(layer_backward_s="fast"), "layer_backward_s"),
    (_file(d2h_bytes_per_s="20XB/s"), "d2h_bytes_per_s"),
    (_file(intra_node_bus_bytes_per_s=0), "intra_node_bus_bytes_per_s"),
    (_file(shape={**SHAPE, "seq_length": 0}), "shape.seq_length"),
    (_file(shape={**SHAPE, "model": "llama-7b"}), "shape.model"),
    (_file(source="h100"), "source"),
    (_file(format=2), "format"),
    (_file(format=True), "format"),
    (_file(format=None), "format: missing"),
    (_file(layer_forward_s=None), "layer_backward_s: needs layer_forward_s"),
    (_file(head_forward_s=None), "head_backward_s: needs head_forward_s"),
    (_file(shape=None), "shape: missing"),
])
def test_bad_files_are_config_errors_naming_the_key(data, named):
    message = _problems(data)
    assert message.startswith("cal.json: ") and named in message


def test_a_rate_above_the_peak_says_the_file_is_not_this_hardwares():
    hardware = load_hardware("ascend-910b")
    too_fast = calibration_from_mapping(_file(layer_forward_s=1e-6, layer_backward_s=None, head_forward_s=None,
                                              head_backward_s=None))
    with pytest.raises(ConfigError, match="layer_forward_s: .* above ascend-910b's peak"):
        apply_calibration(hardware, too_fast)
    fast_head = calibration_from_mapping(_file(head_forward_s=1e-6))
    with pytest.raises(ConfigError, match="head_forward_s: .* above ascend-910b's peak"):
        apply_calibration(hardware, fast_head)
    apply_calibration(hardware, calibration_from_mapping(_file()))  # (the file's own times are below the peak)


# ---- applying it ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp, micro_batch, attention", [(1, 1, "flash"), (2, 2, "unfused")])
def test_the_planners_times_at_the_calibration_shape_are_the_files(tp, micro_batch, attention):
    hardware = load_hardware("ascend-910b")
    shape = {**SHAPE, "tp": tp, "micro_batch": micro_batch, "attention": attention}
    calibration = calibration_from_mapping(_file(shape=shape))
    calibrated = apply_calibration(hardware, calibration)
    model = load_model("llama2-7b")
    setup = make_setup(global_batch_size=8, seq_length=4096, attention=attention)
    layout = Layout(tp=tp, micro_batch=micro_batch)
    times = layer_times(model, calibrated, setup, layout)
    assert times.forward_s == pytest.approx(TIMES["layer_forward_s"], rel=1e-12)
    assert times.backward_s == pytest.approx(TIMES["layer_backward_s"], rel=1e-12)
    head = stage_timing(model, calibrated, setup, layout)
    assert head.head_forward_s == pytest.approx(TIMES["head_forward_s"], rel=1e-12)
    assert head.head_backward_s == pytest.approx(TIMES["head_backward_s"], rel=1e-12)
    # the peak stays the profile's (MFU figures keep their meaning): the efficiency carries the measured rate
    assert calibrated.peak_flops_per_s == hardware.peak_flops_per_s and calibrated.efficiency != hardware.efficiency
    plain = layer_times(model, hardware, setup, layout)
    assert plain.backward_s == pytest.approx(2 * plain.forward_s)


def test_a_whole_iteration_at_the_shape_is_the_sum_of_the_files_times():
    calibrated = apply_calibration(load_hardware("ascend-910b"), calibration_from_mapping(_file()))
    predicted = predict_single_device(load_model("llama2-7b"), calibrated, seq_length=4096, micro_batch_size=1,
                                      micro_batches=3, approaches=("none", "full"))
    per_micro_batch = 32 * (TIMES["layer_forward_s"] + TIMES["layer_backward_s"]) + TIMES["head_forward_s"] + \
        TIMES["head_backward_s"]
    assert predicted["none"].time.compute == pytest.approx(3 * per_micro_batch, rel=1e-12)
    assert predicted["full"].time.recompute == pytest.approx(3 * 32 * TIMES["layer_forward_s"], rel=1e-12)


def test_at_other_shapes_the_times_scale_with_flops():
    calibrated = apply_calibration(load_hardware("ascend-910b"), calibration_from_mapping(_file()))
    model = load_model("llama2-13b")
    setup = make_setup(global_batch_size=8, seq_length=2048)
    at_shape = make_setup(global_batch_size=1, seq_length=4096)
    ratio = layer_flops(model, setup, 2).forward_flops / layer_flops(load_model("llama2-7b"), at_shape, 1).forward_flops
    times = layer_times(model, calibrated, setup, Layout(micro_batch=2))
    assert times.forward_s == pytest.approx(TIMES["layer_forward_s"] * ratio, rel=1e-12)
    assert times.backward_s == pytest.approx(TIMES["layer_backward_s"] * ratio, rel=1e-12)


def test_rates_are_replaced_and_missing_keys_keep_the_profiles():
    hardware = load_hardware("ascend-910b")
    rates = calibration_from_mapping({"format": 1, "source": "measured: 910B", "h2d_bytes_per_s": 10e9,
                                      "inter_node_bus_bytes_per_s": "5GB/s"})
    calibrated = apply_calibration(hardware, rates)
    assert calibrated.h2d_bytes_per_s == 10e9 and calibrated.inter_node_bus_bytes_per_s == 5e9
    for key in ("d2h_bytes_per_s", "intra_node_bus_bytes_per_s", "efficiency", "backward_to_forward",
                "head_flops_per_s", "memory_bytes_per_s", "memory_bytes"):
        assert getattr(calibrated, key) == getattr(hardware, key), key
    # a calibrated input is no longer assumed: --sensitivity sweeps only what is still assumed
    assert "inter_node_bus_bytes_per_s" in hardware.assumed and "inter_node_bus_bytes_per_s" not in calibrated.assumed
    assert calibrated.assumed == {k: v for k, v in hardware.assumed.items() if k != "inter_node_bus_bytes_per_s"}


def test_a_measured_h2d_keeps_the_profiles_duplex_slowdown():
    from chameleon_dist.planner.profiles import HardwareProfile

    hardware = HardwareProfile.model_validate({**load_hardware("ascend-910b").model_dump(),
                                               "h2d_bytes_per_s": 20e9, "h2d_concurrent_bytes_per_s": 15e9})
    calibrated = apply_calibration(hardware, calibration_from_mapping(
        {"format": 1, "source": "measured: x", "h2d_bytes_per_s": 40e9}))
    assert calibrated.h2d_concurrent_bytes_per_s == pytest.approx(30e9)


def test_the_optimizer_step_sets_the_memory_rate():
    data = _file(optimizer_step_s=0.25, shape={**SHAPE, "num_layers": 4, "tp": 2})
    calibrated = apply_calibration(load_hardware("ascend-910b"), calibration_from_mapping(data))
    model = load_model("llama2-7b").model_copy(update={"num_layers": 4})
    step = optimizer_s(model, calibrated, make_setup(global_batch_size=1, seq_length=4096), Layout(tp=2))
    assert step == pytest.approx(0.25, rel=1e-12)


def test_doubling_the_files_times_slows_the_plan():
    hardware, model = load_hardware("ascend-910b"), load_model("llama2-7b")
    setup = make_setup(global_batch_size=64, seq_length=4096)
    plans = []
    for factor in (1, 2):
        data = _file(**{key: value * factor for key, value in TIMES.items()})
        calibrated = apply_calibration(hardware, calibration_from_mapping(data))
        layout = Layout(tp=2, dp=4, micro_batch=1, recompute=RecomputeMode.FULL)
        plans.append((evaluate(model, calibrated, setup, layout), search(model, calibrated, setup, 8).best))
    (one, best_one), (two, best_two) = plans
    assert two.time.compute == pytest.approx(2 * one.time.compute) and two.time.recompute == pytest.approx(
        2 * one.time.recompute)
    assert two.iteration_s > one.iteration_s and best_two.iteration_s > best_one.iteration_s


# ---- chameleon-plan --calibration ---------------------------------------------------------------------------
def test_cli_says_it_is_calibrated_and_its_plan_follows_the_file(tmp_path, capsys):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_file()))
    argv = ["--devices", "8", "--no-swap", "--json"]
    assert plan.main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plan.main(argv + ["--calibration", str(path)]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["calibration"]["file"] == str(path)
    assert calibrated["calibration"]["source"] == "simulated: h100-pcie"
    assert calibrated["best"]["iteration_s"] != plain["best"]["iteration_s"] and "calibration" not in plain
    assert plan.main(["--devices", "8", "--no-swap", "--calibration", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"calibrated from {path} (simulated: h100-pcie):\n  layer compute ")
    assert "layer backward / forward 2.00 -> 2.25" in out


@pytest.mark.parametrize("content, named", [
    (json.dumps(_file(layer_forward_s="slow")), "layer_forward_s"),
    (json.dumps(_file(extra_key=1)), "extra_key"),
    ("{not json", "not valid JSON"),
    (None, "no such calibration file"),
])
def test_cli_bad_calibration_files_exit_2_with_the_reason(tmp_path, capsys, content, named):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    assert plan.main(["--devices", "8", "--calibration", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"chameleon-plan: {path}: ") and named in captured.err and not captured.out


# ---- the simulated producer ---------------------------------------------------------------------------------
TINY_MODEL = """kind: model
name: tiny-gpt
num_layers: 3
hidden_size: 256
num_attention_heads: 4
num_query_groups: 2
ffn_hidden_size: 704
vocab_size: 1024
seq_length: 256
"""


def test_the_producer_predicts_a_run_it_did_not_measure(tmp_path):
    """Measured with 2 layers (and 1), the file's per-layer and head times add up to a 3-layer run's kernel
    seconds: a wrong backward difference or head share would not."""
    pytest.importorskip("megatron.core")
    import dataclasses

    from chameleon_dist.integrations.megatron.meta_models import megatron_meta_session
    from launch.experiments.planner_calibration import measure, phase_seconds
    from launch.experiments.scale_runs import Case, profiled_iteration

    (tmp_path / "tiny.yaml").write_text(TINY_MODEL)
    case = Case("tiny", str(tmp_path / "tiny.yaml"), 2)
    data = measure(case, preset="h100-pcie", micro_batches=2)
    calibration = calibration_from_mapping(data)
    assert calibration.source == "simulated: h100-pcie" and calibration.shape.num_layers == 2
    assert calibration.d2h_bytes_per_s == 55e9  # the h100-pcie preset's (device/presets.py)
    with megatron_meta_session():
        trace, op_times_s = profiled_iteration(dataclasses.replace(case, num_layers=3), preset="h100-pcie",
                                               seq_length=256, micro_batches=2)
    three = phase_seconds(trace, op_times_s)
    assert three.layers == 3 and three.micro_batches == 2
    per_micro_batch = 3 * (data["layer_forward_s"] + data["layer_backward_s"]) + data["head_forward_s"] + \
        data["head_backward_s"]
    assert 2 * per_micro_batch == pytest.approx(sum(op_times_s), rel=1e-9)
    assert three.layers_forward_s == pytest.approx(6 * data["layer_forward_s"], rel=1e-9)


def test_the_comparison_rows_put_the_calibrated_prediction_beside_the_simulation(tmp_path):
    """``--compare``'s rows from a bench_scale-shaped result: the calibrated "none" prediction at the file's own
    shape is the sum of its times (no optimizer term: the simulated ranks run none), errors are against the
    simulated figure, and a failed run keeps its predictions but gets no error."""
    from launch.experiments.planner_calibration import compare_rows, markdown, preset_hardware, summary
    from launch.experiments.scale_runs import Case

    (tmp_path / "tiny.yaml").write_text(TINY_MODEL)
    case = Case("tiny", str(tmp_path / "tiny.yaml"), 2)
    times = {"layer_forward_s": 2e-5, "layer_backward_s": 5e-5, "head_forward_s": 1e-5, "head_backward_s": 2e-5}
    calibration = calibration_from_mapping({
        "format": 1, "source": "simulated: h100-pcie", **times,
        "shape": {"model": str(tmp_path / "tiny.yaml"), "seq_length": 256, "num_layers": 2}})
    own = apply_calibration(preset_hardware("h100-pcie"), calibration)

    def row(variant, seconds, budget=0.9, error=""):
        return {"variant": variant, "budget": budget, "budget_bytes": 10**9, "iteration_s": seconds,
                "peak_bytes": 0 if error else 2 * 10**8, "fits": not error, "error": error}

    result = {"seq_length": 256, "micro_batches": 2, "reference": {"model_state_bytes": 4 * 10**6},
              "rows": [row("reference", 4e-4), row("megatron-selective", 4.2e-4), row("megatron-full", 5e-4),
                       row("chameleon-swap", 4.1e-4), row("chameleon-swap", 0.0, 0.7, "emulated device out of memory")]}
    rows = compare_rows(case, "h100-pcie", result, {"own": own}, swap_budgets=(0.9, 0.7))
    assert [r["approach"] for r in rows] == ["none", "selective", "full", "swap", "swap"]
    none, failed = rows[0], rows[-1]
    expected_s = 2 * (2 * (times["layer_forward_s"] + times["layer_backward_s"]) + times["head_forward_s"]
                      + times["head_backward_s"])
    assert none["own_s"] == pytest.approx(expected_s, rel=1e-9)
    assert none["own_time_error"] == pytest.approx(expected_s / 4e-4 - 1, rel=1e-9)
    assert rows[2]["own_s"] == pytest.approx(expected_s + 2 * 2 * times["layer_forward_s"], rel=1e-9)  # full
    assert none["planner_s"] != none["own_s"] and "planner_peak_error" in none
    assert "own_s" in failed and "own_time_error" not in failed and "planner_peak_error" not in failed
    table = markdown(rows)
    assert "swap at 0.70 (failed: emulated device out of memory)" in table and table.count("\n") == len(rows) + 1
    assert summary(rows).startswith("- none (1 settings): time error planner ")
    assert "- swap (1 settings)" in summary(rows)
