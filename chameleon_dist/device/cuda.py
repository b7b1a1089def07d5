"""``CudaDevice``: the real accelerator behind the ``Device`` protocol.

One copy stream per direction, CUDA events for ordering, and an exact-size pinned host pool. Blocks are
released after their copies by events and stream waits, never by ``record_stream`` and never by the host
polling in a loop: see NOTE [Release after copy] in ``device/base.py``.

Importing this module makes no CUDA call; everything that touches CUDA runs inside ``CudaDevice``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import weakref
from collections import deque
from typing import Iterator

import torch
from torch import nn

from chameleon_dist.device.base import PressureHandler, byte_view
from chameleon_dist.device.host_pool import HostBufferPool
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
_STALL_PAIRS_BEFORE_FOLD = 1024  # timing-event pairs kept before completed ones are folded into the total


def _unregister_host_memory(address: int) -> None:
    try:
        error = int(torch.cuda.cudart().cudaHostUnregister(address))
    except Exception:  # noqa: BLE001 - a finaliser must not raise (e.g. at interpreter shutdown)
        return
    if error != 0:
        logger.debug("cudaHostUnregister(%#x) returned cudaError %d", address, error)


class PinnedHostAllocator:
    """Exactly ``nbytes`` of page-locked host memory per call.

    ``torch.empty(n, pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every
    request up to a power of two (up to ~2x host RAM) and keeps freed blocks cached for the process
    lifetime, so the pool's byte budget would not bound real host memory. Instead each buffer is its own
    anonymous ``mmap`` (page-aligned, pages shared with nothing else) registered with
    ``cudaHostRegister`` and unregistered when its storage dies (the pattern of PyTorch's own checkpoint
    stager). If registration fails (e.g. a memlock limit), it warns once and falls back to
    ``torch.empty(n, pin_memory=True)``."""

    def __init__(self) -> None:
        self.registered_buffers = 0
        self.fallback_buffers = 0

    def __call__(self, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if self.fallback_buffers:
            return self._fallback(nbytes)
        region_bytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        buffer = torch.frombuffer(mmap.mmap(-1, region_bytes), dtype=torch.uint8, count=nbytes)
        address = buffer.data_ptr()
        error = int(torch.cuda.cudart().cudaHostRegister(address, region_bytes, _CUDA_HOST_REGISTER_PORTABLE))
        if error != 0:
            logger.warning(
                "cudaHostRegister of %s failed (cudaError %d, a memlock limit?): using PyTorch's pinned "
                "allocator, which rounds host buffers up to powers of two",
                format_bytes(region_bytes),
                error,
            )
            return self._fallback(nbytes)
        finalizer = weakref.finalize(buffer.untyped_storage(), _unregister_host_memory, address)
        finalizer.atexit = False  # never call into CUDA after its context is gone
        self.registered_buffers += 1
        return buffer

    def _fallback(self, nbytes: int) -> torch.Tensor:
        self.fallback_buffers += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class CudaCopyHandle:
    """One copy on a copy stream. ``result`` is the destination byte view; ``event`` marks completion.

    ``guard`` is the compute stream whose allocator owns the device block involved (the swapped-out
    source, or the swapped-in destination); it is cleared once that stream has been ordered after the
    copy. A handle dropped while still guarded (e.g. a prefetch never waited on) makes the stream wait
    for its copy on the way out (NOTE [Release after copy] in ``device/base.py``)."""

    __slots__ = ("nbytes", "result", "event", "source", "guard", "__weakref__")

    def __init__(self, result: torch.Tensor, event, guard, source: torch.UntypedStorage | None = None) -> None:
        self.nbytes = result.numel()
        self.result = result
        self.event = event
        self.guard = guard
        self.source = source  # swap-outs only: the device storage being read

    def done(self) -> bool:
        return self.event.query()

    def __del__(self) -> None:
        guard = self.guard
        if guard is not None:
            try:
                if not self.event.query():
                    guard.wait_event(self.event)
            except Exception:  # noqa: BLE001 - a destructor must not raise (e.g. at interpreter shutdown)
                pass


class CudaEventTimer:
    """Layer times on the GPU (``DeviceTimer``): each mark is a timing event recorded on the current stream
    of ``device`` (the compute stream: forward hooks run on the training thread, backward hooks on
    autograd's thread for this device, under the stream of the op they precede). ``resolve`` synchronises
    the device once; ``elapsed_s`` then reads the GPU's own timestamps, so a layer's time is its kernels'
    execution, not the host's time to launch them."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def resolve(self) -> None:
        torch.cuda.synchronize(self._device)

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0


class CudaDevice:
    """A CUDA device (``device_index``, default the current one) seen through the ``Device`` protocol.

    Methods are called from one thread at a time (the training thread, or autograd's device thread
    during backward, which do not run concurrently). ``capacity_bytes`` defaults to the device's total
    memory; it is what the policy plans against, the CUDA allocator does not enforce it.
    ``d2h_bytes_per_s`` / ``h2d_bytes_per_s`` are the host link's rates as the caller knows them (the
    config's ``device.d2h_bytes_per_s`` / ``device.h2d_bytes_per_s``); ``None``, the default, means
    unknown. The device does not measure them and copies at whatever speed the hardware gives."""

    emulated = False

    def __init__(
        self,
        capacity_bytes: int | None = None,
        host_memory_budget_bytes: int | None = None,
        device_index: int | None = None,
        d2h_bytes_per_s: float | None = None,
        h2d_bytes_per_s: float | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"CUDA is not available (torch {torch.__version__}, CUDA build: {torch.version.cuda}): "
                "set `device.kind: emulated` (with a `device.capacity`) in the chameleon config to run "
                "on the CPU with an emulated device"
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device_index is None else int(device_index)
        if not 0 <= index < count:
            raise ValueError(f"CUDA device index {index} is out of range: {count} device(s) visible")
        self.index = index
        self.torch_device = torch.device("cuda", index)
        properties = torch.cuda.get_device_properties(index)
        self.name = f"cuda:{index} ({properties.name})"
        total_bytes = int(properties.total_memory)
        self.capacity_bytes = total_bytes if capacity_bytes is None else int(capacity_bytes)
        if self.capacity_bytes > total_bytes:
            logger.warning(
                "device.capacity %s exceeds %s's memory (%s)",
                format_bytes(self.capacity_bytes),
                self.name,
                format_bytes(total_bytes),
            )
        for direction, rate in (("d2h", d2h_bytes_per_s), ("h2d", h2d_bytes_per_s)):
            if rate is not None and not rate > 0:
                raise ValueError(f"{direction} bandwidth must be > 0 bytes/s, got {rate}")
        self.d2h_bytes_per_s: float | None = None if d2h_bytes_per_s is None else float(d2h_bytes_per_s)
        self.h2d_bytes_per_s: float | None = None if h2d_bytes_per_s is None else float(h2d_bytes_per_s)
        self.host_allocator = PinnedHostAllocator()
        self.host_pool = HostBufferPool(host_memory_budget_bytes, allocate=self.host_allocator)
        self._d2h_stream = torch.cuda.Stream(device=self.torch_device)
        self._h2d_stream = torch.cuda.Stream(device=self.torch_device)
        self._held_sources: deque[CudaCopyHandle] = deque()  # swap-outs whose source is held; issue order
        self._pending_host: list[tuple[torch.Tensor, object]] = []  # (buffer, event of its last copy)
        self._host_last_copy: dict[int, object] = {}  # host buffer address -> done-event of its last copy
        self._stall_pairs: list[tuple[object, object]] = []
        self._stall_s = 0.0
        self._pressure_handler: PressureHandler | None = None

    # ---- accounting -------------------------------------------------------------------------
    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def stall_s(self) -> float:
        """Seconds the compute stream sat in ``wait_event`` on copies (GPU time; synchronises lazily)."""
        for start, end in self._stall_pairs:
            end.synchronize()
            self._stall_s += start.elapsed_time(end) / 1000.0
        self._stall_pairs.clear()
        return self._stall_s

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with torch.cuda.device(self.index):
            yield

    def track_module(self, module: nn.Module) -> None:
        """Allocator statistics already count parameters; only warn about ones that live elsewhere."""
        tensors = itertools.chain(module.named_parameters(), module.named_buffers())
        elsewhere = [name for name, tensor in tensors if not self.is_device_tensor(tensor)]
        if elsewhere:
            logger.warning(
                "%d parameters/buffers of %s are not on %s (first: %s)",
                len(elsewhere),
                type(module).__name__,
                self.torch_device,
                elsewhere[0],
            )

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda" and tensor.device.index == self.index

    # ---- copies -----------------------------------------------------------------------------
    def copy_to_host(self, storage: torch.UntypedStorage) -> CudaCopyHandle | None:
        self._release_finished_host_buffers()
        self.release_completed_sources()
        host = self.host_pool.acquire(storage.nbytes())
        if host is None:
            return None
        compute = torch.cuda.current_stream(self.torch_device)
        self._d2h_stream.wait_stream(compute)  # the storage's producers come first
        with torch.cuda.stream(self._d2h_stream):
            host.copy_(byte_view(storage), non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._d2h_stream)
        self._note_host_copy(host, done)
        handle = CudaCopyHandle(host, done, guard=compute, source=storage)
        self._held_sources.append(handle)
        return handle

    def copy_to_device(self, host: torch.Tensor, after: CudaCopyHandle | None = None) -> CudaCopyHandle:
        """The destination is allocated on (and freed back to) the compute stream, written on the H2D
        stream; the compute stream reads it only after ``wait`` (or the handle's guard) orders it."""
        compute = torch.cuda.current_stream(self.torch_device)
        destination = self._allocate_device_bytes(host.numel())
        self._h2d_stream.wait_stream(compute)  # the allocation (a possibly reused block) comes first
        previous = after.event if after is not None else None
        if previous is None and host.numel():
            previous = self._host_last_copy.get(host.data_ptr())
        if previous is not None and not previous.query():
            self._h2d_stream.wait_event(previous)  # its swap-out must have landed, even if never waited on
        with torch.cuda.stream(self._h2d_stream):
            destination.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._h2d_stream)
        self._note_host_copy(host, done)
        return CudaCopyHandle(destination, done, guard=compute)

    def wait(self, handle: CudaCopyHandle) -> torch.Tensor:
        """Order the current stream after the copy on the GPU (the host does not block)."""
        stream = torch.cuda.current_stream(self.torch_device)
        if not handle.done():
            self._timed_wait(stream, handle.event)
        if handle.guard is not None and (handle.guard == stream or handle.done()):
            handle.guard = None
        return handle.result

    def release_host(self, host: torch.Tensor) -> None:
        """Back to the pool now if its last copy has completed, else once its done-event has fired (checked
        again in ``copy_to_host``, ``release_all_sources`` and ``synchronize``)."""
        event = self._host_last_copy.pop(host.data_ptr(), None) if host.numel() else None
        if event is None or event.query():
            self.host_pool.release(host)
        else:
            self._pending_host.append((host, event))

    def release_all_sources(self) -> int:
        """Let go of EVERY held swap-out source, finished or not, and return their bytes; also returns to
        the pool the host buffers whose last copy has completed.

        A copy still running is not skipped (that would keep its block for an unknown time): its source's
        compute stream waits for the copy's done-event on the GPU (timed as stall) before the reference is
        dropped. Copies complete in issue order, so one wait per stream, on its newest unfinished copy,
        suffices. See NOTE [Release after copy] in ``device/base.py``."""
        self._release_finished_host_buffers()
        latest_unfinished: dict[object, object] = {}
        for handle in self._held_sources:
            if handle.guard is not None and not handle.done():
                latest_unfinished[handle.guard] = handle.event
        for stream, event in latest_unfinished.items():
            self._timed_wait(stream, event)
        released_bytes = 0
        while self._held_sources:
            released_bytes += self._let_go_oldest_source()
        return released_bytes

    def release_completed_sources(self) -> int:
        """The earliest release, without waiting: let go of the held swap-out sources whose copy's
        done-event has fired and return their bytes (the copies of one stream complete in issue order, so
        the scan stops at the first unfinished one)."""
        released_bytes = 0
        while self._held_sources and self._held_sources[0].done():
            released_bytes += self._let_go_oldest_source()
        return released_bytes

    def set_pressure_handler(self, handler: PressureHandler | None) -> None:
        """Tried before ``copy_to_device`` raises out-of-memory (other allocations cannot be hooked)."""
        self._pressure_handler = handler

    def timer(self) -> CudaEventTimer:
        """CUDA timing events on this device's current stream (see ``CudaEventTimer``)."""
        return CudaEventTimer(self.torch_device)

    def random_state(self) -> torch.Tensor:
        """This device's CUDA generator state (dropout on the GPU draws from it, not from the CPU's)."""
        return torch.cuda.get_rng_state(self.index)

    def set_random_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.index)

    def synchronize(self) -> None:
        """Block the host until both copy streams are idle, then let go of every source and buffer."""
        self._d2h_stream.synchronize()
        self._h2d_stream.synchronize()
        self.release_completed_sources()
        self._release_finished_host_buffers()
        self._host_last_copy.clear()  # every copy recorded so far has completed

    # ---- internals --------------------------------------------------------------------------
    def _allocate_device_bytes(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        except torch.OutOfMemoryError:
            handler = self._pressure_handler
            if handler is None:
                raise
        # outside the except block, so the traceback's frames do not pin tensors during the retry
        short_bytes = self.live_bytes() + nbytes - self.capacity_bytes
        short_bytes = short_bytes if short_bytes > 0 else nbytes
        released_bytes = handler(short_bytes)
        logger.info(
            "out of memory for a %s swap-in: pressure handler released %s; retrying once",
            format_bytes(nbytes),
            format_bytes(released_bytes),
        )
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def _timed_wait(self, stream, event) -> None:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        self._stall_pairs.append((start, end))
        if len(self._stall_pairs) > _STALL_PAIRS_BEFORE_FOLD:
            finished = 0
            for start, end in self._stall_pairs:
                if not end.query():
                    break
                self._stall_s += start.elapsed_time(end) / 1000.0
                finished += 1
            del self._stall_pairs[:finished]

    def _note_host_copy(self, host: torch.Tensor, done) -> None:
        if host.numel():
            self._host_last_copy[host.data_ptr()] = done

    def _let_go_oldest_source(self) -> int:
        """Drop the device's hold on the oldest held swap-out source (its copy completed, or its stream was
        ordered after the copy); returns its bytes."""
        handle = self._held_sources.popleft()
        handle.guard = None
        handle.source = None
        return handle.nbytes

    def _release_finished_host_buffers(self) -> None:
        if not self._pending_host:
            return
        waiting = []
        for host, event in self._pending_host:
            if event.query():
                self.host_pool.release(host)
            else:
                waiting.append((host, event))
        self._pending_host = waiting
