"""Loading ``ChameleonConfig`` from files, dicts and DeepSpeed configs."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from chameleon_dist.config.errors import ConfigError
from chameleon_dist.config.schema import ChameleonConfig, validate_config

logger = logging.getLogger(__name__)

YAML_SUFFIXES = (".yaml", ".yml")
JSON_SUFFIXES = (".json",)
DEEPSPEED_KEY = "chameleon"


def read_mapping(path: str | Path, what: str = "Chameleon config") -> dict[str, Any]:
    """The mapping stored in a YAML or JSON file (an empty file is ``{}``); problems are ConfigErrors."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in YAML_SUFFIXES + JSON_SUFFIXES:
        raise ConfigError([f"cannot read a {what} from a {suffix or 'suffix-less'} file; use a .yaml, .yml or .json file"],
                          source=str(path))
    if not path.is_file():
        raise ConfigError([f"no such {what} file (check the path)"], source=str(path))
    text = path.read_text()
    try:
        if suffix in JSON_SUFFIXES:
            data = json.loads(text) if text.strip() else None
        else:
            data = yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"], source=str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"a {what} is a mapping of settings, got a {type(data).__name__}"], source=str(path))
    return data


def load_config(source: ChameleonConfig | Mapping[str, Any] | str | Path | None = None) -> ChameleonConfig:
    """A ``ChameleonConfig`` from a YAML/JSON path, a mapping, a ChameleonConfig (returned as is) or None
    (the defaults). Every problem is reported in one :class:`ConfigError`."""
    if source is None:
        return ChameleonConfig()
    if isinstance(source, ChameleonConfig):
        return source
    if isinstance(source, Mapping):
        return validate_config(copy.deepcopy(dict(source)))
    if isinstance(source, (str, Path)):
        config = validate_config(read_mapping(source), source=source)
        logger.debug("loaded Chameleon config from %s", source)
        return config
    raise ConfigError([
        f"cannot build a Chameleon config from a {type(source).__name__}; "
        "pass a path to a .yaml/.json file, a dict, a ChameleonConfig or None"
    ])


def _deepspeed_dict(ds_config: Any) -> tuple[dict[str, Any], str | None]:
    if isinstance(ds_config, (str, Path)):
        return read_mapping(ds_config, what="DeepSpeed config"), str(ds_config)
    if isinstance(ds_config, Mapping):
        return dict(ds_config), None
    params = getattr(ds_config, "_param_dict", None)  # a deepspeed.DeepSpeedConfig
    if isinstance(params, Mapping):
        return dict(params), None
    raise ConfigError([
        f"cannot read a DeepSpeed config from a {type(ds_config).__name__}; pass its dict or the path to its JSON"
    ])


def config_from_deepspeed(ds_config: Any) -> ChameleonConfig:
    """The ``"chameleon"`` block of a DeepSpeed config, validated; no block means disabled."""
    data, source = _deepspeed_dict(ds_config)
    if DEEPSPEED_KEY not in data or data[DEEPSPEED_KEY] is None:
        logger.info("DeepSpeed config has no %r block: Chameleon is disabled", DEEPSPEED_KEY)
        return ChameleonConfig(enabled=False)
    block = data[DEEPSPEED_KEY]
    if not isinstance(block, Mapping):
        raise ConfigError(
            [f"{DEEPSPEED_KEY}: expected a mapping of Chameleon settings (e.g. {{\"memory_budget\": 0.9}}), "
             f"got {type(block).__name__}"],
            source=source,
        )
    return validate_config(copy.deepcopy(dict(block)), source=source, prefix=(DEEPSPEED_KEY,))
