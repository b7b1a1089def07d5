"""The --chameleon-* flags on Megatron-LM-style parsers: extra_args_provider use, chaining, help, errors.

tests/test_config.py covers the flag-to-setting mapping on a bare parser; these tests build parsers the
way Megatron-LM's ``parse_args`` does (``parser = extra_args_provider(parser)``, then ``parse_args``).
"""

import argparse
import logging

import pytest

from chameleon_dist.config import ChameleonConfig, ConfigError, load_config
from chameleon_dist.config.megatron_args import OVERRIDES, add_megatron_args, chain_extra_args


def megatron_like_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Degree of tensor model parallelism.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Degree of pipeline parallelism.")
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=None, help="Batch size per model instance.")
    group.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"],
                       help="Checkpoint activations to train larger models.")
    return parser


def megatron_parse(provider, argv: list[str]) -> argparse.Namespace:
    """What Megatron-LM's parse_args does with an extra_args_provider."""
    parser = megatron_like_parser()
    if provider is not None:
        parser = provider(parser)
    return parser.parse_args(argv)


def my_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="my model")
    group.add_argument("--my-flag", type=int, default=3, help="A user's own flag.")
    return parser


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "chameleon.yaml"
    path.write_text("enabled: true\nmemory_budget: 0.5\nmin_swap_bytes: 4MiB\n"
                    "device: {kind: emulated, capacity: 8GB}\n")
    return path


MEGATRON_ARGV = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "4", "--recompute-granularity", "selective"]


@pytest.mark.parametrize("providers", [
    (add_megatron_args,),
    (None, add_megatron_args, None),
    (my_provider, add_megatron_args),
    (add_megatron_args, my_provider),
], ids=["alone", "with-nones", "user-first", "chameleon-first"])
def test_chained_providers_parse_megatron_user_and_chameleon_flags(providers, config_file):
    provider = chain_extra_args(*providers)
    has_mine = my_provider in providers
    argv = MEGATRON_ARGV + (["--my-flag", "7"] if has_mine else []) + [
        "--chameleon-config", str(config_file), "--chameleon-memory-budget", "2GB", "--no-chameleon"]
    args = megatron_parse(provider, argv)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 1)
    assert (args.micro_batch_size, args.recompute_granularity) == (4, "selective")
    assert getattr(args, "my_flag", None) == (7 if has_mine else None)
    config = ChameleonConfig.from_megatron_args(args)
    assert config.memory_budget == 2 * 10**9  # the flag beats the file's 0.5
    assert config.enabled is False  # the flag beats the file's true
    assert config.min_swap_bytes == 4 * 2**20 and config.device.capacity == 8 * 10**9  # from the file


def test_omitted_flags_leave_the_file_as_is(config_file):
    args = megatron_parse(chain_extra_args(my_provider, add_megatron_args),
                          MEGATRON_ARGV + ["--chameleon-config", str(config_file)])
    assert ChameleonConfig.from_megatron_args(args) == load_config(config_file)
    args = megatron_parse(add_megatron_args, ["--chameleon-config", str(config_file), "--chameleon"])
    assert ChameleonConfig.from_megatron_args(args) == load_config(config_file)


def test_chameleon_flag_turns_a_disabled_file_on(tmp_path):
    path = tmp_path / "off.json"
    path.write_text('{"enabled": false, "memory_budget": "6GB"}')
    args = megatron_parse(add_megatron_args, ["--chameleon-config", str(path), "--chameleon"])
    config = ChameleonConfig.from_megatron_args(args)
    assert (config.enabled, config.memory_budget) == (True, 6 * 10**9)


def test_chain_hands_each_provider_the_previous_ones_parser():
    seen = []
    replacement = argparse.ArgumentParser(allow_abbrev=False)

    def in_place(parser):  # returns None: changed the parser in place
        seen.append(parser)
        parser.add_argument("--in-place", default="x")

    def replacing(parser):
        seen.append(parser)
        return replacement

    original = megatron_like_parser()
    returned = chain_extra_args(in_place, replacing, add_megatron_args)(original)
    assert returned is replacement and seen == [original, original]
    assert returned.parse_args(["--chameleon-memory-budget", "0.5"]).chameleon_memory_budget == "0.5"
    assert chain_extra_args()(original) is original
    assert chain_extra_args(in_place, add_megatron_args).__name__ == "chain_extra_args(in_place, add_megatron_args)"


def test_chain_refuses_a_provider_that_returns_something_else():
    def returns_args(parser):
        return parser.parse_args([])

    with pytest.raises(TypeError, match=r"returns_args returned a Namespace; it must return the argparse parser"):
        chain_extra_args(add_megatron_args, returns_args)(megatron_like_parser())
    with pytest.raises(TypeError, match=r"argument 1 is a str; pass functions that take the argparse parser"):
        chain_extra_args(add_megatron_args, "--my-flag")


@pytest.mark.parametrize("providers", [
    (add_megatron_args, add_megatron_args),
    (add_megatron_args, my_provider, add_megatron_args),
    (chain_extra_args(add_megatron_args), add_megatron_args),
])
def test_adding_the_flags_twice_is_a_logged_no_op(providers, caplog):
    with caplog.at_level(logging.DEBUG, logger="chameleon_dist.config.megatron_args"):
        parser = chain_extra_args(*providers)(megatron_like_parser())
    assert "already has the --chameleon-* arguments" in caplog.text
    assert [group.title for group in parser._action_groups].count("chameleon") == 1
    args = parser.parse_args(["--chameleon-device", "emulated", "--chameleon-device-capacity", "2GB"])
    config = ChameleonConfig.from_megatron_args(args)
    assert (config.device.kind, config.device.capacity) == ("emulated", 2 * 10**9)


def test_someone_elses_chameleon_flag_is_named():
    def other(parser):
        parser.add_argument("--chameleon-config", dest="cham_cfg")
        return parser

    with pytest.raises(ValueError, match=r"already defines --chameleon-config \(dest 'cham_cfg'\)"):
        chain_extra_args(other, add_megatron_args)(megatron_like_parser())

    def partial(parser):
        parser.add_argument("--chameleon-preset", dest="chameleon_preset")
        return parser

    with pytest.raises(ValueError, match=r"already defines --chameleon-preset, which another extra_args_provider"):
        chain_extra_args(partial, add_megatron_args)(megatron_like_parser())


def test_allow_abbrev_false_parsers_take_full_flags_and_refuse_prefixes(capsys):
    parser = chain_extra_args(my_provider, add_megatron_args)(megatron_like_parser())
    args = parser.parse_args(["--chameleon", "--chameleon-min-swap-bytes", "1MiB", "--micro-batch-size", "2"])
    assert (args.chameleon_enabled, args.chameleon_min_swap_bytes, args.micro_batch_size) == (True, "1MiB", 2)
    for prefix in ("--chameleon-mem", "--chameleon-min"):
        with pytest.raises(SystemExit) as info:
            parser.parse_args([prefix, "1"])
        assert info.value.code == 2
        assert f"unrecognized arguments: {prefix}" in capsys.readouterr().err


def test_help_shows_the_chameleon_group_and_the_setting_each_flag_overrides(capsys):
    parser = chain_extra_args(my_provider, add_megatron_args)(megatron_like_parser())
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo the terminal-width wrapping
    assert "Megatron-LM Arguments" in text and "chameleon: Activation swapping" in text
    assert "--tensor-model-parallel-size" in text and "--my-flag" in text
    assert "--chameleon-config PATH" in text and "--chameleon, --no-chameleon" in text
    for flag, _attr, setting in OVERRIDES:
        assert flag in text and f"Overrides {setting}." in text, flag
    assert "h100-pcie" in text  # the presets are listed


BAD_VALUES = [
    ("--chameleon-memory-budget", "memory_budget", "6 gigs"),
    ("--chameleon-host-memory-budget", "host_memory_budget", "lots"),
    ("--chameleon-min-swap-bytes", "min_swap_bytes", "-1"),
    ("--chameleon-device", "device.kind", "gpu"),
    ("--chameleon-device-capacity", "device.capacity", "big"),
    ("--chameleon-preset", "device.preset", "h300"),
    ("--chameleon-host-op-s", "device.host_op_s", "soon"),
]


def _nested(setting: str, value):
    section, _, name = setting.rpartition(".")
    return {section: {name: value}} if section else {name: value}


@pytest.mark.parametrize("flag, setting, value", BAD_VALUES, ids=[flag for flag, _s, _v in BAD_VALUES])
def test_bad_flag_values_give_the_config_problem_naming_flag_and_setting(flag, setting, value):
    with pytest.raises(ConfigError) as from_file:
        load_config(_nested(setting, value))
    [file_problem] = from_file.value.problems
    assert file_problem.startswith(f"{setting}: ")
    message = file_problem[len(setting) + 2:]
    args = megatron_parse(chain_extra_args(my_provider, add_megatron_args), MEGATRON_ARGV + [flag, value])
    with pytest.raises(ConfigError) as from_flag:
        ChameleonConfig.from_megatron_args(args)
    assert from_flag.value.problems == [f"{flag} ({setting}): {message}"]


def test_a_flag_that_clashes_with_the_file_names_flag_and_file(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("device: {kind: emulated, capacity: 2GB}\n")
    args = megatron_parse(add_megatron_args, ["--chameleon-config", str(path), "--chameleon-memory-budget", "3GB"])
    with pytest.raises(ConfigError) as info:
        ChameleonConfig.from_megatron_args(args)
    assert info.value.source == str(path)
    assert info.value.problems == [
        "--chameleon-memory-budget (memory_budget): 3GB (3000000000 bytes) is above device.capacity 2GB "
        "(2000000000 bytes); lower memory_budget, or write a fraction of it such as 0.9"]


def test_missing_or_directory_config_path_names_path_and_flag(tmp_path):
    missing = tmp_path / "nowhere" / "chameleon.yaml"
    args = megatron_parse(add_megatron_args, ["--chameleon-config", str(missing)])
    with pytest.raises(ConfigError) as info:
        ChameleonConfig.from_megatron_args(args)
    assert str(info.value) == f"{missing}: no such Chameleon config file; check the path given to --chameleon-config"
    args = megatron_parse(add_megatron_args, ["--chameleon-config", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"is a directory; give --chameleon-config a \.yaml, \.yml or \.json file"):
        ChameleonConfig.from_megatron_args(args)
