"""Megatron launch arguments: ``--chameleon-config PATH`` plus a few ``--chameleon-*`` overrides.

``add_megatron_args`` is a Megatron-LM ``extra_args_provider``: it receives the argparse parser, adds a
"chameleon" group and returns the parser. ``chain_extra_args`` combines it with a provider of your own.
Every flag defaults to None so that a flag left out never overrides the file. Only argparse is used here.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from chameleon_dist.config.errors import ConfigError, describe_errors
from chameleon_dist.config.loaders import load_config
from chameleon_dist.config.schema import KNOWN_PRESETS, ChameleonConfig

logger = logging.getLogger(__name__)

ArgsProvider = Callable[[argparse.ArgumentParser], Optional[argparse.ArgumentParser]]

CONFIG_FLAG = "--chameleon-config"
CONFIG_DEST = "chameleon_config"

# (flag, attribute on the parsed namespace, dotted setting it overrides)
OVERRIDES: tuple[tuple[str, str, str], ...] = (
    ("--chameleon", "chameleon_enabled", "enabled"),
    ("--chameleon-memory-budget", "chameleon_memory_budget", "memory_budget"),
    ("--chameleon-host-memory-budget", "chameleon_host_memory_budget", "host_memory_budget"),
    ("--chameleon-min-swap-bytes", "chameleon_min_swap_bytes", "min_swap_bytes"),
    ("--chameleon-device", "chameleon_device", "device.kind"),
    ("--chameleon-device-capacity", "chameleon_device_capacity", "device.capacity"),
    ("--chameleon-preset", "chameleon_preset", "device.preset"),
    ("--chameleon-host-op-s", "chameleon_host_op_s", "device.host_op_s"),
    ("--chameleon-peak-flop-per-s", "chameleon_peak_flop_per_s", "device.peak_flop_per_s"),
    ("--chameleon-memory-bytes-per-s", "chameleon_memory_bytes_per_s", "device.memory_bytes_per_s"),
)

# flag -> (metavar, or None for an on/off flag; help sentence, completed with the setting it overrides)
_HELP: dict[str, tuple[str | None, str]] = {
    "--chameleon": (None, "Turn activation swapping on or off."),
    "--chameleon-memory-budget": (
        "BUDGET", 'Device memory to stay under: bytes, a size such as "60GB", a fraction such as 0.85, or "auto".'),
    "--chameleon-host-memory-budget": (
        "BUDGET", 'Host memory for swapped-out tensors: a size, a fraction of host RAM, or "auto".'),
    "--chameleon-min-swap-bytes": ("SIZE", 'Tensors smaller than this are never swapped, e.g. "1MiB".'),
    "--chameleon-device": ("KIND", 'Device to run on: "auto", "cuda" or "emulated".'),
    "--chameleon-device-capacity": ("SIZE", 'Device memory capacity, e.g. "2GB"; the emulated device needs it.'),
    "--chameleon-preset": ("NAME", f"Accelerator preset the emulated device models: {', '.join(KNOWN_PRESETS)}."),
    "--chameleon-host-op-s": (
        "SECONDS", 'Host seconds per op on the emulated device, e.g. 3e-6 or "3us", for reproducible runs (with a '
                   'preset or the two rates below: else kernel times come from this CPU\'s measured rates).'),
    "--chameleon-peak-flop-per-s": (
        "FLOP_PER_S", "Emulated device: peak FLOP/s for every dtype (without a preset: this CPU's measured rate)."),
    "--chameleon-memory-bytes-per-s": (
        "BYTES_PER_S", "Emulated device: memory bandwidth (without a preset: this CPU's measured copy rate)."),
}


def _own_flags() -> dict[str, str]:
    """Every option string ``add_megatron_args`` adds, mapped to its namespace attribute."""
    flags = {CONFIG_FLAG: CONFIG_DEST}
    for flag, dest, _setting in OVERRIDES:
        flags[flag] = dest
        if _HELP[flag][0] is None:
            flags["--no-" + flag[2:]] = dest
    return flags


def _already_added(parser: argparse.ArgumentParser) -> bool:
    """True when ``parser`` holds exactly our flags already; ValueError when some other flag takes one."""
    actions = parser._option_string_actions  # argparse's own table of option string -> action
    own = _own_flags()
    present = {flag: actions[flag].dest for flag in own if flag in actions}
    if not present:
        return False
    foreign = sorted(flag for flag, dest in present.items() if dest != own[flag])
    missing = sorted(set(own) - set(present))
    if foreign or missing:
        taken = ", ".join(f"{flag} (dest {present[flag]!r})" for flag in foreign) or ", ".join(sorted(present))
        raise ValueError(
            f"cannot add the chameleon arguments: the parser already defines {taken}, which another "
            "extra_args_provider added; rename or remove that flag there so the --chameleon-* flags stay free")
    return True


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "chameleon" argument group to ``parser`` and return it (a Megatron ``extra_args_provider``).

    Calling it again on the same parser does nothing, so chaining it twice is harmless.
    """
    if _already_added(parser):
        logger.debug("the parser already has the --chameleon-* arguments; not adding them again")
        return parser
    group = parser.add_argument_group(title="chameleon", description="Activation swapping (chameleon-dist).")
    group.add_argument(CONFIG_FLAG, dest=CONFIG_DEST, default=None, metavar="PATH",
                       help="YAML or JSON file of Chameleon settings. The flags below override it.")
    for flag, dest, setting in OVERRIDES:
        metavar, text = _HELP[flag]
        how: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if metavar is None else {"metavar": metavar}
        group.add_argument(flag, dest=dest, default=None, help=f"{text} Overrides {setting}.", **how)
    return parser


def _name(provider: Any) -> str:
    return getattr(provider, "__name__", None) or repr(provider)


def chain_extra_args(*providers: ArgsProvider | None) -> ArgsProvider:
    """One ``extra_args_provider`` that applies ``providers`` in order (None entries are skipped).

    Use ``pretrain(..., extra_args_provider=chain_extra_args(my_provider, add_megatron_args))``. As in
    Megatron-LM, each provider's returned parser is handed to the next; a provider returning None is taken
    to have changed the parser in place.
    """
    for position, provider in enumerate(providers):
        if provider is not None and not callable(provider):
            raise TypeError(f"chain_extra_args: argument {position} is a {type(provider).__name__}; pass "
                            "functions that take the argparse parser and return it (or None to skip)")
    chosen = tuple(provider for provider in providers if provider is not None)

    def chained(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for provider in chosen:
            returned = provider(parser)
            if returned is None:
                continue
            if not isinstance(returned, argparse.ArgumentParser):
                raise TypeError(f"extra_args_provider {_name(provider)} returned a {type(returned).__name__}; "
                                "it must return the argparse parser it was given (or None)")
            parser = returned
        return parser

    chained.__qualname__ = chained.__name__ = f"chain_extra_args({', '.join(_name(p) for p in chosen)})"
    return chained


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, name = dotted.split(".")
    for section in sections:
        data = data.setdefault(section, {})
    data[name] = value


def _load_file(path: Any) -> ChameleonConfig:
    if path is None:
        return ChameleonConfig()
    if not Path(path).exists():
        raise ConfigError([f"no such Chameleon config file; check the path given to {CONFIG_FLAG}"], source=str(path))
    if Path(path).is_dir():
        raise ConfigError([f"is a directory; give {CONFIG_FLAG} a .yaml, .yml or .json file"], source=str(path))
    return load_config(str(path))


def config_from_megatron_args(args: argparse.Namespace) -> ChameleonConfig:
    """The file named by ``args.chameleon_config`` (or the defaults) with the non-None flags applied.

    Attributes missing from ``args`` count as unset. Errors name the flag and the setting.
    """
    path = getattr(args, CONFIG_DEST, None)
    base = _load_file(path)
    given = [(flag, setting, getattr(args, attr)) for flag, attr, setting in OVERRIDES
             if getattr(args, attr, None) is not None]
    if not given:
        return base
    data = base.model_dump()
    for flag, setting, value in given:
        logger.debug("%s overrides %s: %r", flag, setting, value)
        _set(data, setting, value)
    try:
        return ChameleonConfig.model_validate(data)
    except ValidationError as exc:
        flags = {setting: flag for flag, setting, _value in given}
        problems = [
            f"{flags[setting]} ({setting}): {message}" if setting in flags else f"{setting}: {message}"
            for setting, message in describe_errors(exc, model=ChameleonConfig)
        ]
        raise ConfigError(problems, source=None if path is None else str(path)) from None
