"""``DeviceModel``: the figures the simulated device's clock is driven by.

A kernel's device time is a roofline: ``max(flops / peak_for(dtype), bytes_moved / memory_bytes_per_s)
+ launch_latency_s`` (see :mod:`chameleon_dist.device.cost`); a copy takes ``nbytes`` over the link rate
of its direction, each direction keeping ``duplex_factor`` of its rate while the other also copies; the
host spends ``host_op_s`` per op (None: its own measured time).

:meth:`DeviceModel.resolve` builds one from the ``device`` settings: a preset supplies every figure, an
explicit setting overrides the preset's figure, and without a preset the compute figures are this CPU's
measured rates (the link stays as given; None is an instant link).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from chameleon_dist.device.presets import AcceleratorPreset, get_preset

if TYPE_CHECKING:
    from chameleon_dist.config.schema import DeviceConfig

logger = logging.getLogger(__name__)

DEFAULT_DTYPE_KEY = "default"
# Without a preset: a GPU-like launch latency (the figure the NVIDIA presets use), and a link whose two
# directions do not slow each other (there is no real link to measure).
DEFAULT_LAUNCH_LATENCY_S = 3e-6
DEFAULT_DUPLEX_FACTOR = 1.0

_MATMUL_SIZE = 256
_COPY_ELEMENTS = 4 * 2**20  # 16 MiB of float32 (32 MiB with the copy): mostly beyond the caches
_MEASURE_EACH_S = 0.012
_WARMUP_STEPS = 3
_MIN_TIMED_STEPS = 8


def dtype_key(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bfloat16"``: the key of a dtype in ``DeviceModel.peak_flop_per_s``."""
    return str(dtype).removeprefix("torch.")


def _bad(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"device.{name} is {value!r}; it must be {rule}; change device.{name}")


def _positive_rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _bad(name, value, "a finite number above 0")
    return float(value)


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """The simulated device's figures; every rate is per second, every time in seconds.

    ``peak_flop_per_s`` maps dtype names (``"float32"``, ``"bfloat16"``, ...) and ``"default"`` (any
    other dtype) to peak FLOP/s. ``h2d_bytes_per_s``/``d2h_bytes_per_s`` None: an instant link.
    ``host_op_s`` None: the host's own measured time per op; a number: that many host seconds per op
    (reproducible runs). ``sources`` says where each figure comes from.
    """

    peak_flop_per_s: dict[str, float]
    memory_bytes_per_s: float
    launch_latency_s: float
    h2d_bytes_per_s: float | None = None
    d2h_bytes_per_s: float | None = None
    duplex_factor: float = DEFAULT_DUPLEX_FACTOR
    host_op_s: float | None = None
    preset: str | None = None
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.peak_flop_per_s, Mapping):
            raise _bad("peak_flop_per_s", self.peak_flop_per_s, "a mapping of dtype name to FLOP/s")
        peaks = {str(key): _positive_rate("peak_flop_per_s", value) for key, value in self.peak_flop_per_s.items()}
        if DEFAULT_DTYPE_KEY not in peaks:
            raise ValueError(f"device.peak_flop_per_s has no {DEFAULT_DTYPE_KEY!r} entry (the peak of any dtype "
                             f"not listed); add one or give device.peak_flop_per_s a single number")
        object.__setattr__(self, "peak_flop_per_s", peaks)  # a private copy: the caller's dict may change
        object.__setattr__(self, "memory_bytes_per_s", _positive_rate("memory_bytes_per_s", self.memory_bytes_per_s))
        object.__setattr__(self, "launch_latency_s", _positive_rate("launch_latency_s", self.launch_latency_s))
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _positive_rate(name, value))
        duplex = self.duplex_factor
        if isinstance(duplex, bool) or not isinstance(duplex, (int, float)) or not 0 < duplex <= 1:
            raise _bad("duplex_factor", duplex, "a fraction in (0, 1]")
        object.__setattr__(self, "duplex_factor", float(duplex))
        host = self.host_op_s
        if host is not None:
            if isinstance(host, bool) or not isinstance(host, (int, float)) or not math.isfinite(host) or host < 0:
                raise _bad("host_op_s", host, "a number of seconds >= 0, or null for the measured host time")
            object.__setattr__(self, "host_op_s", float(host))
        object.__setattr__(self, "sources", tuple(self.sources))

    def __hash__(self) -> int:  # (the peaks are a dict: hash their items)
        others = tuple(getattr(self, field.name) for field in dataclasses.fields(self)[1:])
        return hash((tuple(sorted(self.peak_flop_per_s.items())), *others))

    def peak_for(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype`` (the ``"default"`` figure for a dtype not listed)."""
        peaks = self.peak_flop_per_s
        return peaks.get(dtype_key(dtype), peaks[DEFAULT_DTYPE_KEY])

    def describe(self) -> str:
        def rate(value: float | None) -> str:
            return "instant" if value is None else f"{value / 1e9:.3g} GB/s"

        peaks = ", ".join(f"{key} {value / 1e12:.3g}" for key, value in self.peak_flop_per_s.items())
        host = "measured" if self.host_op_s is None else f"{self.host_op_s * 1e6:.3g} us per op"
        return (f"simulated device ({self.preset or 'this CPU'}): peak TFLOP/s {peaks}; memory "
                f"{self.memory_bytes_per_s / 1e9:.4g} GB/s; launch {self.launch_latency_s * 1e6:.3g} us; link H2D "
                f"{rate(self.h2d_bytes_per_s)}, D2H {rate(self.d2h_bytes_per_s)} (duplex {self.duplex_factor:.2f}); "
                f"host {host} (emulated)")

    @classmethod
    def resolve(
        cls,
        preset: str | AcceleratorPreset | None = None,
        peak_flop_per_s: float | Mapping[str, float] | None = None,
        memory_bytes_per_s: float | None = None,
        launch_latency_s: float | None = None,
        h2d_bytes_per_s: float | None = None,
        d2h_bytes_per_s: float | None = None,
        host_op_s: float | None = None,
        cpu_rates: tuple[float, float] | None = None,
        duplex_factor: float | None = None,
    ) -> "DeviceModel":
        """The model for these settings: the preset's figures, each explicit setting overriding its figure.

        A single ``peak_flop_per_s`` number replaces every dtype's peak; a mapping replaces the dtypes it
        names. Without a preset, a compute figure left None is this CPU's measured rate
        (:func:`measure_cpu_rates`, or ``cpu_rates=(flop_per_s, copy_bytes_per_s)`` without measuring).
        """
        chosen = get_preset(preset) if isinstance(preset, str) else preset
        sources: list[str] = []
        if chosen is not None:
            peaks = chosen.dtype_peaks()
            memory, latency = chosen.memory_bytes_per_s, chosen.launch_latency_s
            if memory is None or latency is None:
                raise ValueError(f"device.preset {chosen.name!r} has no memory bandwidth or launch latency; "
                                 "set device.memory_bytes_per_s and device.launch_latency_s")
            h2d, d2h, duplex = chosen.h2d_bytes_per_s, chosen.d2h_bytes_per_s, chosen.duplex_factor
            sources.extend(f"{chosen.name}: {text}" for text in chosen.sources)
        else:
            partial_peaks = isinstance(peak_flop_per_s, Mapping) and DEFAULT_DTYPE_KEY not in peak_flop_per_s
            need_cpu = peak_flop_per_s is None or partial_peaks or memory_bytes_per_s is None
            cpu_flop, cpu_bytes = (cpu_rates or measure_cpu_rates()) if need_cpu else (math.nan, math.nan)
            peaks = {DEFAULT_DTYPE_KEY: cpu_flop}
            memory, latency = cpu_bytes, DEFAULT_LAUNCH_LATENCY_S
            h2d, d2h, duplex = None, None, DEFAULT_DUPLEX_FACTOR
            how = "given (cpu_rates)" if cpu_rates is not None else "measured"
            if peak_flop_per_s is None or partial_peaks:
                sources.append(f"peak_flop_per_s: this CPU's fp32 matmul rate, {how}, for every dtype")
            if memory_bytes_per_s is None:
                sources.append(f"memory_bytes_per_s: this CPU's memory copy rate (bytes read + written), {how}")
            if launch_latency_s is None:
                sources.append("launch_latency_s: default 3 us, the NVIDIA presets' figure")
            sources.append("h2d/d2h_bytes_per_s: no preset, as set (null: instant); duplex_factor: 1.0")
        explicit = {"peak_flop_per_s": peak_flop_per_s, "memory_bytes_per_s": memory_bytes_per_s,
                    "launch_latency_s": launch_latency_s, "h2d_bytes_per_s": h2d_bytes_per_s,
                    "d2h_bytes_per_s": d2h_bytes_per_s, "duplex_factor": duplex_factor, "host_op_s": host_op_s}
        over = " (overrides the preset)" if chosen is not None else ""
        sources.extend(f"{name}: set by device.{name}{over}" for name, value in explicit.items() if value is not None)
        if peak_flop_per_s is not None:
            if isinstance(peak_flop_per_s, Mapping):
                peaks = {**peaks, **peak_flop_per_s}
            else:
                peaks = {key: peak_flop_per_s for key in peaks} | {DEFAULT_DTYPE_KEY: peak_flop_per_s}
        return cls(
            peak_flop_per_s=peaks,
            memory_bytes_per_s=memory if memory_bytes_per_s is None else memory_bytes_per_s,
            launch_latency_s=latency if launch_latency_s is None else launch_latency_s,
            h2d_bytes_per_s=h2d if h2d_bytes_per_s is None else h2d_bytes_per_s,
            d2h_bytes_per_s=d2h if d2h_bytes_per_s is None else d2h_bytes_per_s,
            duplex_factor=duplex if duplex_factor is None else duplex_factor,
            host_op_s=host_op_s,
            preset=None if chosen is None else chosen.name,
            sources=tuple(sources),
        )

    @classmethod
    def from_config(cls, device: "DeviceConfig", cpu_rates: tuple[float, float] | None = None) -> "DeviceModel":
        """The model a config's ``device`` section describes (read by attribute: any object with its fields)."""
        return cls.resolve(
            preset=device.preset,
            peak_flop_per_s=getattr(device, "peak_flop_per_s", None),
            memory_bytes_per_s=getattr(device, "memory_bytes_per_s", None),
            launch_latency_s=getattr(device, "launch_latency_s", None),
            h2d_bytes_per_s=device.h2d_bytes_per_s,
            d2h_bytes_per_s=device.d2h_bytes_per_s,
            host_op_s=getattr(device, "host_op_s", None),
            cpu_rates=cpu_rates,
        )


def _rate_per_s(work: float, step, duration_s: float) -> float:
    """``work`` over the fastest of the ``step()`` calls made in about ``duration_s``: the machine's rate
    without the stalls of whatever else it runs meanwhile (a peak, as the presets' figures are)."""
    for _ in range(_WARMUP_STEPS):  # first touch of the pages, thread pool start, a kernel's first-call setup
        step()
    fastest_s = math.inf
    end_s = time.perf_counter() + duration_s
    steps = 0
    while True:
        start_s = time.perf_counter()
        step()
        now_s = time.perf_counter()
        fastest_s = min(fastest_s, now_s - start_s)
        steps += 1
        # at least a few timed steps: in a fresh process the first calls can be many times slower (measured:
        # 2.4 GFLOP/s right after start against 170 GFLOP/s a moment later on this 2-core machine)
        if now_s >= end_s and steps >= _MIN_TIMED_STEPS:
            return work / max(fastest_s, 1e-9)


def measure_cpu_rates(duration_s: float = _MEASURE_EACH_S) -> tuple[float, float]:
    """This CPU's ``(fp32 matmul FLOP/s, memory copy bytes/s)``, about ``duration_s`` each (~50 ms in all).

    The copy rate counts the bytes read plus the bytes written, as the cost model's ``bytes_moved`` does.
    """
    # (not randn: measuring must leave the global random generator, and so dropout masks, as it was)
    a = torch.full((_MATMUL_SIZE, _MATMUL_SIZE), 0.5)
    b = torch.full((_MATMUL_SIZE, _MATMUL_SIZE), 0.25)
    flop_per_s = _rate_per_s(2 * _MATMUL_SIZE**3, lambda: torch.mm(a, b), duration_s)
    src = torch.ones(_COPY_ELEMENTS)
    dst = torch.empty_like(src)
    copy_bytes_per_s = _rate_per_s(2 * src.numel() * src.element_size(), lambda: dst.copy_(src), duration_s)
    logger.info("this CPU: fp32 matmul %.1f GFLOP/s, memory copy %.1f GB/s (measured in %.0f ms)",
                flop_per_s / 1e9, copy_bytes_per_s / 1e9, 2e3 * duration_s)
    return flop_per_s, copy_bytes_per_s
