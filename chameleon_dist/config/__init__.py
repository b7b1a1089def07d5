"""Chameleon's configuration: one pydantic schema, loaded from YAML/JSON, DeepSpeed or Megatron arguments.

No framework is imported here (Megatron support is plain argparse).
"""

from chameleon_dist.config.errors import ConfigError
from chameleon_dist.config.loaders import config_from_deepspeed, load_config, read_mapping
from chameleon_dist.config.megatron_args import add_megatron_args, chain_extra_args, config_from_megatron_args
from chameleon_dist.config.schema import (
    AUTO_DEVICE_FRACTION,
    KNOWN_PRESETS,
    ChameleonConfig,
    DeviceConfig,
    ExecutorConfig,
    ProfilerConfig,
    physical_memory_bytes,
)
from chameleon_dist.config.shipped import DEFAULT_JOB
from chameleon_dist.config.sizes import SizeError, format_size, parse_budget, parse_size_bytes

__all__ = [
    "AUTO_DEVICE_FRACTION",
    "DEFAULT_JOB",
    "KNOWN_PRESETS",
    "ChameleonConfig",
    "ConfigError",
    "DeviceConfig",
    "ExecutorConfig",
    "ProfilerConfig",
    "SizeError",
    "add_megatron_args",
    "config_from_deepspeed",
    "config_from_megatron_args",
    "chain_extra_args",
    "format_size",
    "load_config",
    "parse_budget",
    "parse_size_bytes",
    "physical_memory_bytes",
    "read_mapping",
]
