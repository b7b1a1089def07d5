"""``StreamDevice``: the one device implementation behind the ``Device`` protocol, over a backend (NOTE [One
device code path] in ``device/backend.py``): the CUDA backend on a GPU, the simulated one on the CPU.

One copy stream per direction, done-events for ordering, a host pool (pinned on CUDA), stream-ordered
release of swap-out sources, and relief of memory pressure at the dispatcher (``device/dispatch.py``).
Blocks are released after their copies by events and stream waits, never by ``record_stream`` and never by
the host polling in a loop: see NOTE [Release after copy] in ``device/base.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from collections import deque
from typing import Any, Iterator

import torch
from torch import nn

from chameleon_dist.device.backend import Backend
from chameleon_dist.device.base import PressureHandler, byte_view
from chameleon_dist.device.dispatch import DeviceDispatch
from chameleon_dist.device.host_pool import HostBufferPool, host_key
from chameleon_dist.device.locking import SharedLock, lock_entry_points
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

_STALL_PAIRS_BEFORE_FOLD = 1024  # timing-event pairs kept before completed ones are folded into the total


class StreamCopyHandle:
    """One copy on a copy stream. ``result`` is the destination byte view; ``event`` marks completion.

    ``guard`` is the stream whose allocator owns the device block involved (the swapped-out source's
    producing stream, or the swapped-in destination's compute stream); it is cleared once that stream has
    been ordered after the copy. A handle dropped while still guarded (e.g. a prefetch never waited on)
    makes the stream wait for its copy on the way out (NOTE [Release after copy] in ``device/base.py``)."""

    __slots__ = ("nbytes", "result", "event", "source", "guard", "home", "owner", "__weakref__")

    def __init__(self, result: torch.Tensor, event, guard, source: torch.UntypedStorage | None = None,
                 home=None, owner: "StreamDevice | None" = None) -> None:
        self.nbytes = result.numel()
        self.result = result
        self.event = event
        self.guard = guard
        self.source = source  # swap-outs only: the device storage being read
        self.home = home  # swap-ins only: the stream the destination was allocated on (its reader's)
        self.owner = weakref.ref(owner) if owner is not None else None

    def done(self) -> bool:
        return self.event.query()

    def __del__(self) -> None:
        guard = self.guard
        if guard is not None:
            try:
                owner = self.owner() if self.owner is not None else None
                if owner is None:
                    _order_after_drop(None, guard, self.event, self.result)
                else:  # under the device's lock, never waiting for it (NOTE [Threads and locks] in locking.py)
                    owner.run_or_defer(_order_after_drop, owner, guard, self.event, self.result)
            except Exception:  # noqa: BLE001 - a destructor must not raise (e.g. at interpreter shutdown)
                pass


def _order_after_drop(owner: "StreamDevice | None", guard, event, device_bytes: torch.Tensor) -> None:
    """A guarded copy handle was dropped: its ``guard`` stream waits for the copy."""
    if owner is not None and owner.is_capturing():
        # no query inside a CUDA graph capture: the device keeps the bytes and orders the stream
        # once the capture has ended (NOTE [No swapping under graph capture] in executor/capture.py)
        owner.defer_guard(guard, event, device_bytes)
    elif not event.query():
        guard.wait_event(event)


class EventTimer:
    """Layer and iteration times on the device (``DeviceTimer``): each mark is a timing event recorded on the
    current stream (forward hooks run on the training thread, backward hooks under the stream of the op
    they precede). ``resolve`` synchronises once; ``elapsed_s`` then reads the device's own timestamps, so a
    time is the kernels' execution, not the host's time to launch them."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._marks: dict[int, tuple[Any, float]] = {}  # id(mark) -> (its stream, the host's time at it)
        self.waits: list[tuple[Any, Any, Any]] = []  # (start, end, stream) of each wait on a copy (the device's)

    def mark(self):
        event = self._backend.new_event(timing=True)
        stream = self._backend.current_stream()
        event.record(stream)
        self._marks[id(event)] = (stream, self._backend.host_time_s())
        return event

    def compute_s(self, start, end) -> float:
        """What the work between two marks costs without the waits on copies inside it: its device time less
        those waits (``waits_s``), but never less than the host's own time between the marks (a host-bound span:
        after a wait the device catches up with the host, and the gaps it would have idled in are gone)."""
        span_s = self.elapsed_s(start, end) - self.waits_s(start, end)
        host_s = self._marks[id(end)][1] - self._marks[id(start)][1]
        return max(span_s, host_s, 0.0)

    def waits_s(self, start, end) -> float:
        """Device seconds that ``start``'s stream sat waiting on copies between the two marks (both made before
        the latest ``resolve``): a layer's compute time is its elapsed time less these (a swap's stall is the
        policy's to predict, not the layer's to take)."""
        stream = self._marks[id(start)][0]
        elapsed_s = self._backend.elapsed_s
        total_s = 0.0
        for wait_start, wait_end, wait_stream in self.waits:
            if wait_stream == stream and elapsed_s(start, wait_start) >= 0 and elapsed_s(wait_end, end) >= 0:
                total_s += elapsed_s(wait_start, wait_end)
        return total_s

    def resolve(self) -> None:
        self._backend.synchronize()

    def completed(self, mark) -> bool:
        return mark.query()

    def elapsed_s(self, start, end) -> float:
        return self._backend.elapsed_s(start, end)


class StreamDevice:
    """A device seen through the ``Device`` protocol, over ``backend`` (see the module docstring).

    Its state is shared by the threads of an iteration (the caller's, autograd's device threads: one per GPU of a
    ``device_map`` model, at once): each entry point that touches it runs under one re-entrant lock, the backend's
    where it has one (the simulated clock's); NOTE [Threads and locks] in ``device/locking.py``.
    ``d2h_bytes_per_s`` / ``h2d_bytes_per_s`` are the host link's rates the policy plans with (``None``: unknown;
    ``math.inf``: an instant link)."""

    def __init__(self, backend: Backend, host_memory_budget_bytes: int | None = None,
                 d2h_bytes_per_s: float | None = None, h2d_bytes_per_s: float | None = None) -> None:
        for direction, rate in (("d2h", d2h_bytes_per_s), ("h2d", h2d_bytes_per_s)):
            if rate is not None and not rate > 0:
                raise ValueError(f"device.{direction}_bytes_per_s must be > 0 bytes/s, got {rate}")
        self.backend = backend
        self._lock = getattr(backend, "lock", None) or SharedLock()
        self.name = backend.name
        self.emulated = backend.emulated
        self.capacity_bytes = backend.capacity_bytes
        self._d2h_rate = None if d2h_bytes_per_s is None else float(d2h_bytes_per_s)
        self._h2d_rate = None if h2d_bytes_per_s is None else float(h2d_bytes_per_s)
        allocate = backend.host_allocator()
        self.host_pool = HostBufferPool(host_memory_budget_bytes, **({} if allocate is None else {"allocate": allocate}))
        self._d2h_stream = backend.new_stream("d2h")
        self._h2d_stream = backend.new_stream("h2d")
        self.dispatch = DeviceDispatch(backend)
        self._held_sources: deque[StreamCopyHandle] = deque()  # swap-outs whose source is held; issue order
        self._pending_host: list[tuple[torch.Tensor, Any]] = []  # (buffer, event of its last copy)
        self._host_last_copy: dict[int, Any] = {}  # host buffer's storage -> done-event of its last copy
        self._stall_pairs: list[tuple[Any, Any]] = []
        self._stall_s = 0.0
        self._timers: weakref.WeakSet[EventTimer] = weakref.WeakSet()  # live timers: each keeps the waits it saw
        self._deferred_guards: list[tuple[Any, Any, torch.Tensor]] = []  # (stream, event, bytes) from a capture

    # ---- link -------------------------------------------------------------------------------
    @property
    def d2h_bytes_per_s(self) -> float | None:
        return self._d2h_rate

    @property
    def h2d_bytes_per_s(self) -> float | None:
        return self._h2d_rate

    # ---- accounting -------------------------------------------------------------------------
    def live_bytes(self) -> int:
        return self.backend.live_bytes()

    def peak_bytes(self) -> int:
        return self.backend.peak_bytes()

    def reset_peak(self) -> None:
        self.backend.reset_peak()

    def stall_s(self) -> float:
        """Device seconds the streams sat in ``wait_event`` on copies, each wait counted once its timing
        events have completed. Never blocks: a wait still queued when asked is counted by a later call (in
        Stable usually the next iteration's; after the timer's ``resolve``, a device-wide wait, every one)."""
        self._fold_completed_stalls()
        return self._stall_s

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Every op of the iteration on this thread (and of its backward pass) runs through the dispatch
        layer: the backend meters and times it, and an op that runs out of memory is relieved once."""
        with self.backend.active(), self.dispatch:
            yield

    def track_module(self, module: nn.Module) -> None:
        """Count ``module``'s parameters and buffers as device memory (the simulated backend; the CUDA
        allocator counts them already) and warn about ones that live elsewhere."""
        tensors = list(itertools.chain(module.named_parameters(), module.named_buffers()))
        on_meta = [name for name, tensor in tensors if tensor.device.type == "meta"]
        if on_meta and not self.backend.meta_tensors:
            raise ValueError(
                f"{len(on_meta)} parameters/buffers of {type(module).__name__} are meta tensors (first: {on_meta[0]}), "
                f"which hold no data: {self.name} cannot run them. To simulate a model on meta tensors, use "
                "device.kind: emulated with device.meta_tensors: true (EmulatedDevice(meta_tensors=True))")
        for _, tensor in tensors:
            self.backend.track(tensor)
        elsewhere = [name for name, tensor in tensors if not self.is_device_tensor(tensor)]
        if elsewhere:
            logger.warning("%d parameters/buffers of %s are not on %s (first: %s)", len(elsewhere),
                           type(module).__name__, self.name, elsewhere[0])

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a tensor made outside an iteration (e.g. a batch moved "to the device")."""
        self.backend.track(tensor)
        return tensor

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return self.backend.is_device_tensor(tensor)

    def current_stream(self):
        """The stream work is queued on now (a saved tensor's producer: recorded at the save)."""
        return self.backend.current_stream()

    def producer_stream(self, tensor: torch.Tensor):
        """The stream that made ``tensor``'s storage, whose pool its block goes back to (NOTE [Producer and
        reader streams] in ``device/producers.py``); the current one for a storage made outside an iteration."""
        return self.dispatch.producers.stream_of(tensor.untyped_storage(), self.backend.current_stream())

    def is_capturing(self) -> bool:
        """A CUDA graph is being captured (the backend's ``is_capturing``): nothing may be queued then."""
        return self.backend.is_capturing()

    # ---- copies -----------------------------------------------------------------------------
    def copy_to_host(self, storage: torch.UntypedStorage, stream=None) -> StreamCopyHandle | None:
        """Copy ``storage`` to a host buffer after the work queued so far on ``stream`` (its producer's
        stream, default the current one), which also owns its block: the release orders that stream."""
        self._release_finished_host_buffers()
        self.release_completed_sources()
        backend = self.backend
        with backend.host_side():
            host = self.host_pool.acquire(storage.nbytes())
            source = byte_view(storage)
        if host is None:
            return None
        producer = stream if stream is not None else backend.current_stream()
        self._d2h_stream.wait_stream(producer)  # the storage's producers come first
        with backend.use_stream(self._d2h_stream):
            backend.copy(host, source)
        done = backend.new_event()
        done.record(self._d2h_stream)
        self._note_host_copy(host, done)
        handle = StreamCopyHandle(host, done, guard=producer, source=storage, owner=self)
        self._held_sources.append(handle)
        return handle

    def copy_to_device(self, host: torch.Tensor, after: StreamCopyHandle | None = None,
                       stream=None) -> StreamCopyHandle:
        """The destination is allocated on (and freed back to) ``stream``, the stream that will read it (a
        saved tensor's: recorded at the save, which is where autograd runs its node's backward; default the
        current one), and written on the H2D stream; the reader uses it only after ``wait`` (or the handle's
        guard) orders it. A prefetch runs while another node is current, on whatever stream that node runs:
        allocating there would hand the block back to that stream's pool while its reader still reads it (NOTE
        [Backward on its forward's stream] in ``device/simulated/engine.py``)."""
        backend = self.backend
        reader = stream if stream is not None else backend.current_stream()
        with backend.use_stream(reader):  # (before the lock: it may ask the executor for relief)
            destination = self._allocate_device_bytes(host.numel())
        with self._lock:
            return self._queue_copy_to_device(host, destination, reader, after)

    def _queue_copy_to_device(self, host: torch.Tensor, destination: torch.Tensor, reader, after) -> StreamCopyHandle:
        backend = self.backend
        self._h2d_stream.wait_stream(reader)  # the allocation (a possibly reused block) comes first
        previous = after.event if after is not None else None
        if previous is None and host.numel():
            previous = self._host_last_copy.get(host_key(host))
        if previous is not None and not previous.query():
            self._h2d_stream.wait_event(previous)  # its swap-out must have landed, even if never waited on
        with backend.use_stream(self._h2d_stream):
            backend.copy(destination, host)
        done = backend.new_event()
        done.record(self._h2d_stream)
        self._note_host_copy(host, done)
        return StreamCopyHandle(destination, done, guard=reader, home=reader, owner=self)

    def wait(self, handle: StreamCopyHandle) -> torch.Tensor:
        """Order the current stream after the copy on the device (the host does not block). A swap-in read on
        another stream than the one it was allocated on (a storage saved by nodes on two streams) is recorded
        on the reading stream, so its block is not reused under that read: the only ``record_stream`` the
        runtime makes, for a case the allocation cannot serve."""
        stream = self.backend.current_stream()
        if not handle.done():
            self._timed_wait(stream, handle.event)
        if handle.guard is not None and (handle.guard == stream or handle.done()):
            handle.guard = None
        if handle.home is not None and handle.home != stream:
            self.backend.record_stream(handle.result, stream)
        return handle.result

    def release_host(self, host: torch.Tensor) -> None:
        """Back to the pool now if its last copy has completed, else once its done-event has fired (checked
        again in ``copy_to_host``, ``release_all_sources`` and ``synchronize``)."""
        event = self._host_last_copy.pop(host_key(host), None) if host.numel() else None
        if event is None or event.query():
            self.host_pool.release(host)
        else:
            self._pending_host.append((host, event))

    def release_all_sources(self) -> int:
        """Let go of EVERY held swap-out source, finished or not, and return their bytes (NOTE [Release after
        copy] in ``device/base.py``)."""
        self._release_finished_host_buffers()
        return self._release_through(len(self._held_sources))

    def release_source(self, handle: StreamCopyHandle) -> int:
        """The planned release of one swap-out: let go of its source, and of every source issued before it
        (copies on one stream complete in issue order), ordered on the device: each owning stream waits on
        the newest unfinished copy's done-event, then the references go. The host never blocks, the owning
        stream may wait (stall). Returns the bytes let go; 0 when it was let go already."""
        for position, held in enumerate(self._held_sources):
            if held is handle:
                return self._release_through(position + 1)
        return 0

    def defer_guard(self, stream, event, device_bytes: torch.Tensor) -> None:
        """A copy handle dropped during a graph capture: ``stream`` waits for ``event`` once the capture has
        ended (``apply_deferred_guards``); until then the device holds ``device_bytes``, so the block cannot go
        back to its pool unordered."""
        self._deferred_guards.append((stream, event, device_bytes))

    def apply_deferred_guards(self) -> None:
        """Order the streams of the handles dropped during a capture after their copies, and let go of the
        bytes they guarded (nothing while a capture is still under way)."""
        if self._deferred_guards and not self.backend.is_capturing():
            deferred, self._deferred_guards = self._deferred_guards, []
            for stream, event, _ in deferred:
                if not event.query():
                    stream.wait_event(event)

    def release_completed_sources(self) -> int:
        """The earliest release, without waiting: let go of the held swap-out sources whose copy's
        done-event has fired and return their bytes (the scan stops at the first unfinished one)."""
        self.apply_deferred_guards()
        released_bytes = 0
        while self._held_sources and self._held_sources[0].done():
            released_bytes += self._let_go_oldest_source()
        return released_bytes

    def set_pressure_handler(self, handler: PressureHandler | None) -> None:
        """Tried when an op or a swap-in allocation runs out of memory, before it runs once more."""
        self.dispatch.handler = handler
        allocator = getattr(self.backend, "allocator", None)
        if allocator is not None:
            allocator.swapping = handler is not None

    def timer(self, keep_waits: bool = False) -> EventTimer:
        """Timing events on this device's current stream (see ``EventTimer``). With ``keep_waits`` (a detailed
        trace's layer times) it also keeps every wait on a copy made while it lives (``EventTimer.waits_s``); the
        runtime's iteration timers do not (a host running many iterations ahead would keep them all)."""
        timer = EventTimer(self.backend)
        if keep_waits:
            self._timers.add(timer)
        return timer

    def run_or_defer(self, work, *args) -> None:
        """For finalizers: ``work(*args)`` under the device's lock now, or by its holder (NOTE [Threads and locks])."""
        self._lock.run_or_defer(work, *args)

    def random_state(self) -> torch.Tensor | None:
        return self.backend.random_state()

    def set_random_state(self, state: torch.Tensor) -> None:
        self.backend.set_random_state(state)

    def synchronize(self) -> None:
        """Block the host until both copy streams are idle, then let go of every finished source and buffer."""
        self.apply_deferred_guards()
        self._d2h_stream.synchronize()
        self._h2d_stream.synchronize()
        self.release_completed_sources()
        self._release_finished_host_buffers()
        self._host_last_copy.clear()  # every copy recorded so far has completed

    # ---- internals --------------------------------------------------------------------------
    def _release_through(self, count: int) -> int:
        """Let go of the oldest ``count`` held sources, each owning stream first ordered after its newest
        unfinished copy among them (timed as stall)."""
        latest_unfinished: dict[Any, Any] = {}
        for handle in itertools.islice(self._held_sources, count):
            if handle.guard is not None and not handle.done():
                latest_unfinished[handle.guard] = handle.event
        for stream, event in latest_unfinished.items():
            self._timed_wait(stream, event)
        released_bytes = 0
        for _ in range(count):
            released_bytes += self._let_go_oldest_source()
        return released_bytes

    def _allocate_device_bytes(self, nbytes: int) -> torch.Tensor:
        """A swap-in's block: relieved once, here, and retried once (its ``aten.empty`` passes the dispatch
        layer under ``direct``, so that layer does not relieve it too: NOTE [Relief inside the op])."""
        dispatch = self.dispatch
        try:
            with dispatch.direct():
                return self.backend.allocate(nbytes)
        except torch.OutOfMemoryError as error:
            if dispatch.handler is None or dispatch.relieving:
                raise
            short_bytes = self.backend.short_bytes(error, None, (), {}, request_bytes=nbytes) \
                if not hasattr(error, "short_bytes") else error.short_bytes
            fits = self.backend.request_fit(error)
        # outside the except block, so the traceback's frames do not pin tensors during the retry
        dispatch.relieve(short_bytes, f"a {format_bytes(nbytes)} swap-in", fits)
        with dispatch.direct():
            return self.backend.allocate(nbytes)

    def fits(self, nbytes: int, stream=None) -> bool | None:
        """Whether an allocation of ``nbytes`` on ``stream`` (default the current one) would succeed now, as the
        caching allocator would serve it; None where the backend cannot tell (``backend.fits``)."""
        return self.backend.fits(nbytes, stream)

    def pressure_request_fits(self) -> bool | None:
        """During relief: whether the request that ran short would fit now (None: unknown)."""
        return self.dispatch.request_fits()

    def _timed_wait(self, stream, event) -> None:
        backend = self.backend
        start = backend.new_event(timing=True)
        end = backend.new_event(timing=True)
        start.record(stream)
        stream.wait_event(event)
        end.record(stream)
        self._stall_pairs.append((start, end))
        for timer in self._timers:
            timer.waits.append((start, end, stream))
        if len(self._stall_pairs) > _STALL_PAIRS_BEFORE_FOLD:
            self._fold_completed_stalls()

    def _fold_completed_stalls(self) -> None:
        """Add the waits whose end event has completed to the total (``query`` only: never blocks)."""
        waiting = []
        for start, end in self._stall_pairs:
            if end.query():
                self._stall_s += self.backend.elapsed_s(start, end)
            else:
                waiting.append((start, end))
        self._stall_pairs = waiting

    def _note_host_copy(self, host: torch.Tensor, done) -> None:
        if host.numel():
            self._host_last_copy[host_key(host)] = done

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


lock_entry_points(StreamDevice, "stall_s", "copy_to_host", "wait", "release_host", "release_all_sources",
                  "release_source", "defer_guard", "apply_deferred_guards", "release_completed_sources", "timer",
                  "synchronize")
