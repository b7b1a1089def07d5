"""The simulated device the launch/ benchmarks run on, and the device-clock figures they report.

Every benchmark device is an ``EmulatedDevice`` built from an accelerator preset (``--preset``) at the
preset's real rates: each aten op occupies the compute stream for its roofline cost from the preset's peak
FLOP/s (per dtype: these models are fp32, so the preset's fp32 peak), HBM bandwidth and launch latency, and
each copy takes its bytes over the preset's real link rate (no scaling of the link to this CPU). The host
clock advances by a fixed ``--host-op-s`` per op (default ``DEFAULT_HOST_OP_S``: runs repeat exactly, on
any machine, under any load) or, with ``--host-op-s measured``, by the host's own measured time outside
the kernels (this CPU's Python, PyTorch's dispatch and Chameleon's hooks: it changes from run to run).
The measured host time restarts at each iteration's start (``restart_host_clock``: the benchmarks
interleave devices, and the others' work is not this device's host's); host work before a mark (an event)
lands before it, so the runtime's work before its iteration's start mark stays outside the iteration, as
on a GPU. It includes the simulated device's own bookkeeping per op (cost model, allocator, hazard checks)
and this CPU's cost of allocating and freeing tensors, so it overstates a real GPU host's time per op; the
plain loop pays that too, so the ratios show Chameleon's Python against the same base. Tensor work outside
``device.active()`` is not dispatched to the device: with a fixed cost it is free, measured it is host time.
A fixed cost charges every dispatched aten op alike, also those that launch no kernel (``detach``,
``empty``, ``set_``: the ones Chameleon's saved-tensor hooks add), which on a real host cost less than a
kernel launch.

Figures, all emulated, all in device seconds:

- iteration time: the runtime's ``last_report.iteration_s`` (a mark on the compute stream at the
  iteration's start and one at its end), or the same two marks around a loop without a runtime
  (``DeviceSpan``);
- compute busy: the device seconds the compute stream's kernels occupied it in the iteration
  (``compute_stream.busy_s`` after minus before);
- stall: ``device.stall_s()`` after minus before: the device seconds streams sat in ``wait_event`` on
  copies (the runtime's ``last_report.stall_s``);
- host-bound time: ``iteration - compute busy - stall``, the time in the iteration the compute stream had
  nothing queued and waited for the host to queue the next op (the device idle waiting for the host);
  its share of the iteration time is the **host-bound share**. (A few other waits would also land in it,
  e.g. a stream waiting on another compute stream; these benchmarks use one compute stream, and their
  copy waits are counted as stall.) Where it is large, the host's per-op cost sets the pace, and with
  ``--host-op-s measured`` that cost includes Chameleon's own Python;
- forward device time: the compute stream's busy seconds between a mark before the forward pass and one
  after the loss, in the unconstrained run (kernels only: the compute's shadow; the host-bound gaps are
  left out, so the figure is a property of the shape and the preset and is the same with every host
  cost). The forward's elapsed device time (the two marks apart, gaps included) is reported beside it;
- the **physical bound** = ``min(1, d2h_bytes_per_s x forward device time / saved activation bytes)``:
  the share of the saved bytes the link could move to the host in the forward's compute shadow;
  ``moved share`` = swap-out bytes per iteration / saved activation bytes is what a variant did move.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics

from chameleon_dist.device import DeviceModel, EmulatedDevice
from chameleon_dist.device.presets import PRESETS

DEFAULT_PRESET = "h100-pcie"
DEFAULT_HOST_OP_S = 2e-5  # 20 us of host work per op: a fixed figure, so that a default run repeats exactly
MEASURED = "measured"
MEASURED_WORDS = ("measured", "none", "null")


def host_op_s_value(text: str) -> float | None:
    """``--host-op-s``: seconds of host work per op (>= 0; 0 is a host that costs nothing), or "measured"
    (also "none", "null": the host's own measured time) -> None."""
    if text.strip().lower() in MEASURED_WORDS:
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--host-op-s takes seconds per op (e.g. 2e-5) or '{MEASURED}', got {text!r}")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"--host-op-s must be >= 0 seconds (or '{MEASURED}'), got {text!r}")
    return value


def link_rate_value(text: str) -> float:
    """``--d2h`` / ``--h2d``: bytes per second (> 0), e.g. 1e9."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a link rate takes bytes per second (e.g. 1e9), got {text!r}")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"a link rate must be > 0 bytes per second, got {text!r}")
    return value


def add_device_arguments(parser: argparse.ArgumentParser, preset: bool = True, link: bool = False) -> None:
    """``--preset`` (unless ``preset`` is False) and ``--host-op-s``; with ``link``, also ``--d2h`` and ``--h2d``
    (bytes per second, overriding the preset's link rate in that direction; ``make_device`` reads them)."""
    if preset:
        parser.add_argument("--preset", default=DEFAULT_PRESET, choices=[p.name for p in PRESETS],
                            help="accelerator the simulated device follows, at its real rates (default %(default)s)")
    parser.add_argument("--host-op-s", type=host_op_s_value, default=DEFAULT_HOST_OP_S, metavar="SECONDS|measured",
                        help="host seconds per op on the simulated device (default %(default)g: every run repeats "
                             f"exactly); '{MEASURED}' = the host's own measured time (changes from run to run)")
    if link:
        for direction in ("d2h", "h2d"):
            parser.add_argument(f"--{direction}", dest=f"{direction}_bytes_per_s", type=link_rate_value, default=None,
                                metavar="BYTES_PER_S",
                                help=f"{direction.upper()} link rate in bytes per second, e.g. 1e9 (default: the "
                                     "preset's real rate)")


def make_device(args: argparse.Namespace, capacity_bytes: int, preset: str | None = None,
                instant_link: bool = False) -> EmulatedDevice:
    """A simulated ``preset`` (default ``args.preset``) at its real rates with ``args.host_op_s`` (and the link
    rates ``args.d2h_bytes_per_s`` / ``args.h2d_bytes_per_s`` where given: ``add_device_arguments(link=True)``);
    ``instant_link``: the preset's compute with copies that take no time."""
    model = DeviceModel.resolve(preset=preset or args.preset, host_op_s=args.host_op_s,
                                d2h_bytes_per_s=getattr(args, "d2h_bytes_per_s", None),
                                h2d_bytes_per_s=getattr(args, "h2d_bytes_per_s", None))
    if instant_link:
        model = dataclasses.replace(model, h2d_bytes_per_s=None, d2h_bytes_per_s=None,
                                    sources=(*model.sources, "h2d/d2h_bytes_per_s: instant (--instant-link)"))
    return EmulatedDevice(capacity_bytes, model=model)


def host_text(host_op_s: float | None) -> str:
    return "measured host time per op (changes from run to run)" if host_op_s is None else \
        f"fixed host cost {host_op_s * 1e6:g} us per op (runs repeat exactly)"


def device_figures(args: argparse.Namespace, preset: str | None = None, instant_link: bool = False) -> dict:
    """The JSON block that says what the simulated device models (every figure emulated)."""
    model = make_device(args, 1, preset, instant_link).model
    return {"emulated": True, "preset": model.preset, "host_op_s": args.host_op_s,
            "host": host_text(args.host_op_s), "d2h_bytes_per_s": model.d2h_bytes_per_s,
            "h2d_bytes_per_s": model.h2d_bytes_per_s, "duplex_factor": model.duplex_factor,
            "peak_flop_per_s": model.peak_flop_per_s, "memory_bytes_per_s": model.memory_bytes_per_s,
            "launch_latency_s": model.launch_latency_s, "text": model.describe()}


def print_device(dev: dict) -> None:
    """A report's line for ``device_figures``' block."""
    print(f"ALL FIGURES EMULATED: {dev['text']}; {dev['host']}")


# ---- marks and deltas ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ClockMark:
    """The device's counters at one point (device seconds and bytes)."""

    compute_busy_s: float
    stall_s: float
    d2h_busy_s: float
    d2h_bytes: int
    h2d_busy_s: float
    h2d_bytes: int


def clock_mark(device: EmulatedDevice, stall: bool = True) -> ClockMark:
    """The counters now. ``stall`` False leaves the stall at 0: reading it resolves the stall's timing events
    (the host waits for them), which inside an iteration would change its timeline."""
    backend = device.backend
    return ClockMark(backend.compute_stream.busy_s, device.stall_s() if stall else 0.0, device.d2h.busy_s,
                     device.d2h.copied_bytes, device.h2d.busy_s, device.h2d.copied_bytes)


def clock_delta(device: EmulatedDevice, before: ClockMark, stall: bool = True) -> dict:
    """What the counters grew by since ``before`` (``clock_mark`` with the same ``stall``)."""
    after = clock_mark(device, stall)
    return {field.name: getattr(after, field.name) - getattr(before, field.name) for field in dataclasses.fields(ClockMark)}


def restart_host_clock(device: EmulatedDevice) -> None:
    """Before an iteration: with the measured host time, count only this iteration's host work (the benchmarks
    interleave several devices, and the wall time since this device's last op was spent on the others; the
    simulated device would otherwise put it on this iteration's first op). No effect with a fixed host cost."""
    device.backend.restart_host_measurement()


def host_bound_s(iteration_s: float, compute_busy_s: float, stall_s: float) -> float:
    """Device seconds of the iteration in which the compute stream waited for the host (see the module
    docstring); float rounding can leave a few nanoseconds below 0, reported as 0."""
    return max(0.0, iteration_s - compute_busy_s - stall_s)


def host_bound_share(iteration_s: float, compute_busy_s: float, stall_s: float) -> float:
    return host_bound_s(iteration_s, compute_busy_s, stall_s) / iteration_s if iteration_s > 0 else 0.0


def physical_bound(d2h_bytes_per_s: float | None, forward_device_s: float, saved_bytes: int) -> float:
    """``min(1, d2h_bytes_per_s x forward_device_s / saved_bytes)`` (1 for an instant link)."""
    if d2h_bytes_per_s is None or math.isinf(d2h_bytes_per_s) or saved_bytes <= 0:
        return 1.0
    return min(1.0, d2h_bytes_per_s * forward_device_s / saved_bytes)


class DeviceSpan:
    """Device time between two marks on the compute stream (``start`` now, ``stop`` later), with the
    compute-busy and stall deltas over the same span; the iteration or forward pass of a loop without a
    runtime, or a forward pass inside one."""

    def __init__(self, device: EmulatedDevice) -> None:
        self.device = device
        self.timer = device.timer()
        self.figures: dict = {}

    def start(self, stall: bool = True) -> "DeviceSpan":
        """Mark the start; ``stall`` False inside an iteration (see ``clock_mark``): the span's stall is then 0."""
        self._stall = stall
        self._before = clock_mark(self.device, stall)
        self._start = self.timer.mark()
        return self

    def stop(self) -> dict:
        """The span's figures. With ``stall`` (a loop's iteration end) the host first waits for the device, as
        the runtime's iteration end does; without it nothing is synchronised: the simulated device knows a
        mark's device time when it is recorded."""
        end = self.timer.mark()
        if self._stall:
            self.timer.resolve()
        elapsed_s = self.device.backend.elapsed_s(self._start, end)
        self.figures = {"elapsed_s": elapsed_s, **clock_delta(self.device, self._before, self._stall)}
        return self.figures


def iteration_figures(iteration_s: float, stall_s: float, delta: dict, device: EmulatedDevice | None = None) -> dict:
    """The per-iteration record's device-clock fields from a run's iteration time, stall and counter deltas;
    with ``device``, also ``device_ops``: the aten ops its last ``active()`` block dispatched (each one costs
    the host ``--host-op-s``; copies and swap-in allocations cost it too and are not counted here)."""
    ops = {} if device is None else {"device_ops": device.backend.op_index}
    return {**ops, "compute_busy_s": delta["compute_busy_s"], "d2h_busy_s": delta["d2h_busy_s"],
            "d2h_bytes": delta["d2h_bytes"], "h2d_bytes": delta["h2d_bytes"],
            "host_bound_s": host_bound_s(iteration_s, delta["compute_busy_s"], stall_s),
            "host_bound_share": host_bound_share(iteration_s, delta["compute_busy_s"], stall_s)}


def median_of(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if row.get(key) is not None]
    return statistics.median(values) if values else None


def host_bound_label(share: float | None) -> str:
    """How to read a host-bound share: "host-bound" when the device idled waiting for the host for more
    than half of the iteration (the host's pace, not the kernels', set its time)."""
    if share is None:
        return "-"
    return "host-bound" if share > 0.5 else "device-bound"
