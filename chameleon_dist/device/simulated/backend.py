"""``SimulatedBackend``: the backend of the emulated device (NOTE [One device code path] in
``device/backend.py``). Tensors are CPU tensors computed eagerly; time follows the device clock (NOTE [The
simulated device clock] in ``clock.py``), memory the caching allocator (``memory.py``), and every access is
checked for stream hazards (NOTE [Stream hazards] in ``hazards.py``). It never sleeps."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Iterator

import torch

from chameleon_dist.device.cost import KernelCostModel
from chameleon_dist.device.leaves import tensor_leaves
from chameleon_dist.device.locking import SharedLock
from chameleon_dist.device.model import DeviceModel
from chameleon_dist.device.simulated.clock import DeviceClock, SimEvent, SimStream, link_pair
from chameleon_dist.device.simulated.engine import EngineStreams
from chameleon_dist.device.simulated.hazards import HazardChecker
from chameleon_dist.device.simulated.meta import FusedAttentionChoice, meta_host_buffer
from chameleon_dist.device.simulated.memory import FRESH_FROM_DATA, SimAllocator, storage_key

# NOTE [Meta tensors]
# ~~~~~~~~~~~~~~~~~~~
# With ``meta_tensors`` the device's tensors are meta tensors: sizes, strides and storages, no data. Everything
# above the backend runs unchanged (profiler, policy, executor, hazard checker), because nothing there reads
# data: a storage is known by its identity (``storage_key``, the StorageImpl, never a data pointer, which is 0
# on meta), memory is metered from storage sizes, a kernel's time from its shapes, and a copy between a meta
# device block and a meta host buffer moves no bytes but occupies its link for the bytes' time. So an LLM's
# shapes run through the same code as a small real model, and take the same decisions (a test runs one model
# both ways). Attention takes the fused kernel the real run takes (``meta.py``: on meta, torch would take the
# math path). What cannot run on meta is what reads values: ``.item()``, ``nonzero`` and other outputs whose
# shape depends on data (an MoE's routing must come from elsewhere), finiteness checks, and bit-identity.

_aten = torch.ops.aten
# ops that allocate or relabel memory but launch no kernel on a GPU
_NO_KERNEL = frozenset({
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.set_.source_Storage, _aten.set_.source_Storage_storage_offset,
    _aten.set_.source_Tensor, _aten.set_.default, _aten.lift_fresh.default,
})


def _strided(leaves, device_type: str) -> list[torch.Tensor]:
    """The strided tensors among ``leaves`` that live on ``device_type`` (the emulated device's tensors)."""
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.layout == torch.strided
            and t.device.type == device_type]


class HostWork:
    """The host's own work between kernels, on the device clock's host side: the wall time measured since the
    last mark (``host_op_s`` None), or a fixed cost per call."""

    def __init__(self, clock: DeviceClock, host_op_s: float | None) -> None:
        self.clock = clock
        self.host_op_s = host_op_s
        self.wall_mark_s = time.perf_counter()

    @property
    def measured(self) -> bool:
        return self.host_op_s is None

    def count(self) -> None:
        """The host did its own work since the last kernel: measured, or a fixed cost per call."""
        if self.host_op_s is None:
            self.count_measured()
        else:
            self.clock.advance_host(self.host_op_s)

    def count_measured(self) -> None:
        """The wall time since the mark, counted as host work; the mark moves to now."""
        now_s = time.perf_counter()
        self.clock.advance_host(now_s - self.wall_mark_s)
        self.wall_mark_s = now_s

    def restart(self) -> None:
        """Count from now on (the wall time since the mark was not host work)."""
        self.wall_mark_s = time.perf_counter()


class SimulatedBackend:
    """A GPU's streams, clock and allocator over CPU tensors (see the module docstring).

    Args:
        capacity_bytes: device memory; an allocation past it raises ``torch.OutOfMemoryError``.
        model: the figures of the modelled accelerator (``DeviceModel``: roofline rates, launch latency,
            link rates, host cost per op or None for the measured host time).
        check_hazards: raise ``StreamHazardError`` on a racing access (on by default; NOTE [Stream hazards]).
        meta_tensors: the device's tensors are meta tensors (sizes, no data: NOTE [Meta tensors]).
        caching_allocator: blocks live in the caching allocator's segments and per-stream pools, and the capacity
            bounds the reserved bytes (NOTE [The caching allocator model] in ``caching.py``); off: every block
            is its own segment (no fragmentation).
        expandable_segments: with the caching model, each stream's pool grows one segment by pages.

    ``op_times_s``: an optional per-op observer, None (off, the default) or a list to which every op that
    completes through ``run_op`` appends its kernel's device seconds, in the order the ops ran: 0.0 for an op
    that launches no kernel and for one run on the host side (``host_side``); an op that ran out of memory
    appends nothing (its retry does). It sees every op of the dispatch, the ones a profiler above it hides
    (the swap executor's own) too: ``launch/scale_eq1.py`` lines it up with a ``StepTrace``'s ops.
    """

    emulated = True
    name = "simulated"

    def __init__(self, capacity_bytes: int, model: DeviceModel, check_hazards: bool = True,
                 meta_tensors: bool = False, caching_allocator: bool = False, expandable_segments: bool = False) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.meta_tensors = bool(meta_tensors)
        self.model = model
        self.clock = DeviceClock()
        # the clock's lock, over the counters and hazard checks too; the device's lock is this one (NOTE [Threads and
        # locks] in device/locking.py): ops from several threads (autograd's, a joined one) share the device
        # (per op and copy the backend takes the plain ``clock.lock``; the device's entry points run deferred work)
        self.lock = SharedLock(self.clock.lock)
        self.compute_stream = SimStream(self.clock, "compute")
        self.engine = EngineStreams(self.compute_stream, self._record_crossing)  # NOTE [Backward on its forward's stream]
        self.h2d_link, self.d2h_link = link_pair(model.h2d_bytes_per_s, model.d2h_bytes_per_s, model.duplex_factor)
        self.hazards = HazardChecker(check_hazards)
        self.allocator = SimAllocator(self.capacity_bytes, self.hazards, caching=caching_allocator,
                                      expandable_segments=expandable_segments)
        self.cost = KernelCostModel(model)
        self.op_index = 0  # device ops of the current iteration (in out-of-memory messages)
        self.kernels = 0
        self.kernel_busy_s = 0.0  # device seconds the compute streams ran kernels
        self.op_times_s: list[float] | None = None  # per-op observer (class docstring); None: off
        self._host = HostWork(self.clock, model.host_op_s)
        self._local = threading.local()
        self._stream_numbers = itertools.count(1)

    @property
    def tensor_device(self) -> str:
        """The torch device type of the emulated device's tensors: "meta" with ``meta_tensors``, else "cpu"."""
        return "meta" if self.meta_tensors else "cpu"

    # ---- the host clock ---------------------------------------------------------------------
    def host_time_s(self) -> float:
        """The host's clock (simulated: the work counted so far)."""
        return self.clock.host_s

    def restart_host_measurement(self) -> None:
        """With the measured host time (``host_op_s`` None), count the host's work from now on: the wall time
        since the mark was not its host's work (the CPU's eager computation of a kernel; a benchmark that
        interleaves several devices ran the others meanwhile: without this, that time lands on this device's
        next op). A fixed host cost per op is unaffected."""
        self._host.restart()

    # ---- streams and events -----------------------------------------------------------------
    def current_stream(self) -> SimStream:
        """The stream work is queued on now: the one entered with ``use_stream``, else, in backward, the running
        node's forward stream (NOTE [Backward on its forward's stream] in ``engine.py``), else the compute stream."""
        return self.engine.current()

    def new_stream(self, name: str | None = None) -> SimStream:
        return SimStream(self.clock, name or f"side-{next(self._stream_numbers)}")

    def use_stream(self, stream: SimStream):
        return self.engine.use(stream)

    def new_event(self, timing: bool = False) -> SimEvent:
        """An event, recorded by the caller at host time. With the measured host time, the host's work up to
        now is counted first, as a GPU's host reaches its ``record`` only after that work: an iteration's start
        mark then follows the host's work before the iteration (e.g. the runtime's gradient snapshot), which
        would otherwise land on the iteration's first op, inside it."""
        if self._host.measured:
            self._host.count_measured()
        return SimEvent(self.clock, timing)

    def elapsed_s(self, start: SimEvent, end: SimEvent) -> float:
        return start.elapsed_s(end)

    def synchronize(self) -> None:
        self.clock.refuse_under_capture("the device was synchronised")
        self.clock.wait_for(self.clock.device_idle_s())

    def is_capturing(self) -> bool:
        return self.clock.capturing

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """A simulated CUDA graph capture: ``is_capturing`` is true inside, and querying an event or waiting on
        the device raises ``GraphCaptureQueryError``, as CUDA refuses both during a capture (the ops themselves
        still run eagerly: only what the capture forbids is checked)."""
        clock = self.clock
        before, clock.capturing = clock.capturing, True
        try:
            yield
        finally:
            clock.capturing = before

    # ---- memory -----------------------------------------------------------------------------
    def live_bytes(self) -> int:
        return self.allocator.live_bytes

    def peak_bytes(self) -> int:
        return self.allocator.peak_bytes

    def reserved_bytes(self) -> int:
        """What ``memory_reserved`` would say (the caching model's segments; else ``live_bytes``)."""
        return self.allocator.reserved_bytes

    def fits(self, nbytes: int, stream: SimStream | None = None) -> bool:
        """Whether an allocation of ``nbytes`` on ``stream`` (default the current one) would succeed now."""
        return self.allocator.fits(nbytes, stream if stream is not None else self.current_stream())

    def reset_peak(self) -> None:
        self.allocator.reset_peak()

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.tensor_device and self.allocator.block_of(tensor.untyped_storage()) is not None

    def track(self, tensor: torch.Tensor) -> None:
        self.allocator.track(tensor.untyped_storage(), self.current_stream())

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        """``Tensor.record_stream``: the block's reuse waits for ``stream``'s work queued before its free."""
        block = self.allocator.block_of(tensor.untyped_storage())
        if block is not None:
            block.recorded = (block.recorded or set()) | {stream}

    def _record_crossing(self, tensor: torch.Tensor, stream: SimStream) -> None:
        """A gradient handed to a node on ``stream``: recorded there when its block belongs to another stream
        (the engine's input buffer on a GPU)."""
        block = self.allocator.block_of(tensor.untyped_storage())
        if block is not None and block.stream is not stream:
            block.recorded = (block.recorded or set()) | {stream}

    def host_allocator(self):
        """Plain CPU tensors (None: the pool's default); with meta tensors, meta host buffers (sizes only)."""
        return meta_host_buffer if self.meta_tensors else None

    @contextlib.contextmanager
    def host_side(self) -> Iterator[None]:
        before = getattr(self._local, "paused", False)
        self._local.paused = True
        try:
            yield
        finally:
            self._local.paused = before

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A swap-in's block on the current stream. As on a GPU, it is an ``aten.empty`` through the device's
        dispatch when one is active (its allocation, and an out-of-memory error, happen in ``run_op``);
        else it is counted here."""
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.tensor_device)
        if self.allocator.block_of(tensor.untyped_storage()) is None and nbytes > 0:
            self._host.count()
            self.allocator.allocate([tensor.untyped_storage()], self.current_stream(), "a swap-in's allocation",
                                    self.op_index)
        return tensor

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.op_index = 0
        with FusedAttentionChoice() if self.meta_tensors else contextlib.nullcontext():
            yield
        self.hazards.raise_pending()

    def random_state(self) -> None:
        """Emulated "device" tensors are CPU tensors: they draw from the CPU generator."""
        return None

    def set_random_state(self, state: torch.Tensor) -> None:
        raise ValueError("the emulated device has no random generator of its own (random_state() is None)")

    # ---- work ---------------------------------------------------------------------------------
    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """``destination.copy_(source)`` on the current stream: over the link when it crosses it, else a
        device-to-device kernel; the data is copied now (the hazard checker guards the timeline)."""
        with self.clock.lock:
            self._host.count()
            self.hazards.raise_pending()
            stream = self.current_stream()
            allocator = self.allocator
            source_block = (allocator.block_of(source.untyped_storage()) if source.device.type == self.tensor_device
                            else None)
            destination_block = allocator.block_of(destination.untyped_storage())
            nbytes = destination.numel() * destination.element_size()
            if source_block is not None and destination_block is None:
                start_s, end_s = self.d2h_link.copy(stream, nbytes)
            elif destination_block is not None and source_block is None:
                start_s, end_s = self.h2d_link.copy(stream, nbytes)
            else:
                start_s, end_s = stream.launch(2 * nbytes / self.model.memory_bytes_per_s + self.model.launch_latency_s)
            if source_block is not None:
                host_key = storage_key(destination.untyped_storage()) if destination_block is None else None
                self.hazards.access(source_block, stream, start_s, end_s, False, "a copy reading its source",
                                    copied_to=host_key)
            elif destination_block is not None:
                self.hazards.read_host(storage_key(source.untyped_storage()), "a host-to-device copy")
            if destination_block is not None:
                self.hazards.access(destination_block, stream, start_s, end_s, True, "a copy writing its destination")
            with self.host_side():
                destination.copy_(source)
            self.restart_host_measurement()  # (the kernel's eager CPU time is not host time)

    def run_op(self, func, args: tuple, kwargs: dict):
        """Run one op as the device would: the host queues it (host clock), its new blocks are allocated
        on the current stream (or ``torch.OutOfMemoryError`` before anyone sees its outputs), its kernel
        occupies the stream for the roofline cost, and its accesses are checked for hazards."""
        self.engine.settle()
        if getattr(self._local, "paused", False):
            out = func(*args, **kwargs)
            if self.op_times_s is not None:
                self.op_times_s.append(0.0)  # (host-side work: no kernel)
            return out
        with self.clock.lock:
            self._host.count()
            self.hazards.raise_pending()
            stream = self.current_stream()
        if self.meta_tensors and func is _aten._local_scalar_dense.default and args[0].device.type == "meta":
            raise RuntimeError(
                "the program reads a value of a meta tensor (.item(), a Python bool or int of a tensor, or a shape "
                "that depends on data): meta tensors hold sizes only (device.meta_tensors: true). Run such code on "
                "real tensors, or keep it out of the simulated step (NOTE [Meta tensors])")
        out = func(*args, **kwargs)
        with self.clock.lock:  # (the kernel itself ran outside it: threads compute in parallel)
            self.restart_host_measurement()  # (the kernel's eager CPU time is not host time)
            self.op_index += 1
            device_type = self.tensor_device
            outputs = _strided(tensor_leaves(out), device_type)
            inputs = None
            if outputs:
                allocator = self.allocator
                if func in FRESH_FROM_DATA:
                    fresh = allocator.new_storages(outputs, set)
                else:
                    inputs = _strided(tensor_leaves((args, kwargs)), device_type)
                    fresh = allocator.new_storages(outputs, lambda: {storage_key(t.untyped_storage()) for t in inputs})
                if fresh:
                    try:
                        allocator.allocate(fresh, stream, str(func), self.op_index)
                    except torch.OutOfMemoryError:
                        del out, outputs, fresh  # its outputs never reach anyone (the error's frames hold this one)
                        raise
            if outputs and stream is not self.compute_stream:
                self.engine.note_outputs(outputs, stream)
            if func in _NO_KERNEL:
                if self.op_times_s is not None:
                    self.op_times_s.append(0.0)
                return out
            kernel_s = self.cost.kernel_s(func, args, kwargs, out)
            if self.op_times_s is not None:
                self.op_times_s.append(0.0 if kernel_s is None else kernel_s)
            if kernel_s is not None:
                start_s, end_s = stream.launch(kernel_s)
                self.kernels += 1
                self.kernel_busy_s += kernel_s
                if self.hazards.enabled:
                    self._check_kernel(func, stream, start_s, end_s, inputs if inputs is not None else
                                       _strided(tensor_leaves((args, kwargs)), device_type), outputs)
            if self.cost.is_host_sync(func, args, kwargs):
                self.clock.wait_for(stream.ready_s)  # e.g. .item(): the host waits for the value
            return out

    def _check_kernel(self, func, stream: SimStream, start_s: float, end_s: float, inputs, outputs) -> None:
        block_of = self.allocator.block_of
        written = {storage_key(t.untyped_storage()) for t in outputs}
        what = f"kernel {func}"
        for t in inputs:
            storage = t.untyped_storage()
            if storage_key(storage) not in written:
                block = block_of(storage)
                if block is not None:
                    self.hazards.access(block, stream, start_s, end_s, False, what)
        for t in outputs:
            block = block_of(t.untyped_storage())
            if block is not None:
                self.hazards.access(block, stream, start_s, end_s, True, what)

    def short_bytes(self, error: torch.OutOfMemoryError, func, args: tuple, kwargs: dict,
                    request_bytes: int | None = None) -> int:
        """How many bytes the failed allocation was short of (exact here: the allocator says)."""
        return getattr(error, "short_bytes", 1)

    def request_fit(self, error: torch.OutOfMemoryError):
        """A callable saying whether the request that raised ``error`` would fit now, on the stream current at
        it (the caching model's judgement: NOTE [Relief inside the op] in ``device/dispatch.py``)."""
        requested_bytes = getattr(error, "requested_bytes", None)
        if requested_bytes is None:
            return None
        stream = self.current_stream()
        return lambda: self.allocator.fits(requested_bytes, stream)
