"""Megatron launch arguments: ``--chameleon-config PATH`` plus a few ``--chameleon-*`` overrides.

``add_megatron_args`` has the signature of Megatron's ``extra_args_provider``. Every flag defaults to
None so that a flag left out never overrides the file. Only argparse is used here.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from chameleon_dist.config.errors import ConfigError, describe_errors
from chameleon_dist.config.loaders import load_config
from chameleon_dist.config.schema import ChameleonConfig

# (flag, attribute on the parsed namespace, dotted setting it overrides)
OVERRIDES: tuple[tuple[str, str, str], ...] = (
    ("--chameleon", "chameleon_enabled", "enabled"),
    ("--chameleon-memory-budget", "chameleon_memory_budget", "memory_budget"),
    ("--chameleon-host-memory-budget", "chameleon_host_memory_budget", "host_memory_budget"),
    ("--chameleon-min-swap-bytes", "chameleon_min_swap_bytes", "min_swap_bytes"),
    ("--chameleon-device", "chameleon_device", "device.kind"),
    ("--chameleon-device-capacity", "chameleon_device_capacity", "device.capacity"),
    ("--chameleon-preset", "chameleon_preset", "device.preset"),
)


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "chameleon" argument group to ``parser`` and return it (Megatron ``extra_args_provider``)."""
    group = parser.add_argument_group(title="chameleon", description="Activation swapping (chameleon-dist).")
    group.add_argument("--chameleon-config", dest="chameleon_config", default=None, metavar="PATH",
                       help="YAML or JSON ChameleonConfig file; the flags below override it.")
    group.add_argument("--chameleon", dest="chameleon_enabled", default=None, action=argparse.BooleanOptionalAction,
                       help="Turn activation swapping on or off (default: as in the config file, else on).")
    group.add_argument("--chameleon-memory-budget", dest="chameleon_memory_budget", default=None, metavar="BUDGET",
                       help='Device memory budget: bytes, a size like "60GB", a fraction like 0.85, or "auto".')
    group.add_argument("--chameleon-host-memory-budget", dest="chameleon_host_memory_budget", default=None,
                       metavar="BUDGET", help='Host memory for swapped tensors: a size, a fraction of RAM, or "auto".')
    group.add_argument("--chameleon-min-swap-bytes", dest="chameleon_min_swap_bytes", default=None, metavar="SIZE",
                       help='Never swap tensors smaller than this (e.g. "1MiB").')
    group.add_argument("--chameleon-device", dest="chameleon_device", default=None, metavar="KIND",
                       help='Device kind: "auto", "cuda" or "emulated".')
    group.add_argument("--chameleon-device-capacity", dest="chameleon_device_capacity", default=None, metavar="SIZE",
                       help='Device memory capacity (needed by the emulated device), e.g. "2GB".')
    group.add_argument("--chameleon-preset", dest="chameleon_preset", default=None, metavar="NAME",
                       help="Accelerator preset for the emulated link (ascend-910b, h100-pcie, a100-pcie, h200).")
    return parser


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, name = dotted.split(".")
    for section in sections:
        data = data.setdefault(section, {})
    data[name] = value


def config_from_megatron_args(args: argparse.Namespace) -> ChameleonConfig:
    """The file named by ``args.chameleon_config`` (or the defaults) with the non-None flags applied.

    Attributes missing from ``args`` count as unset. Errors name the flag and the setting.
    """
    path = getattr(args, "chameleon_config", None)
    base = load_config(path)
    given = [(flag, setting, getattr(args, attr)) for flag, attr, setting in OVERRIDES
             if getattr(args, attr, None) is not None]
    if not given:
        return base
    data = base.model_dump()
    for _flag, setting, value in given:
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
