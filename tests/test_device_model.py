"""DeviceModel: preset figures with sources, explicit overrides, this CPU's rates, validation; the config's
compute settings (device.peak_flop_per_s, memory_bytes_per_s, launch_latency_s, host_op_s)."""

import dataclasses
import math
import time

import pytest
import torch

from chameleon_dist.config import ConfigError, load_config
from chameleon_dist.device import model as device_model
from chameleon_dist.device.model import DeviceModel, dtype_key, measure_cpu_rates
from chameleon_dist.device.presets import PRESETS, get_preset

CPU_RATES = (2e11, 3e10)  # (FLOP/s, copy bytes/s) handed in: nothing is measured

# Public figures (REFERENCE.md §3, the vendors' datasheets, measured link rates): 16-bit dense peak, fp32
# peak, HBM, link (H2D, D2H).
EXPECTED = {
    "a100-pcie": (312e12, 19.5e12, 1.935e12, (25e9, 25e9)),
    "h100-pcie": (756e12, 51e12, 2.0e12, (55e9, 55e9)),
    "h200": (989e12, 67e12, 4.8e12, (55e9, 55e9)),
    "gh200": (989e12, 67e12, 4.0e12, (375e9, 297e9)),  # NVLink-C2C: the two directions differ
    "ascend-910b": (313e12, None, 1.6e12, (23e9, 23e9)),
}


def no_measuring(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measured this CPU although it was not needed")

    monkeypatch.setattr(device_model, "measure_cpu_rates", refuse)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_preset_supplies_every_figure_with_its_source(name):
    half_peak, fp32_peak, hbm, link = EXPECTED[name]
    model = DeviceModel.resolve(preset=name)
    assert model.preset == name
    assert model.peak_for(torch.bfloat16) == half_peak
    if name != "ascend-910b":
        assert model.peak_for(torch.float16) == half_peak
    if fp32_peak is not None:
        assert model.peak_for(torch.float32) == fp32_peak
    assert model.peak_for(torch.float32) < model.peak_for(torch.bfloat16)  # fp32 without tensor cores
    assert model.memory_bytes_per_s == hbm
    assert (model.h2d_bytes_per_s, model.d2h_bytes_per_s) == link  # real rates, not scaled to this CPU
    assert 1e-6 <= model.launch_latency_s <= 10e-6  # a few microseconds
    assert 0 < model.duplex_factor < 1
    assert model.host_op_s is None  # the preset is the device: the host stays measured
    text = " ".join(model.sources)
    for figure in ("float32", "bfloat16", "memory_bytes_per_s", "memory_bytes:", "h2d", "launch_latency_s",
                   "duplex_factor"):
        assert figure in text, figure
    assert get_preset(name).device_model() == model


def test_every_preset_is_checked_above():
    assert {preset.name for preset in PRESETS} == set(EXPECTED)


def test_peak_for_falls_back_to_default_for_dtypes_not_listed():
    model = DeviceModel.resolve("a100-pcie")
    assert model.peak_for(torch.int8) == model.peak_flop_per_s["default"] == 19.5e12
    assert dtype_key(torch.bfloat16) == "bfloat16" and dtype_key(torch.float8_e4m3fn) == "float8_e4m3fn"
    assert DeviceModel.resolve("h200").peak_for(torch.float8_e4m3fn) == 1979e12


def test_explicit_settings_override_the_preset():
    model = DeviceModel.resolve("h200", memory_bytes_per_s=1e12, launch_latency_s=7e-6, h2d_bytes_per_s=25e9,
                                d2h_bytes_per_s=20e9, host_op_s=2e-5)
    assert (model.memory_bytes_per_s, model.launch_latency_s) == (1e12, 7e-6)
    assert (model.h2d_bytes_per_s, model.d2h_bytes_per_s, model.host_op_s) == (25e9, 20e9, 2e-5)
    assert model.peak_for(torch.bfloat16) == 989e12  # not overridden: the preset's
    assert "memory_bytes_per_s: set by device.memory_bytes_per_s (overrides the preset)" in model.sources


def test_one_peak_number_replaces_every_dtype_and_a_mapping_only_those_it_names():
    one = DeviceModel.resolve("h100-pcie", peak_flop_per_s=1e14)
    assert set(one.peak_flop_per_s.values()) == {1e14}
    assert one.peak_for(torch.float32) == one.peak_for(torch.bfloat16) == one.peak_for(torch.int8) == 1e14
    some = DeviceModel.resolve("h100-pcie", peak_flop_per_s={"bfloat16": 5e14})
    assert (some.peak_for(torch.bfloat16), some.peak_for(torch.float32)) == (5e14, 51e12)


def test_without_a_preset_compute_is_this_cpus_rates_and_the_link_as_given(monkeypatch):
    no_measuring(monkeypatch)
    model = DeviceModel.resolve(cpu_rates=CPU_RATES)
    assert model.preset is None
    assert model.peak_for(torch.float32) == model.peak_for(torch.bfloat16) == 2e11
    assert model.memory_bytes_per_s == 3e10
    assert model.h2d_bytes_per_s is None and model.d2h_bytes_per_s is None  # an instant link
    assert model.duplex_factor == 1.0 and model.launch_latency_s > 0
    linked = DeviceModel.resolve(h2d_bytes_per_s=1e9, cpu_rates=CPU_RATES)
    assert (linked.h2d_bytes_per_s, linked.d2h_bytes_per_s) == (1e9, None)
    given = DeviceModel.resolve(peak_flop_per_s=5e10, memory_bytes_per_s=4e9)  # nothing left to measure
    assert (given.peak_for(torch.float32), given.memory_bytes_per_s) == (5e10, 4e9)


def test_without_a_preset_and_cpu_rates_it_measures_this_cpu():
    start_s = time.perf_counter()
    flop_per_s, copy_bytes_per_s = measure_cpu_rates()
    assert time.perf_counter() - start_s < 2.0  # ~50 ms; generous for a loaded machine
    assert flop_per_s > 1e8 and copy_bytes_per_s > 1e8
    model = DeviceModel.resolve()
    assert model.peak_for(torch.float32) > 1e8 and "measured" in " ".join(model.sources)


@pytest.mark.parametrize(
    "settings, name",
    [
        ({"peak_flop_per_s": 0}, "peak_flop_per_s"),
        ({"peak_flop_per_s": -1e12}, "peak_flop_per_s"),
        ({"peak_flop_per_s": math.nan}, "peak_flop_per_s"),
        ({"peak_flop_per_s": {"float32": 0.0}}, "peak_flop_per_s"),
        ({"memory_bytes_per_s": 0}, "memory_bytes_per_s"),
        ({"memory_bytes_per_s": math.inf}, "memory_bytes_per_s"),
        ({"launch_latency_s": 0}, "launch_latency_s"),
        ({"launch_latency_s": -1e-6}, "launch_latency_s"),
        ({"h2d_bytes_per_s": 0}, "h2d_bytes_per_s"),
        ({"d2h_bytes_per_s": -5}, "d2h_bytes_per_s"),
        ({"host_op_s": -1e-6}, "host_op_s"),
        ({"host_op_s": True}, "host_op_s"),
        ({"duplex_factor": 0}, "duplex_factor"),
        ({"duplex_factor": 1.5}, "duplex_factor"),
    ],
)
def test_bad_settings_raise_naming_the_setting(settings, name):
    with pytest.raises(ValueError, match=rf"device\.{name}\b"):
        DeviceModel.resolve("h100-pcie", **settings)
    with pytest.raises(ValueError, match=rf"device\.{name}\b"):
        DeviceModel.resolve(cpu_rates=CPU_RATES, **settings)


def test_construction_validates_and_needs_a_default_peak():
    with pytest.raises(ValueError, match=r"device\.peak_flop_per_s has no 'default'"):
        DeviceModel(peak_flop_per_s={"float32": 1e12}, memory_bytes_per_s=1e12, launch_latency_s=1e-6)
    with pytest.raises(ValueError, match=r"device\.preset 'tpu'"):
        DeviceModel.resolve("tpu")
    assert DeviceModel.resolve("h200", host_op_s=0).host_op_s == 0.0  # zero host time is allowed


def test_model_is_frozen_hashable_and_keeps_its_own_peaks():
    peaks = {"default": 1e12, "bfloat16": 2e12}
    model = DeviceModel(peak_flop_per_s=peaks, memory_bytes_per_s=1e11, launch_latency_s=2e-6)
    peaks["bfloat16"] = 9.0
    assert model.peak_for(torch.bfloat16) == 2e12
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.memory_bytes_per_s = 1.0
    same = DeviceModel(peak_flop_per_s={"bfloat16": 2e12, "default": 1e12}, memory_bytes_per_s=1e11,
                       launch_latency_s=2e-6)
    assert model == same and hash(model) == hash(same) and len({model, same}) == 1


# --- the config's device section -----------------------------------------------------------------------


def test_config_builds_the_model_with_overrides_beating_the_preset(monkeypatch):
    no_measuring(monkeypatch)
    device = load_config({"device": {
        "kind": "emulated", "preset": "a100-pcie", "h2d_bytes_per_s": "12GB", "peak_flop_per_s": "100 TFLOP/s",
        "memory_bytes_per_s": "1.5TB/s", "launch_latency_s": "5us", "host_op_s": "20us"}}).device
    model = DeviceModel.from_config(device)
    assert (model.preset, model.h2d_bytes_per_s, model.d2h_bytes_per_s) == ("a100-pcie", 12e9, 25e9)
    assert model.peak_for(torch.bfloat16) == model.peak_for(torch.float32) == 100e12
    assert (model.memory_bytes_per_s, model.launch_latency_s, model.host_op_s) == (1.5e12, 5e-6, 2e-5)
    plain = DeviceModel.from_config(load_config({"device": {"kind": "emulated"}}).device, cpu_rates=CPU_RATES)
    assert (plain.peak_for(torch.float32), plain.memory_bytes_per_s, plain.h2d_bytes_per_s) == (2e11, 3e10, None)


def test_config_reads_numbers_written_as_yaml_strings():
    device = load_config({"device": {"peak_flop_per_s": "312e12", "launch_latency_s": "3e-6", "host_op_s": 0}}).device
    assert (device.peak_flop_per_s, device.launch_latency_s, device.host_op_s) == (312e12, 3e-6, 0.0)
    assert load_config({"device": {"launch_latency_s": "0.5 ms"}}).device.launch_latency_s == 5e-4
    assert load_config({"device": {"launch_latency_s": "2 µs"}}).device.launch_latency_s == 2e-6


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"peak_flop_per_s": "fast"}, "device.peak_flop_per_s: 'fast' is not a FLOP rate; use FLOP per second"),
        ({"peak_flop_per_s": 0}, "device.peak_flop_per_s: 0 is too small: it must be more than 0"),
        ({"peak_flop_per_s": True}, "device.peak_flop_per_s: True is a boolean"),
        ({"memory_bytes_per_s": 0}, "device.memory_bytes_per_s: 0 is zero"),
        ({"memory_bytes_per_s": "quick"}, "device.memory_bytes_per_s: 'quick' is not a size"),
        ({"launch_latency_s": 0}, "device.launch_latency_s: 0 is too small: it must be more than 0"),
        ({"launch_latency_s": "5 parsecs"}, "device.launch_latency_s: '5 parsecs' is not a duration"),
        ({"host_op_s": -1e-6}, "device.host_op_s: -1e-06 is too small: it must be 0 or more"),
    ],
)
def test_bad_compute_settings_are_config_errors_naming_the_setting(settings, expected):
    with pytest.raises(ConfigError) as info:
        load_config({"device": settings})
    [problem] = info.value.problems
    assert problem.startswith(expected), problem


@pytest.mark.parametrize("name, value", [("host_op_s", 1e-5), ("peak_flop_per_s", 1e14),
                                         ("memory_bytes_per_s", "2TB"), ("launch_latency_s", "3us")])
def test_compute_settings_with_kind_cuda_are_an_error_naming_the_setting(name, value):
    with pytest.raises(ConfigError) as info:
        load_config({"device": {"kind": "cuda", name: value}})
    assert info.value.problems == [
        f"device.{name}: only the emulated device models compute; remove device.{name} or use kind: emulated"]
    assert load_config({"device": {"kind": "emulated", name: value}}).device.kind == "emulated"
    assert load_config({"device": {name: value}}).device.kind == "auto"


def test_kind_cuda_with_several_compute_settings_names_them_all_and_assignment_is_checked():
    with pytest.raises(ConfigError) as info:
        load_config({"device": {"kind": "cuda", "host_op_s": 0, "launch_latency_s": 1e-6}})
    assert info.value.problems == ["device.launch_latency_s: only the emulated device models compute; remove "
                                   "device.launch_latency_s and device.host_op_s, or use kind: emulated"]
    config = load_config({"device": {"kind": "cuda"}})
    with pytest.raises(ConfigError, match="host_op_s: only the emulated device .* remove device.host_op_s"):
        config.device.host_op_s = 1e-5
    assert config.device.host_op_s is None
