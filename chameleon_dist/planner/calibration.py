"""Calibration files: measured (or simulated) per-layer times and link and collective rates that replace the
hardware profile's figures in the planner's cost model (``chameleon-plan --calibration FILE``).

A calibration file (JSON or YAML, ``"format": 1``) says where its figures come from (``source``:
``"simulated: <preset>"`` or ``"measured: <GPU>"``), the shape they were taken at (``shape``: the model
profile, ``seq_length``, ``micro_batch``, ``tp``; optionally ``num_layers``, ``attention``, ``precision``) and
any of: ``layer_forward_s`` and ``layer_backward_s`` (one transformer layer, one micro-batch, one rank),
``head_forward_s`` and ``head_backward_s`` (the work after the last layer: final norm, output layer, loss),
``optimizer_step_s`` (one step of the shape's model on one rank, no data-parallel sharding),
``h2d_bytes_per_s``, ``d2h_bytes_per_s``, ``h2d_concurrent_bytes_per_s`` (pinned host link) and
``intra_node_bus_bytes_per_s``, ``inter_node_bus_bytes_per_s`` (collective bus bandwidths, nccl-tests busbw).
Rates take the project's size strings ("25GB/s"). A missing key keeps the hardware profile's value; unknown
keys and bad values are one :class:`~chameleon_dist.config.ConfigError` naming each key.

How it is applied (:func:`apply_calibration`): the layer's forward FLOPs at the calibration's shape
(``timing.layer_flops``) over ``tp x layer_forward_s`` is the device's effective FLOP rate, kept as the
profile's ``efficiency`` against its peak (a rate above the peak is an error: the file does not belong to
that hardware profile); ``layer_backward_s / layer_forward_s`` replaces the fixed 2x of backward over forward.
The head's rate and ratio are calibrated the same way from the output layer's FLOPs. The optimizer step
sets the device-memory bandwidth its model reads (``timing.optimizer_s``). At any other shape (sequence,
micro-batch, TP, model) the calibrated rates stay fixed and times scale with FLOPs (and bytes): what the
planner's FLOP model leaves out (memory-bound ops, kernels that run below the measured rate at other sizes)
is carried in the rate only in the proportion it had at the calibration's shape.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from chameleon_dist.config import ConfigError, read_mapping
from chameleon_dist.planner.layout import Layout
from chameleon_dist.planner.profiles import BytesPerS, HardwareProfile, ModelProfile, load_model, make_setup
from chameleon_dist.planner.timing import head_flops, layer_flops, optimizer_s

logger = logging.getLogger(__name__)

FORMAT = 1
SOURCE_KINDS = ("simulated", "measured")

_RATE_KEYS = ("h2d_bytes_per_s", "d2h_bytes_per_s", "h2d_concurrent_bytes_per_s", "intra_node_bus_bytes_per_s",
              "inter_node_bus_bytes_per_s")
_TIME_KEYS = ("layer_forward_s", "layer_backward_s", "head_forward_s", "head_backward_s", "optimizer_step_s")


class CalibrationShape(BaseModel):
    """Where the times were taken: a model profile (shipped name or file) at this sequence, micro-batch and TP."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    seq_length: PositiveInt
    micro_batch: PositiveInt = 1
    tp: PositiveInt = 1
    num_layers: PositiveInt | None = None  # for optimizer_step_s (None: the profile's)
    attention: Literal["flash", "unfused"] = "flash"
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"


class Calibration(BaseModel):
    """One calibration file (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1]
    source: str
    shape: CalibrationShape | None = None
    layer_forward_s: float | None = Field(None, gt=0)
    layer_backward_s: float | None = Field(None, gt=0)
    head_forward_s: float | None = Field(None, gt=0)
    head_backward_s: float | None = Field(None, gt=0)
    optimizer_step_s: float | None = Field(None, gt=0)
    h2d_bytes_per_s: BytesPerS | None = None
    d2h_bytes_per_s: BytesPerS | None = None
    h2d_concurrent_bytes_per_s: BytesPerS | None = None
    intra_node_bus_bytes_per_s: BytesPerS | None = None
    inter_node_bus_bytes_per_s: BytesPerS | None = None
    command: str = ""  # how the file was produced
    notes: str = ""

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        kind, _, what = value.partition(":")
        if kind.strip() not in SOURCE_KINDS or not what.strip():
            raise ValueError(f"{value!r}: write 'simulated: <preset>' or 'measured: <GPU>'")
        return value

    @property
    def kind(self) -> str:
        """``simulated`` or ``measured``."""
        return self.source.partition(":")[0].strip()

    def given(self) -> list[str]:
        """The figures this file sets."""
        return [key for key in _TIME_KEYS + _RATE_KEYS if getattr(self, key) is not None]


def calibration_from_mapping(data: dict[str, Any], source: str | None = None) -> Calibration:
    """A validated :class:`Calibration`; problems are one ConfigError naming each key. The shape's model
    profile must load."""
    if "format" not in data:
        raise ConfigError([f'format: missing; a calibration file starts with "format": {FORMAT}'], source=source)
    if type(data["format"]) is not int or data["format"] != FORMAT:
        raise ConfigError([f"format: {data['format']!r} is not a calibration format this planner reads "
                           f"(it reads format {FORMAT})"], source=source)
    try:
        calibration = Calibration.model_validate(data)
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, source=source, model=Calibration) from None
    problems = []
    for later, first in (("layer_backward_s", "layer_forward_s"), ("head_backward_s", "head_forward_s")):
        if getattr(calibration, later) is not None and getattr(calibration, first) is None:
            problems.append(f"{later}: needs {first} too (the backward is calibrated as a ratio to the forward)")
    timed = [key for key in _TIME_KEYS if getattr(calibration, key) is not None]
    if timed and calibration.shape is None:
        problems.append(f"shape: missing; {', '.join(timed)} need the shape they were taken at "
                        "(shape: model, seq_length, micro_batch, tp)")
    if problems:
        raise ConfigError(problems, source=source)
    if calibration.shape is not None:
        shape_model(calibration.shape, source)
    return calibration


def load_calibration(path: str | Path) -> Calibration:
    """A calibration file (.json, .yaml or .yml)."""
    return calibration_from_mapping(read_mapping(path, what="calibration"), source=str(path))


def shape_model(shape: CalibrationShape, source: str | None = None) -> ModelProfile:
    """The shape's model profile (with ``num_layers`` layers when given)."""
    try:
        model = load_model(shape.model)
    except ConfigError as exc:
        problems = [f"shape.model: {problem.removeprefix('--model: ')}" for problem in exc.problems]
        raise ConfigError(problems, source=source) from None
    if shape.num_layers is not None and shape.num_layers != model.num_layers:
        model = ModelProfile.model_validate({**model.model_dump(), "num_layers": shape.num_layers,
                                             "name": f"{model.name}-{shape.num_layers}-layers"})
    return model


def apply_calibration(hardware: HardwareProfile, calibration: Calibration, source: str | None = None
                      ) -> HardwareProfile:
    """``hardware`` with the calibration's figures (module docstring); ``source`` names the file in errors."""
    changes: dict[str, Any] = {key: getattr(calibration, key) for key in _RATE_KEYS
                               if getattr(calibration, key) is not None}
    if calibration.h2d_bytes_per_s is not None and calibration.h2d_concurrent_bytes_per_s is None \
            and hardware.h2d_concurrent_bytes_per_s is not None:
        # (the profile's duplex slowdown, applied to the measured rate)
        duplex = hardware.h2d_concurrent_bytes_per_s / hardware.h2d_bytes_per_s
        changes["h2d_concurrent_bytes_per_s"] = calibration.h2d_bytes_per_s * duplex
    shape = calibration.shape
    if shape is not None:
        model = shape_model(shape, source)
        setup = make_setup(global_batch_size=shape.micro_batch, seq_length=shape.seq_length,
                           precision=shape.precision, attention=shape.attention)
        if calibration.layer_forward_s is not None:
            flops = layer_flops(model, setup, shape.micro_batch).forward_flops
            rate = flops / (shape.tp * calibration.layer_forward_s)
            _below_peak("layer_forward_s", calibration.layer_forward_s, flops, rate, shape, hardware, source)
            changes["efficiency"] = rate / hardware.peak_flops_per_s
            changes["gemm_half_efficiency_flops"] = 0.0  # the measured rate, at every shape (planner/efficiency.py)
            changes["attention_efficiency"] = None  # (the measured layer time holds its attention too)
            if calibration.layer_backward_s is not None:
                changes["backward_to_forward"] = calibration.layer_backward_s / calibration.layer_forward_s
        if calibration.head_forward_s is not None:
            flops = head_flops(model, setup, shape.micro_batch)
            rate = flops / (shape.tp * calibration.head_forward_s)
            _below_peak("head_forward_s", calibration.head_forward_s, flops, rate, shape, hardware, source)
            changes["head_flops_per_s"] = rate
            if calibration.head_backward_s is not None:
                changes["head_backward_to_forward"] = calibration.head_backward_s / calibration.head_forward_s
        if calibration.optimizer_step_s is not None:
            unit = hardware.model_copy(update={"memory_bytes_per_s": 1.0})  # (1 B/s: the step's bytes in seconds)
            step_bytes = optimizer_s(model, unit, setup, Layout(micro_batch=shape.micro_batch, tp=shape.tp))
            changes["memory_bytes_per_s"] = step_bytes / calibration.optimizer_step_s
    changes["description"] = f"{hardware.description}; calibrated ({calibration.source})".lstrip("; ")
    # a calibrated figure is measured (or simulated), no longer an assumption: its range goes
    changes["assumed"] = {k: v for k, v in hardware.assumed.items() if k not in changes}
    try:
        calibrated = HardwareProfile.model_validate({**hardware.model_dump(), **changes})
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, source=source, model=HardwareProfile) from None
    logger.info("calibrated %s from %s: %s", hardware.name, source or "a calibration", ", ".join(calibration.given()))
    return calibrated


def _below_peak(key: str, seconds: float, flops: float, rate: float, shape: CalibrationShape,
                hardware: HardwareProfile, source: str | None) -> None:
    if rate > hardware.peak_flops_per_s:
        raise ConfigError([
            f"{key}: {seconds:g} s for {flops / 1e12:.2f} TFLOP ({shape.model}, seq {shape.seq_length}, micro-batch "
            f"{shape.micro_batch}, TP {shape.tp}) is {rate / 1e12:.1f} TFLOP/s per device, above {hardware.name}'s "
            f"peak {hardware.peak_flops_per_s / 1e12:.1f}: pass the --hardware it was taken on, or check its shape"],
            source=source)


def describe(before: HardwareProfile, after: HardwareProfile) -> list[str]:
    """One line per figure the calibration changed, old -> new."""
    lines = []
    if after.efficiency != before.efficiency:
        lines.append(f"layer compute {before.effective_flops_per_s / 1e12:.1f} -> "
                     f"{after.effective_flops_per_s / 1e12:.1f} TFLOP/s effective "
                     f"({after.efficiency:.1%} of the {after.peak_flops_per_s / 1e12:.0f} TFLOP/s peak)")
    for key, label in (("backward_to_forward", "layer backward / forward"),
                       ("head_backward_to_forward", "head backward / forward")):
        if getattr(after, key) != getattr(before, key):
            lines.append(f"{label} {getattr(before, key):.2f} -> {getattr(after, key):.2f}")
    if after.head_flops_per_s != before.head_flops_per_s:
        lines.append(f"head compute {(before.head_flops_per_s or before.effective_flops_per_s) / 1e12:.1f} -> "
                     f"{after.head_flops_per_s / 1e12:.1f} TFLOP/s")
    for key in ("memory_bytes_per_s",) + _RATE_KEYS:
        old, new = getattr(before, key), getattr(after, key)
        if new != old:
            old_text = "unset" if old is None else f"{old / 1e9:.1f}"
            lines.append(f"{key.removesuffix('_bytes_per_s')} {old_text} -> {new / 1e9:.1f} GB/s")
    return lines


__all__ = ["FORMAT", "Calibration", "CalibrationShape", "apply_calibration", "calibration_from_mapping", "describe",
           "load_calibration", "shape_model"]
