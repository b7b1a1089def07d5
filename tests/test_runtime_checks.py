"""What Chameleon(...) and attach() refuse (issue 10, items 5b and 6): budgets above the device or the
host, a passed device that contradicts the config's device section, a model larger than the device; and
attaching one model twice."""

import argparse

import pytest
import torch
from torch import nn

from chameleon_dist import Chameleon, ChameleonConfig, EmulatedDevice
from chameleon_dist.config import ConfigError, add_megatron_args
from chameleon_dist.config.schema import physical_memory_bytes

MiB = 2**20


def _problems(config, device):
    with pytest.raises(ConfigError) as info:
        Chameleon(config, device=device)
    return info.value.problems


def test_memory_budget_above_a_passed_device_names_both_numbers():
    (problem,) = _problems({"memory_budget": "128MiB"}, EmulatedDevice(64 * MiB))
    assert problem.startswith("memory_budget: 128MiB (134217728 bytes) is above the device's capacity")
    assert "64MiB (67108864 bytes)" in problem and "device.capacity" in problem
    Chameleon({"memory_budget": "64MiB"}, device=EmulatedDevice(64 * MiB))  # at capacity: fine
    Chameleon({"memory_budget": 0.5}, device=EmulatedDevice(64 * MiB))


def test_memory_budget_above_the_configured_emulated_device():
    with pytest.raises(ConfigError, match=r"memory_budget: 128MiB .* is above device.capacity 64MiB"):
        Chameleon({"memory_budget": "128MiB", "device": {"kind": "emulated", "capacity": "64MiB"}})


def test_host_memory_budget_above_this_machines_ram_names_both_numbers():
    ram_bytes = physical_memory_bytes()
    if ram_bytes is None:
        pytest.skip("this OS does not report its RAM size")
    (problem,) = _problems({"host_memory_budget": ram_bytes + 1}, EmulatedDevice(64 * MiB))
    assert problem.startswith(f"host_memory_budget: {ram_bytes + 1}B ({ram_bytes + 1} bytes) is above this machine's RAM")
    assert f"({ram_bytes} bytes)" in problem
    Chameleon({"host_memory_budget": 0.5}, device=EmulatedDevice(64 * MiB))


@pytest.mark.parametrize(
    ("device_section", "expected"),
    [
        ({"capacity": "1GiB"}, "device.capacity: the config sets 1GiB (1073741824 bytes) but the device passed to "
                               "Chameleon(device=...) has capacity 64MiB (67108864 bytes)"),
        ({"kind": "cuda"}, "device.kind: the config sets 'cuda' but the device passed to Chameleon(device=...) has "
                           "kind 'emulated'"),
        ({"h2d_bytes_per_s": "1GB"}, "device.h2d_bytes_per_s: the config sets 1000000000 bytes per second but the "
                                     "device passed to Chameleon(device=...) has an instant link"),
        ({"preset": "h200"}, "device.preset: the config sets 'h200' but the device passed to Chameleon(device=...) "
                             "has no preset"),
    ],
)
def test_a_passed_device_that_contradicts_the_config_is_an_error(device_section, expected):
    (problem,) = _problems({"device": device_section}, EmulatedDevice(64 * MiB))
    assert problem.startswith(expected)


def test_a_passed_device_that_matches_the_config_is_accepted():
    device = EmulatedDevice(64 * MiB, h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9)
    Chameleon({"device": {"kind": "emulated", "capacity": "64MiB", "h2d_bytes_per_s": "1GB",
                          "d2h_bytes_per_s": "2GB"}}, device=device)
    Chameleon({"device": {"kind": "auto", "capacity": None}}, device=device)  # "auto"/null say nothing
    # Megatron's path dumps and re-validates the config: every device field is "set", to its default
    parser = add_megatron_args(argparse.ArgumentParser())
    Chameleon(ChameleonConfig.from_megatron_args(parser.parse_args(["--chameleon-memory-budget", "0.5"])),
              device=device)


def test_every_problem_is_reported_at_once():
    problems = _problems({"memory_budget": "128MiB", "device": {"capacity": "32MiB"}}, EmulatedDevice(64 * MiB))
    # the config alone already says 128MiB > 32MiB; the runtime adds nothing it cannot know
    assert [p.split(":")[0] for p in problems] == ["memory_budget"]
    problems = _problems({"memory_budget": "100MiB", "device": {"capacity": "128MiB", "kind": "cuda"}},
                         EmulatedDevice(64 * MiB))
    assert [p.split(":")[0] for p in problems] == ["memory_budget", "device.kind", "device.capacity"]


def test_attach_refuses_a_model_larger_than_the_device():
    model = nn.Linear(1024, 1024)  # 4 MiB of weights
    chameleon = Chameleon(device=EmulatedDevice(2 * MiB))
    with pytest.raises(ConfigError) as info:
        chameleon.attach(model)
    message = str(info.value)
    assert message.startswith("device.capacity: the parameters and buffers of Linear take")
    assert "(4198400 bytes)" in message and "2MiB (2097152 bytes)" in message


def test_attach_twice_is_a_no_op():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    device = EmulatedDevice(64 * MiB)
    chameleon = Chameleon({"min_swap_bytes": 0}, device=device)
    assert chameleon.attach(model) is model
    live_bytes, hooks = device.live_bytes(), (len(model._forward_pre_hooks), len(model._forward_hooks))
    assert chameleon.attach(model) is model
    assert device.live_bytes() == live_bytes, "parameters not counted twice"
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks, "no second set of hooks"

    def closure():
        loss = model(torch.randn(4, 8)).square().sum()
        loss.backward()
        return loss

    chameleon.run_iteration(closure)
    assert chameleon.last_report.swap_out_bytes > 0


def test_pressure_handler_is_installed_only_when_swapping_is_on():
    """The emulated out-of-memory message says whether swapping is on from this handler."""
    off, on = EmulatedDevice(64 * MiB), EmulatedDevice(64 * MiB)
    Chameleon({"enabled": False}, device=off)
    Chameleon({"enabled": True}, device=on)
    assert off.dispatch.handler is None and on.dispatch.handler is not None


def test_a_host_memory_budget_the_passed_device_contradicts_is_an_error():
    """The passed device's host pool is what bounds host memory: a config value it contradicts would be
    silently ignored. A device made without a host budget takes the config's."""
    (problem,) = _problems({"host_memory_budget": "1KiB"}, EmulatedDevice(64 * MiB, host_memory_budget_bytes=2048))
    assert problem.startswith("host_memory_budget: the config sets 1KiB (1024 bytes)")
    assert "2KiB (2048 bytes)" in problem and "host_memory_budget_bytes" in problem
    Chameleon({"host_memory_budget": "1KiB"}, device=EmulatedDevice(64 * MiB, host_memory_budget_bytes=1024))
    unbounded = EmulatedDevice(64 * MiB)
    Chameleon({"host_memory_budget": "1KiB"}, device=unbounded)
    assert unbounded.host_pool.budget_bytes == 1024
    Chameleon({}, device=EmulatedDevice(64 * MiB, host_memory_budget_bytes=2048))  # not set: the device's own
