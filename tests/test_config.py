"""ChameleonConfig: defaults, files, error reporting, DeepSpeed and Megatron entry points."""

import argparse
import copy
import json
import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from chameleon_dist.config import (
    KNOWN_PRESETS,
    ChameleonConfig,
    ConfigError,
    add_megatron_args,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def problems_of(data) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(data)
    return info.value.problems


def only_problem(data) -> str:
    problems = problems_of(data)
    assert len(problems) == 1, problems
    return problems[0]


# --- defaults and files -------------------------------------------------------------------------------


def test_defaults():
    config = ChameleonConfig()
    assert config.enabled is True
    assert config.memory_budget == "auto"
    assert config.host_memory_budget == "auto"
    assert config.min_swap_bytes == 2**20
    assert (config.profiler.warmup_iterations, config.profiler.policy_trials) == (2, 5)
    assert (config.profiler.length_change, config.profiler.cosine_threshold) == (0.05, 0.95)
    assert config.device.kind == "auto"
    assert config.device.capacity is None
    assert config.device.h2d_bytes_per_s is None and config.device.d2h_bytes_per_s is None
    assert config.device.preset is None
    assert (config.executor.prefetch_depth, config.executor.max_oom_retries) == (2, 3)
    assert load_config(None) == config
    assert load_config({}) == config


def _leaf_keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        keys |= _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return keys


def test_default_yaml_writes_out_every_default_with_a_comment():
    path = CONFIGS / "chameleon" / "default.yaml"
    assert load_config(path) == ChameleonConfig()
    data = yaml.safe_load(path.read_text())
    assert _leaf_keys(data) == _leaf_keys(ChameleonConfig().model_dump())
    lines = path.read_text().splitlines()
    for index, line in enumerate(lines):
        if ":" in line and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert lines[index - 1].lstrip().startswith("#"), f"no comment above {line!r}"


@pytest.mark.parametrize("path", sorted((CONFIGS / "chameleon").glob("*")), ids=lambda p: p.name)
def test_every_chameleon_config_file_loads(path):
    assert isinstance(load_config(path), ChameleonConfig)


@pytest.mark.parametrize("path", sorted((CONFIGS / "deepspeed").glob("*")), ids=lambda p: p.name)
def test_every_deepspeed_config_file_has_a_valid_chameleon_block(path):
    data = json.loads(path.read_text())
    assert "chameleon" in data
    assert data["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert ChameleonConfig.from_deepspeed_config(path).enabled is True


def test_shipped_examples_have_the_documented_values():
    emulated = load_config(CONFIGS / "chameleon" / "emulated_910b.yaml")
    assert (emulated.device.kind, emulated.device.capacity, emulated.device.preset) == ("emulated", 2 * 10**9, "ascend-910b")
    assert emulated.memory_budget == 0.9 and emulated.memory_budget_bytes(emulated.device.capacity) == 18 * 10**8
    cuda = load_config(str(CONFIGS / "chameleon" / "cuda.yaml"))
    assert (cuda.device.kind, cuda.memory_budget, cuda.host_memory_budget) == ("cuda", 0.85, 64 * 10**9)
    deepspeed = json.loads((CONFIGS / "deepspeed" / "zero1_chameleon.json").read_text())
    assert deepspeed["zero_optimization"]["stage"] == 1
    assert deepspeed["bf16"]["enabled"] is False and deepspeed["fp16"]["loss_scale"] == 0  # dynamic


def test_known_presets_match_the_device_presets():
    from chameleon_dist.device.presets import PRESETS

    assert set(KNOWN_PRESETS) == {preset.name for preset in PRESETS}


def test_load_config_sources(tmp_path):
    config = ChameleonConfig(memory_budget="6GB")
    assert load_config(config) is config
    (tmp_path / "c.json").write_text(json.dumps({"memory_budget": "512MiB"}))
    assert load_config(tmp_path / "c.json").memory_budget == 512 * 2**20
    (tmp_path / "c.yml").write_text("device:\n  capacity: 1.5 GiB\n")
    assert load_config(str(tmp_path / "c.yml")).device.capacity == 3 * 2**29
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == ChameleonConfig()


def test_file_problems_name_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml: no such Chameleon config file"):
        load_config(missing)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml: a Chameleon config is a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        load_config(tmp_path / "broken.yaml")
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match="use a .yaml, .yml or .json file"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "bad.yaml").write_text("memory_budget: 6 gigs\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "bad.yaml")
    assert info.value.source == str(tmp_path / "bad.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'bad.yaml'}: memory_budget: '6 gigs' is not a size")


# --- normalisation and resolution ---------------------------------------------------------------------


def test_sizes_and_budgets_are_normalised():
    config = load_config({
        "memory_budget": "6GB", "host_memory_budget": 0.25, "min_swap_bytes": "800kB",
        "device": {"capacity": "8GiB", "h2d_bytes_per_s": "25GB", "d2h_bytes_per_s": 12_000_000_000},
    })
    assert config.memory_budget == 6 * 10**9 and isinstance(config.memory_budget, int)
    assert config.host_memory_budget == 0.25 and isinstance(config.host_memory_budget, float)
    assert config.min_swap_bytes == 800_000
    assert (config.device.capacity, config.device.h2d_bytes_per_s, config.device.d2h_bytes_per_s) == (
        8 * 2**30, 25 * 10**9, 12 * 10**9
    )
    assert load_config({"device": {"preset": " H100-PCIe "}}).device.preset == "h100-pcie"


def test_budget_resolution():
    assert ChameleonConfig().memory_budget_bytes(1000) == 900
    assert ChameleonConfig(memory_budget=0.5).memory_budget_bytes(1000) == 500
    assert ChameleonConfig(memory_budget="600B").memory_budget_bytes(1000) == 600
    assert ChameleonConfig(host_memory_budget="auto").host_memory_budget_bytes(1000) == 500
    assert ChameleonConfig(host_memory_budget=0.1).host_memory_budget_bytes(1000) == 100
    assert ChameleonConfig(host_memory_budget="1KiB").host_memory_budget_bytes(10) == 1024


def test_host_budget_reads_physical_ram(monkeypatch):
    values = {"SC_PHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr("os.sysconf", lambda name: values[name])
    assert ChameleonConfig().host_memory_budget_bytes() == 500 * 4096
    assert ChameleonConfig(host_memory_budget=0.25).host_memory_budget_bytes() == 250 * 4096


def test_assignment_is_validated():
    config = ChameleonConfig()
    config.memory_budget = "0.8"
    assert config.memory_budget == 0.8
    config.device.capacity = "1GB"
    assert config.device.capacity == 10**9
    with pytest.raises(ConfigError, match="^memory_budget: 'lots' is not a size"):
        config.memory_budget = "lots"
    with pytest.raises(ConfigError, match="^policy_trials: 0 is not valid"):
        config.profiler.policy_trials = 0
    assert config.memory_budget == 0.8 and config.profiler.policy_trials == 5


# --- errors -------------------------------------------------------------------------------------------

BUDGET_USE = ('use bytes (e.g. 6442450944), a size string like "6GB" or "512MiB", '
              'a fraction of device capacity in (0, 1] such as 0.8, or "auto"')


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"profiler": {"warmup_iteration": 3}},
         "profiler.warmup_iteration: unknown setting; did you mean 'warmup_iterations'?"),
        ({"memory_budgt": "6GB"}, "memory_budgt: unknown setting; did you mean 'memory_budget'?"),
        ({"device": {"capcity": "1GB"}}, "device.capcity: unknown setting; did you mean 'capacity'?"),
        ({"executor": {"zzz": 1}}, "executor.zzz: unknown setting; the settings here are: prefetch_depth, max_oom_retries"),
        ({"memory_budget": "6 gigs"}, "memory_budget: '6 gigs' is not a size (unknown unit 'gigs'"),
        ({"memory_budget": "lots"}, f"memory_budget: 'lots' is not a size; {BUDGET_USE}"),
        ({"memory_budget": 1.5}, "memory_budget: 1.5 is not a fraction in (0, 1]"),
        ({"memory_budget": 0.0}, "memory_budget: 0.0 is not a fraction in (0, 1]"),
        ({"memory_budget": -0.2}, "memory_budget: -0.2 is not a fraction in (0, 1]"),
        ({"memory_budget": -5}, "memory_budget: -5 is negative"),
        ({"memory_budget": True}, "memory_budget: True is a boolean, not a size"),
        ({"min_swap_bytes": "-1MiB"}, "min_swap_bytes: '-1MiB' is negative"),
        ({"min_swap_bytes": 0.5}, "min_swap_bytes: 0.5 is not a whole number of bytes"),
        ({"min_swap_bytes": "auto"}, "min_swap_bytes: 'auto' is not a size; use bytes"),
        ({"device": {"capacity": -1}}, "device.capacity: -1 is negative"),
        ({"device": {"capacity": 0}}, "device.capacity: 0 is zero"),
        ({"device": {"h2d_bytes_per_s": "fast"}}, "device.h2d_bytes_per_s: 'fast' is not a size; use bytes per second"),
        ({"device": {"kind": "gpu"}}, "device.kind: 'gpu' is not valid: input should be 'auto', 'cuda' or 'emulated'"),
        ({"device": {"preset": "ascend910b"}}, "device.preset: unknown preset 'ascend910b'; did you mean 'ascend-910b'?"),
        ({"profiler": {"warmup_iterations": True}},
         "profiler.warmup_iterations: True is a boolean, not a number; use a whole number >= 0"),
        ({"profiler": {"cosine_threshold": False}}, "profiler.cosine_threshold: False is a boolean, not a number"),
        ({"profiler": {"warmup_iterations": "two"}}, "profiler.warmup_iterations: 'two' is not valid: input should be a valid integer"),
        ({"profiler": {"warmup_iterations": -1}}, "profiler.warmup_iterations: -1 is not valid: input should be greater than or equal to 0"),
        ({"profiler": {"policy_trials": 0}}, "profiler.policy_trials: 0 is not valid"),
        ({"profiler": {"length_change": 1.0}}, "profiler.length_change: 1.0 is not valid: input should be less than 1"),
        ({"profiler": {"cosine_threshold": 0}}, "profiler.cosine_threshold: 0 is not valid: input should be greater than 0"),
        ({"executor": {"prefetch_depth": 1.5}}, "executor.prefetch_depth: 1.5 is not valid"),
        ({"executor": {"max_oom_retries": -1}}, "executor.max_oom_retries: -1 is not valid"),
        ({"profiler": 5}, "profiler: expected a mapping of settings (warmup_iterations, policy_trials"),
        ({"enabled": "maybe"}, "enabled: 'maybe' is not valid: input should be a valid boolean"),
    ],
)
def test_each_bad_input_is_one_problem_naming_the_field(data, expected):
    assert only_problem(data).startswith(expected)


def test_explicit_bandwidth_beside_a_preset_is_kept_to_override_it():
    device = load_config({"device": {"preset": "h200", "h2d_bytes_per_s": "25GB", "d2h_bytes_per_s": 1}}).device
    assert (device.preset, device.h2d_bytes_per_s, device.d2h_bytes_per_s) == ("h200", 25 * 10**9, 1)


def test_all_problems_are_reported_together():
    data = {
        "memory_budget": 1.5,
        "min_swap_bytes": -5,
        "profiler": {"warmup_iteration": 3, "policy_trials": 0},
        "device": {"capacity": "2 gigs", "kind": "gpu"},
        "executor": {"prefetch_depth": True},
    }
    with pytest.raises(ConfigError) as info:
        load_config(data)
    paths = [problem.split(":")[0] for problem in info.value.problems]
    assert sorted(paths) == sorted([
        "memory_budget", "min_swap_bytes", "profiler.warmup_iteration", "profiler.policy_trials",
        "device.capacity", "device.kind", "executor.prefetch_depth",
    ])
    message = str(info.value)
    assert message.startswith("7 problems in the Chameleon configuration:\n")
    assert all(f"  - {problem}" in message for problem in info.value.problems)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"enabled": "yes"}, "enabled: 'yes' is not valid: input should be a valid boolean; use true or false"),
        ({"enabled": 1}, "enabled: 1 is not valid: input should be a valid boolean"),
        ({"executor": {"allow_recompute": "yes"}}, "executor.allow_recompute: 'yes' is not valid: input should be a "
         "valid boolean"),
        ({"executor": {"allow_recompute": 0}}, "executor.allow_recompute: 0 is not valid: input should be a valid boolean"),
        ({"executor": {"prefetch_depth": "2"}},
         "executor.prefetch_depth: '2' is not valid: input should be a valid integer; use a whole number >= 0"),
        ({"executor": {"max_oom_retries": 3.0}}, "executor.max_oom_retries: 3.0 is not valid: input should be a valid integer"),
        ({"profiler": {"policy_trials": "5"}}, "profiler.policy_trials: '5' is not valid: input should be a valid integer"),
    ],
)
def test_booleans_and_whole_numbers_are_strict(data, expected):
    assert only_problem(data).startswith(expected)


@pytest.mark.parametrize("value", [0, 1, 90, "1", "100"])
def test_a_bare_small_integer_budget_is_rejected_with_what_to_write(value):
    problem = only_problem({"memory_budget": value})
    assert problem.startswith(f"memory_budget: {value} would be {int(value)} bytes") or \
        problem.startswith(f"memory_budget: {value!r} would be {int(value)} bytes"), problem
    assert "0.9" in problem and '"40GB"' in problem
    assert only_problem({"host_memory_budget": value}).startswith("host_memory_budget: ")


def test_budgets_that_are_meant_still_load():
    for budget in (1.0, 0.9, "1.0", "auto", "64B", "512MiB", 10**9, "1000"):
        load_config({"memory_budget": budget})
    assert load_config({"memory_budget": "64B"}).memory_budget == 64, "an explicit unit means bytes"
    assert load_config({"memory_budget": "64MiB", "device": {"capacity": "64MiB"}}).memory_budget == 64 * 2**20


def test_memory_budget_above_the_configured_capacity_names_both_numbers():
    problem = only_problem({"memory_budget": "128MiB", "device": {"kind": "emulated", "capacity": "64MiB"}})
    assert problem.startswith("memory_budget: 128MiB (134217728 bytes) is above device.capacity 64MiB (67108864 bytes)")
    assert "fraction" in problem


def test_memory_budget_above_capacity_is_reported_with_the_other_problems():
    problems = problems_of({"enabled": "yes", "memory_budget": "128MiB", "device": {"capacity": "64MiB"},
                            "executor": {"prefetch_depth": "2"}})
    assert sorted(p.split(":")[0] for p in problems) == ["enabled", "executor.prefetch_depth", "memory_budget"]


def test_memory_budget_above_capacity_is_rejected_on_assignment():
    config = load_config({"device": {"capacity": "64MiB"}})
    with pytest.raises(ConfigError, match=r"^memory_budget: 128MiB \(134217728 bytes\) is above device.capacity"):
        config.memory_budget = "128MiB"
    assert config.memory_budget == "auto" and "memory_budget" not in config.model_fields_set


def test_direct_construction_raises_config_error():
    with pytest.raises(ConfigError) as info:
        ChameleonConfig(memory_budget="x", device={"capcity": 1})
    assert [p.split(":")[0] for p in info.value.problems] == ["memory_budget", "device.capcity"]


def test_config_error_keeps_its_problems_through_pickle():
    error = ConfigError(["a: one", "b: two"], source="job.yaml")
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.problems, clone.source, str(clone)) == (error.problems, "job.yaml", str(error))
    assert str(ConfigError("x: bad")) == "x: bad"


def test_nested_in_another_model_keeps_paths_and_hints():
    class Job(BaseModel):
        model_config = ConfigDict(extra="forbid")
        chameleon: ChameleonConfig

    with pytest.raises(ValidationError) as info:
        Job.model_validate({"chameleon": {"profiler": {"warmup_iteration": 1}, "memory_budget": 2.5}})
    error = ConfigError.from_validation_error(info.value, source="job.yaml")
    assert sorted(error.problems) == sorted([
        "chameleon.profiler.warmup_iteration: unknown setting; did you mean 'warmup_iterations'?",
        f"chameleon.memory_budget: 2.5 is not a fraction in (0, 1] (a float is read as a fraction); {BUDGET_USE}",
    ])
    assert str(error).startswith("job.yaml: 2 problems")


# --- DeepSpeed ----------------------------------------------------------------------------------------


def test_from_deepspeed_config_does_not_mutate():
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "chameleon": {"memory_budget": "6GB", "device": {"kind": "emulated", "capacity": "8GB"},
                      "profiler": {"warmup_iterations": 1}},
    }
    before = copy.deepcopy(ds_config)
    config = ChameleonConfig.from_deepspeed_config(ds_config)
    assert ds_config == before
    assert config.memory_budget == 6 * 10**9 and config.device.capacity == 8 * 10**9
    config.device.capacity = "1GB"
    assert ds_config == before


def test_from_deepspeed_config_without_a_block_is_disabled(tmp_path):
    assert ChameleonConfig.from_deepspeed_config({"train_batch_size": 8}) == ChameleonConfig(enabled=False)
    assert ChameleonConfig.from_deepspeed_config({"chameleon": None}).enabled is False
    assert ChameleonConfig.from_deepspeed_config({"chameleon": {}}).enabled is True
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 8}))
    assert ChameleonConfig.from_deepspeed_config(tmp_path / "ds.json").enabled is False


def test_from_deepspeed_config_errors_are_prefixed():
    with pytest.raises(ConfigError) as info:
        ChameleonConfig.from_deepspeed_config({"chameleon": {"memory_budget": 0, "device": {"capcity": 1}, "x": 1.5}})
    assert info.value.problems == [
        "chameleon.memory_budget: 0 would be 0 bytes; for a share of device capacity write a fraction such as "
        "0.9 (or \"auto\"), for a size write it with a unit such as \"40GB\"",
        "chameleon.device.capcity: unknown setting; did you mean 'capacity'?",
        "chameleon.x: unknown setting; the settings here are: enabled, memory_budget, host_memory_budget, "
        "min_swap_bytes, profiler, device, executor",
    ]
    with pytest.raises(ConfigError, match=r"^chameleon: expected a mapping of Chameleon settings"):
        ChameleonConfig.from_deepspeed_config({"chameleon": True})


# --- Megatron -----------------------------------------------------------------------------------------


def megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    returned = add_megatron_args(parser)
    assert returned is parser
    return parser


def test_megatron_args_default_to_unset():
    args = megatron_parser().parse_args([])
    chameleon_args = {k: v for k, v in vars(args).items() if k.startswith("chameleon")}
    assert len(chameleon_args) == 11 and set(chameleon_args.values()) == {None}
    assert ChameleonConfig.from_megatron_args(args) == ChameleonConfig()
    assert "chameleon" in [group.title for group in megatron_parser()._action_groups]


def test_megatron_rate_flags_set_the_emulated_device_rates():
    args = megatron_parser().parse_args(["--chameleon-peak-flop-per-s", "75e9", "--chameleon-memory-bytes-per-s", "15e9"])
    device = ChameleonConfig.from_megatron_args(args).device
    assert (device.peak_flop_per_s, device.memory_bytes_per_s) == (75e9, 15e9)


def test_megatron_args_override_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("memory_budget: 0.5\nmin_swap_bytes: 4MiB\ndevice: {kind: emulated, capacity: 1GB}\n")
    args = megatron_parser().parse_args([
        "--chameleon-config", str(path), "--chameleon-memory-budget", "0.8",
        "--no-chameleon", "--chameleon-device-capacity", "2GB", "--chameleon-preset", "h100-pcie",
    ])
    config = ChameleonConfig.from_megatron_args(args)
    assert config.memory_budget == 0.8 and isinstance(config.memory_budget, float)
    assert config.enabled is False
    assert config.min_swap_bytes == 4 * 2**20  # from the file: flag not given
    assert (config.device.kind, config.device.capacity, config.device.preset) == ("emulated", 2 * 10**9, "h100-pcie")
    args = megatron_parser().parse_args([
        "--chameleon-memory-budget", "6GB", "--chameleon-host-memory-budget", "auto",
        "--chameleon-min-swap-bytes", "0", "--chameleon-device", "cuda", "--chameleon",
    ])
    config = ChameleonConfig.from_megatron_args(args)
    assert (config.memory_budget, config.min_swap_bytes, config.device.kind, config.enabled) == (6 * 10**9, 0, "cuda", True)


def test_megatron_errors_name_the_flag(tmp_path):
    args = megatron_parser().parse_args(["--chameleon-memory-budget", "6 gigs", "--chameleon-device", "gpu",
                                         "--chameleon-min-swap-bytes", "1.5"])
    with pytest.raises(ConfigError) as info:
        ChameleonConfig.from_megatron_args(args)
    assert [p.split(":")[0] for p in info.value.problems] == [
        "--chameleon-memory-budget (memory_budget)",
        "--chameleon-min-swap-bytes (min_swap_bytes)",
        "--chameleon-device (device.kind)",
    ]
    assert "'6 gigs' is not a size" in info.value.problems[0]
    path = tmp_path / "c.yaml"
    path.write_text("device: {kind: cuda}\n")
    args = megatron_parser().parse_args(["--chameleon-config", str(path), "--chameleon-host-op-s", "3us"])
    with pytest.raises(ConfigError, match=r"--chameleon-host-op-s \(device.host_op_s\): only the emulated device "
                                          r"models compute; remove device.host_op_s or use kind: emulated"):
        ChameleonConfig.from_megatron_args(args)


def test_megatron_namespace_without_chameleon_attributes():
    assert ChameleonConfig.from_megatron_args(argparse.Namespace(micro_batch_size=1)) == ChameleonConfig()
    args = argparse.Namespace(chameleon_memory_budget="0.5")
    assert ChameleonConfig.from_megatron_args(args).memory_budget == 0.5


def test_megatron_missing_config_file_names_it(tmp_path):
    args = argparse.Namespace(chameleon_config=str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="missing.yaml: no such Chameleon config file"):
        ChameleonConfig.from_megatron_args(args)


def test_config_package_imports_no_framework():
    import ast

    package = Path(__file__).resolve().parents[1] / "chameleon_dist" / "config"
    for path in package.glob("*.py"):
        source = path.read_text()
        assert len(source.splitlines()) < 400, path
        assert "print(" not in source, path
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in {"megatron", "deepspeed", "torch"} for n in names), (path, names)
