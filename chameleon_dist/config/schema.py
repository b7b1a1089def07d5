"""``ChameleonConfig``: the one schema for every way Chameleon is configured: a YAML file, the
``"chameleon"`` block of a DeepSpeed config, or Megatron launch arguments.

Field names are used by code outside this repository: keep them. Sizes accept ints (bytes) and strings
such as ``"6GB"``; budgets also accept a fraction in (0, 1] and ``"auto"``. Values are stored normalised
(int bytes, float fraction, ``"auto"``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from chameleon_dist.config import numbers, sizes
from chameleon_dist.config.checks import (
    SMALL_BUDGET_MAX, budget_over_total_problem, device_setting_problem, small_budget_problem,
)
from chameleon_dist.config.errors import CUSTOM_ERROR, ConfigError
from chameleon_dist.config.budgets import (  # noqa: F401 - the fractions are re-exported
    AUTO_DEVICE_FRACTION, AUTO_HOST_FRACTION, device_budget_bytes, read_node,
)
from chameleon_dist.config.host_limits import HostLimits, physical_memory_bytes  # noqa: F401 - re-exported
from chameleon_dist.config.node import HostShare

if TYPE_CHECKING:
    import argparse

KNOWN_PRESETS: tuple[str, ...] = ("ascend-910b", "h100-pcie", "a100-pcie", "h200", "gh200")

_SIZE_USE = 'use bytes (e.g. 1048576) or a size string like "1MiB", "800kB" or "6GB"'
_RATE_USE = 'use bytes per second (e.g. 25000000000) or a size string like "25GB" (per second)'
_FLOP_USE = 'use FLOP per second, e.g. 312e12 or "312 TFLOP/s"'
_SECONDS_USE = 'use seconds, e.g. 3e-6, or a string with a unit such as "3us" or "0.2ms"'
_BUDGET_USE = (
    'use bytes (e.g. 6442450944), a size string like "6GB" or "512MiB", '
    'a fraction of {total} in (0, 1] such as 0.8, or "auto"'
)


def _custom(message: str, *, add_hint: bool = False) -> PydanticCustomError:
    """An error whose message is shown as is (``add_hint``: followed by the field's hint)."""
    return PydanticCustomError(CUSTOM_ERROR, "{message}", {"message": message, "add_hint": add_hint})


def _size_validator(use: str, *, per_second: bool = False, positive: bool = False, optional: bool = False):
    def validate(value: Any) -> int | None:
        if value is None and optional:
            return None
        try:
            nbytes = sizes.parse_size_bytes(value, per_second=per_second)
        except sizes.SizeError as exc:
            raise _custom(f"{exc}; {use}") from None
        if positive and nbytes == 0:
            raise _custom(f"{value!r} is zero; it must be more than 0 bytes; {use}")
        return nbytes

    return BeforeValidator(validate)


def _number_validator(parse, use: str, *, minimum: float, inclusive: bool):
    """A positive (``inclusive``: or zero) number read by ``parse``; None passes through."""
    bound = f"{minimum:g} or more" if inclusive else f"more than {minimum:g}"

    def validate(value: Any) -> float | None:
        if value is None:
            return None
        try:
            number = parse(value)
        except numbers.NumberError as exc:
            raise _custom(f"{exc}; {use}") from None
        if number < minimum or (number == minimum and not inclusive):
            raise _custom(f"{value!r} is too small: it must be {bound}; {use}")
        return number

    return BeforeValidator(validate)


def _budget_validator(total: str):
    use = _BUDGET_USE.format(total=total)

    def validate(value: Any) -> sizes.Budget:
        try:
            budget = sizes.parse_budget(value)
        except sizes.SizeError as exc:
            raise _custom(f"{exc}; {use}") from None
        if sizes.is_bare_integer(value) and budget <= SMALL_BUDGET_MAX:  # 1 meant as 100%, 90 as 90%
            raise _custom(small_budget_problem(value, budget, total))
        return budget

    return BeforeValidator(validate)


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise _custom(f"{value!r} is a boolean, not a number", add_hint=True)
    return value


def _hint(text: str) -> dict[str, str]:
    return {"hint": text}


DeviceBudget = Annotated[int | float | Literal["auto"], _budget_validator("device capacity")]
HostBudget = Annotated[int | float | Literal["auto"], _budget_validator("host RAM")]
SizeBytes = Annotated[int, _size_validator(_SIZE_USE)]
OptionalCapacityBytes = Annotated[
    int | None, _size_validator(_SIZE_USE + ", or null for the real device's capacity", positive=True, optional=True)
]
OptionalRateBytesPerS = Annotated[
    int | None, _size_validator(_RATE_USE + ", or null", per_second=True, positive=True, optional=True)
]
OptionalFlopPerS = Annotated[
    float | None, _number_validator(numbers.parse_flop_per_s, _FLOP_USE + ", or null", minimum=0, inclusive=False)
]
OptionalPositiveSeconds = Annotated[
    float | None, _number_validator(numbers.parse_seconds, _SECONDS_USE + ", or null", minimum=0, inclusive=False)
]
OptionalSeconds = Annotated[
    float | None, _number_validator(numbers.parse_seconds, _SECONDS_USE + ", or null", minimum=0, inclusive=True)
]
Count = Annotated[int, BeforeValidator(_no_bool), Strict()]  # "2" and 2.0 are mistakes in a config file


def _known_preset(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    name = value.strip().lower()
    if name not in KNOWN_PRESETS:
        close = difflib.get_close_matches(name, KNOWN_PRESETS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _custom(f"unknown preset {value!r}; {hint}known presets: {', '.join(KNOWN_PRESETS)}, or null for none")
    return name


PresetName = Annotated[str | None, BeforeValidator(_known_preset)]
Ratio = Annotated[float, BeforeValidator(_no_bool)]


class _Section(BaseModel):
    """Strict sections whose errors, also on assignment, are ConfigErrors naming the setting."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError.from_validation_error(exc, model=type(self)) from None

    # Tell pydantic this __init__ only wraps BaseModel.__init__: nested and model_validate() validation
    # then bypass it and keep pydantic's structured errors (tests/test_config.py checks both paths).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        before = self.__dict__.get(name)
        was_set = name in self.model_fields_set
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            if name in type(self).model_fields:  # a model validator may fail after the value was stored
                self.__dict__[name] = before
                if not was_set:
                    self.model_fields_set.discard(name)
            raise ConfigError.from_validation_error(exc, model=type(self)) from None


class ProfilerConfig(_Section):
    """When to profile and how to decide that the operator sequence changed (paper's Algorithm 1)."""

    warmup_iterations: Count = Field(
        2, ge=0, description="Detailed-profiling iterations after a start or a sequence change.",
        json_schema_extra=_hint("use a whole number >= 0 (e.g. 2)"),
    )
    policy_trials: Count = Field(
        5, ge=1, description="Candidate policies generated and tried; the fastest that fits is kept.",
        json_schema_extra=_hint("use a whole number >= 1 (e.g. 5)"),
    )
    trial_margin: Ratio = Field(
        0.03, ge=0, lt=1, description="Trials whose measured iteration times are within this fraction of the "
        "fastest count as equally fast: the one that swaps less is kept, and a close pair is tried again (0 with "
        "a fixed device.host_op_s: the emulated device's times then repeat exactly).",
        json_schema_extra=_hint("use a fraction in [0, 1) such as 0.03"),
    )
    trial_repeats: Count = Field(
        2, ge=0, description="Extra GenPolicy iterations that may try a close pair of trials again before "
        "Stable (none with a fixed device.host_op_s: the emulated device's times then repeat exactly).",
        json_schema_extra=_hint("use a whole number >= 0 (e.g. 2)"),
    )
    length_change: Ratio = Field(
        0.05, gt=0, lt=1, description="Relative change that counts: the number of ops and the bytes saved for "
        "backward both changing by it is a new program (sequence_changed, a new policy); the saved bytes alone, "
        "rescaled; the ops alone, rerouted (the policy applies).",
        json_schema_extra=_hint("use a fraction in (0, 1) such as 0.05"),
    )
    cosine_threshold: Ratio = Field(
        0.95, gt=0, le=1, description="Sequence signatures less cosine-similar than this count as a change.",
        json_schema_extra=_hint("use a number in (0, 1] such as 0.95"),
    )


# Settings only the emulated device reads: it models compute, a real device just computes.
EMULATED_ONLY_SETTINGS: tuple[str, ...] = ("peak_flop_per_s", "memory_bytes_per_s", "launch_latency_s", "host_op_s")


class DeviceConfig(_Section):
    """Which device to run on and, for the emulated device, its size, host link and compute model.

    The emulated device is a simulated GPU: each op occupies its stream for a roofline cost, ``max(FLOPs /
    peak_flop_per_s, bytes moved / memory_bytes_per_s) + launch_latency_s``, on a device clock that lags
    the host. ``preset`` supplies every figure; a setting given beside it overrides the preset's figure.
    Without a preset the compute figures are this CPU's measured rates and the link is as set.
    """

    kind: Literal["auto", "cuda", "emulated"] = Field(
        "auto", description='"cuda", "emulated" (CPU), or "auto" (CUDA when present).',
        json_schema_extra=_hint('use "auto", "cuda" or "emulated"'),
    )
    capacity: OptionalCapacityBytes = Field(
        None, description="Device memory in bytes; None = on CUDA, what is usable at start (free + reserved - reserve)."
    )
    h2d_bytes_per_s: OptionalRateBytesPerS = Field(
        None, description="Host-to-device bandwidth; None = the preset's (emulated), else instant; measured on CUDA.")
    d2h_bytes_per_s: OptionalRateBytesPerS = Field(
        None, description="Device-to-host bandwidth; None = the preset's (emulated), else instant; measured on CUDA.")
    preset: PresetName = Field(
        None, description=f"Named accelerator whose figures the emulated device uses: {', '.join(KNOWN_PRESETS)}.",
        json_schema_extra=_hint(f"use one of {', '.join(KNOWN_PRESETS)}, or null"),
    )
    # Accepted with every kind: the emulated device always raises at its capacity, so there it changes
    # nothing, and a config shared by GPU nodes and CPU CI (kind "auto") loads on both.
    enforce_capacity: bool = Field(
        False, strict=True, description="CUDA: make the caching allocator raise out-of-memory at the capacity "
        "(set_per_process_memory_fraction); the emulated device always does.",
        json_schema_extra=_hint("use true or false"),
    )
    peak_flop_per_s: OptionalFlopPerS = Field(
        None, description="Emulated device: peak FLOP/s for every dtype; None = the preset's per-dtype peaks, "
        "else this CPU's measured fp32 matmul rate.",
    )
    memory_bytes_per_s: OptionalRateBytesPerS = Field(
        None, description="Emulated device: memory bandwidth (bytes read + written per second); None = the "
        "preset's HBM figure, else this CPU's measured copy rate.",
    )
    launch_latency_s: OptionalPositiveSeconds = Field(
        None, description="Emulated device: device seconds added to every kernel; None = the preset's, else 3 us.",
    )
    host_op_s: OptionalSeconds = Field(
        None, description="Emulated device: host seconds per op; None = the host's measured time; a number "
        "makes runs reproducible.",
    )

    meta_tensors: bool = Field(
        False, strict=True, description="Emulated device: the model's parameters and activations are meta tensors "
        "(sizes, no data), for LLM shapes in simulation; memory and time are simulated from sizes.",
        json_schema_extra=_hint("use true or false"),
    )
    caching_allocator: bool = Field(False, strict=True, json_schema_extra=_hint("use true or false"), description=(
        "Emulated device: model the CUDA caching allocator (per-stream pools, segments); capacity bounds reserved."))
    expandable_segments: bool = Field(False, strict=True, json_schema_extra=_hint("use true or false"), description=(
        "Emulated device with caching_allocator: PyTorch's expandable_segments:True."))

    @model_validator(mode="after")
    def _compute_model_needs_emulated(self) -> "DeviceConfig":
        problem = device_setting_problem(self, EMULATED_ONLY_SETTINGS)
        if problem is not None:
            field, message = problem
            raise PydanticCustomError(CUSTOM_ERROR, "{message}", {"message": message, "field": field})
        return self


class ExecutorConfig(_Section):
    """How the swap executor behaves."""

    prefetch_depth: Count = Field(
        2, ge=0, description="Swapped tensors brought back ahead of their use in backward.",
        json_schema_extra=_hint("use a whole number >= 0 (e.g. 2)"),
    )
    max_oom_retries: Count = Field(
        3, ge=0, description="How often run_iteration tightens the policy and re-runs a step after an OOM.",
        json_schema_extra=_hint("use a whole number >= 0 (e.g. 3)"),
    )
    allow_recompute: bool = Field(
        True, strict=True, description="Policies may rebuild a saved tensor from its producer's inputs in backward instead of "
        "swapping it (exactly recomputable ops only); false = swap only.",
    )


class ChameleonConfig(_Section):
    """Everything Chameleon reads. Build it with :func:`chameleon_dist.config.load_config` or the
    ``from_*`` constructors; every problem is reported at once in one :class:`ConfigError`."""

    enabled: bool = Field(
        True, strict=True, description="Swap activations (False: only measure).",
        json_schema_extra=_hint("use true or false"),
    )
    memory_budget: DeviceBudget = Field("auto", description='Device memory to stay under; "auto" = 90% of capacity.')
    host_memory_budget: HostBudget = Field(
        "auto", description='Host memory for swapped tensors, per rank; "auto" = 50% of the node\'s RAM and a fraction '
        "a share of it, both divided among the node's ranks (LOCAL_WORLD_SIZE); bytes: per rank as written.",
    )
    min_swap_bytes: SizeBytes = Field(2**20, description="Tensors smaller than this are never swapped.")
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)

    @field_validator("device")
    @classmethod
    def _capacity_holds_budget(cls, device: DeviceConfig, info: ValidationInfo) -> DeviceConfig:
        """Checked here (not after the whole model) so that it is reported with any other problem."""
        problem = budget_over_total_problem(info.data.get("memory_budget"), device.capacity, "device.capacity",
                                            "memory_budget")
        if problem is not None:
            raise PydanticCustomError(CUSTOM_ERROR, "{message}", {"message": problem, "sibling": "memory_budget"})
        return device

    @model_validator(mode="after")
    def _budget_fits_capacity(self) -> "ChameleonConfig":
        """The same check when a setting is assigned after construction."""
        problem = budget_over_total_problem(self.memory_budget, self.device.capacity, "device.capacity",
                                            "memory_budget")
        if problem is not None:
            raise PydanticCustomError(CUSTOM_ERROR, "{message}", {"message": problem, "field": "memory_budget"})
        return self

    def memory_budget_bytes(self, capacity_bytes: int) -> int:
        """The device budget in bytes for a device of ``capacity_bytes`` (``config/budgets.py``)."""
        return device_budget_bytes(self.memory_budget, capacity_bytes)

    def host_memory_budget_bytes(self, host_total_bytes: int | None = None, local_ranks: int | None = None, *,
                                 pinned: bool = False, limits: HostLimits | None = None) -> int | None:
        """This rank's host budget in bytes (``host_share``). None when a share of the RAM is asked and the
        RAM cannot be read."""
        node = read_node(ram_bytes=host_total_bytes, local_ranks=local_ranks, limits=limits)
        return node.host_budget_bytes(self.host_memory_budget, pinned=pinned)

    def host_share(self, host_total_bytes: int | None = None, local_ranks: int | None = None, *,
                   pinned: bool = False, limits: HostLimits | None = None) -> HostShare:
        """``host_memory_budget`` for one rank, resolved by ``config/budgets.py`` from the machine read now:
        "auto" and fractions are of ``host_total_bytes`` (default: the smaller of this node's RAM and its
        cgroup's memory limit, from ``limits``, default read now: ``config/host_limits.py``) divided among
        ``local_ranks`` (default: ``LOCAL_WORLD_SIZE``, else 1), and, for a device that page-locks its host
        buffers (``pinned``: the CUDA device), at most ``RLIMIT_MEMLOCK``; a byte budget is per rank as written
        (``config/node.py``). The runtime reads the machine once at start instead (``read_node``)."""
        node = read_node(ram_bytes=host_total_bytes, local_ranks=local_ranks, limits=limits)
        return node.host_share(self.host_memory_budget, pinned=pinned)

    @classmethod
    def from_deepspeed_config(cls, ds_config: Any) -> "ChameleonConfig":
        """The ``"chameleon"`` block of a DeepSpeed config (a dict, a path to its JSON, or a DeepSpeedConfig);
        without one, ``ChameleonConfig(enabled=False)``. The given dict is never modified."""
        from chameleon_dist.config.loaders import config_from_deepspeed

        return config_from_deepspeed(ds_config)

    @classmethod
    def from_megatron_args(cls, args: "argparse.Namespace") -> "ChameleonConfig":
        """``--chameleon-config PATH`` with the ``--chameleon-*`` overrides (see ``add_megatron_args``)."""
        from chameleon_dist.config.megatron_args import config_from_megatron_args

        return config_from_megatron_args(args)


def validate_config(data: Any, *, source: str | Path | None = None, prefix: tuple[str, ...] = ()) -> ChameleonConfig:
    """``ChameleonConfig.model_validate(data)`` with every problem in one ConfigError."""
    try:
        return ChameleonConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError.from_validation_error(
            exc, source=None if source is None else str(source), model=ChameleonConfig, prefix=prefix
        ) from None
