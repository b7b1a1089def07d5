"""``EmulatedDevice``: the CPU stand-in for an accelerator (tests, demo, CI). Every figure it reports is
emulated: memory is metered exactly (see ``meter``), copies take ``nbytes / bandwidth`` seconds on worker
threads (see ``link``), and out-of-memory errors are raised where a device of ``capacity_bytes`` would
raise them. Real overlap on silicon is the one thing it cannot show."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Iterator

import torch
from torch import nn

from chameleon_dist.device.base import HostTimer, PressureHandler, byte_view
from chameleon_dist.device.host_pool import HostBufferPool
from chameleon_dist.device.link import EmulatedCopyHandle, EmulatedLink
from chameleon_dist.device.meter import StorageMeter
from chameleon_dist.device.presets import LinkCalibration, calibrate
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)


class EmulatedDevice:
    """A metered CPU "device" with an emulated host link.

    ``preset`` (e.g. "ascend-910b") scales both link directions to this CPU's measured matmul rate so that
    the compute-to-transfer ratio matches that accelerator; it cannot be combined with explicit
    bandwidths. ``cpu_flop_per_s`` skips the start-up measurement (tests). A direction built without a
    bandwidth (``None``) is an instant link: its ``*_bytes_per_s`` property reads ``math.inf``."""

    emulated = True

    def __init__(
        self,
        capacity_bytes: int,
        h2d_bytes_per_s: float | None = None,
        d2h_bytes_per_s: float | None = None,
        preset: str | None = None,
        host_memory_budget_bytes: int | None = None,
        cpu_flop_per_s: float | None = None,
    ) -> None:
        self.calibration: LinkCalibration | None = None
        if preset is not None:
            if h2d_bytes_per_s is not None or d2h_bytes_per_s is not None:
                raise ValueError("device.preset sets the link bandwidth: remove device.h2d_bytes_per_s/d2h_bytes_per_s")
            self.calibration = calibrate(preset, cpu_flop_per_s)
            h2d_bytes_per_s = self.calibration.h2d_bytes_per_s
            d2h_bytes_per_s = self.calibration.d2h_bytes_per_s
        self.capacity_bytes = int(capacity_bytes)
        self.name = f"emulated ({format_bytes(self.capacity_bytes)}" + (f", {preset} link)" if preset else ")")
        self.meter = StorageMeter(self.capacity_bytes)
        self.h2d = EmulatedLink("h2d", h2d_bytes_per_s)
        self.d2h = EmulatedLink("d2h", d2h_bytes_per_s)
        self.host_pool = HostBufferPool(host_memory_budget_bytes)
        self._stall_s = 0.0
        self._stall_lock = threading.Lock()

    # ---- link -------------------------------------------------------------------------------
    @property
    def d2h_bytes_per_s(self) -> float:
        """The emulated device-to-host link's bandwidth; ``math.inf`` for an instant link."""
        return _link_bytes_per_s(self.d2h)

    @property
    def h2d_bytes_per_s(self) -> float:
        """The emulated host-to-device link's bandwidth; ``math.inf`` for an instant link."""
        return _link_bytes_per_s(self.h2d)

    # ---- accounting -------------------------------------------------------------------------
    def live_bytes(self) -> int:
        return self.meter.live_bytes

    def peak_bytes(self) -> int:
        return self.meter.peak_bytes

    def reset_peak(self) -> None:
        self.meter.reset_peak()

    def stall_s(self) -> float:
        return self._stall_s

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Meter every op of the iteration on this thread (and of its backward pass)."""
        self.meter.op_index = 0
        with self.meter:
            yield

    def track_module(self, module: nn.Module) -> None:
        for tensor in list(module.parameters()) + list(module.buffers()):
            self.meter.track(tensor)

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a tensor made outside an iteration (e.g. a batch moved "to the device")."""
        self.meter.track(tensor)
        return tensor

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and self.meter.is_tracked(tensor.untyped_storage())

    # ---- copies -----------------------------------------------------------------------------
    def copy_to_host(self, storage: torch.UntypedStorage) -> EmulatedCopyHandle | None:
        with self.meter.paused():
            host = self.host_pool.acquire(storage.nbytes())
        if host is None:
            return None
        return self.d2h.copy(byte_view(storage), host)

    def copy_to_device(self, host: torch.Tensor, after: EmulatedCopyHandle | None = None) -> EmulatedCopyHandle:
        if after is not None and self.h2d.bytes_per_s is None:
            self.wait(after)  # an instant link copies on this thread: the swap-out must have landed
            after = None
        destination = torch.empty(host.numel(), dtype=torch.uint8)  # metered: may raise out-of-memory
        self.meter.track(destination)  # counted even when called outside an iteration
        return self.h2d.copy(host, destination, after)

    def wait(self, handle: EmulatedCopyHandle) -> torch.Tensor:
        if not handle.done():
            start_s = time.perf_counter()
            handle.wait()
            with self._stall_lock:
                self._stall_s += time.perf_counter() - start_s
        elif handle.error is not None:
            handle.wait()
        return handle.result

    def release_host(self, host: torch.Tensor) -> None:
        """At once: here ``wait`` blocks until the copy has completed (NOTE [Release after copy])."""
        self.host_pool.release(host)

    def release_all_sources(self) -> int:
        """Nothing to do: the link lets go of each source the moment its copy completes, never before (see
        NOTE [Release after copy] in ``device/base.py``)."""
        return 0

    def release_completed_sources(self) -> int:
        """Nothing to do: the link already let go of every source whose copy has completed."""
        return 0

    def set_pressure_handler(self, handler: PressureHandler | None) -> None:
        self.meter.pressure_handler = handler

    def timer(self) -> HostTimer:
        """The host clock: the emulated device's compute runs on the training thread as it is issued."""
        return HostTimer()

    def random_state(self) -> None:
        """Emulated "device" tensors are CPU tensors: they draw from the CPU generator."""
        return None

    def set_random_state(self, state: torch.Tensor) -> None:
        raise ValueError("the emulated device has no random generator of its own (random_state() is None)")

    def synchronize(self) -> None:
        for link in (self.d2h, self.h2d):
            start_s = time.perf_counter()
            link.drain()
            with self._stall_lock:
                self._stall_s += time.perf_counter() - start_s


def _link_bytes_per_s(link: EmulatedLink) -> float:
    return math.inf if link.bytes_per_s is None else float(link.bytes_per_s)
