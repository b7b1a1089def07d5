"""An emulated host<->device link: a FIFO copy engine on a worker thread with a modelled bandwidth.

Each direction is one ``EmulatedLink`` (like one copy stream). Copies run one after another; a copy of
``nbytes`` occupies the link for ``nbytes / bytes_per_s`` seconds, so a prefetch issued too late shows
up as real waiting time on the training thread. Without a bandwidth the link is instant: copies complete
as they are issued, on the calling thread (no thread hand-off to wait for).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref

import torch

logger = logging.getLogger(__name__)


class EmulatedCopyHandle:
    """One copy on an emulated link. ``result`` is the destination byte view."""

    __slots__ = ("nbytes", "result", "after", "_source", "_done", "error", "__weakref__")

    def __init__(self, source: torch.Tensor, result: torch.Tensor, after: "EmulatedCopyHandle | None" = None) -> None:
        self.nbytes = result.numel()
        self.result = result
        self.after = after  # a copy (on the other link) that must complete before this one starts
        self._source: torch.Tensor | None = source
        self._done = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"emulated copy of {self.nbytes} bytes failed") from self.error


class LinkStats:
    """What one link has done so far (written by its worker thread only)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.copied_bytes = 0
        self.copies = 0


class EmulatedLink:
    """One direction of the emulated link; ``copy`` returns at once, the worker does the work.

    The worker thread holds no reference to the link, so a link that is no longer used is collected
    and its worker ends."""

    def __init__(self, name: str, bytes_per_s: float | None) -> None:
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"{name} bandwidth must be > 0 bytes/s, got {bytes_per_s}")
        self.name = name
        self.bytes_per_s = bytes_per_s
        self.stats = LinkStats()
        self._queue: queue.SimpleQueue[EmulatedCopyHandle | None] = queue.SimpleQueue()
        # only the completion flag of the newest copy: holding the handle would keep its destination (a
        # restored device buffer) alive, and metered, until the next copy
        self._last_done: threading.Event | None = None
        worker = threading.Thread(
            target=_serve, args=(self._queue, bytes_per_s, self.stats, name), name=f"chameleon-{name}", daemon=True
        )
        worker.start()
        weakref.finalize(self, self._queue.put, None)

    def copy(self, source: torch.Tensor, destination: torch.Tensor, after: EmulatedCopyHandle | None = None) -> EmulatedCopyHandle:
        """Queue ``destination.copy_(source)`` (after ``after`` completes); the handle holds ``source``
        until the copy is done (NOTE [Release after copy] in ``device/base.py``). On an instant link, the
        caller must have waited for ``after`` already."""
        handle = EmulatedCopyHandle(source, destination, after)
        if self.bytes_per_s is None:  # an instant link: the copy is done by the time it is issued
            _complete(handle, self.stats, self.name)
            return handle
        self._last_done = handle._done
        self._queue.put(handle)
        return handle

    def drain(self) -> None:
        """Block until every copy queued so far has completed (copies complete in order)."""
        last_done = self._last_done
        if last_done is not None:
            last_done.wait()


def _serve(jobs: queue.SimpleQueue, bytes_per_s: float | None, stats: LinkStats, name: str) -> None:
    while True:
        handle = jobs.get()
        if handle is None:
            return
        _complete(handle, stats, name, bytes_per_s)
        del handle


def _complete(handle: EmulatedCopyHandle, stats: LinkStats, name: str, bytes_per_s: float | None = None) -> None:
    """Copy, hold the link for ``nbytes / bytes_per_s`` in all, then let the source go and signal."""
    if handle.after is not None:
        handle.after._done.wait()
        handle.after = None
    start_s = time.perf_counter()
    try:
        handle.result.copy_(handle._source)
    except BaseException as exc:  # surfaced to the waiter, never lost
        logger.exception("%s copy failed", name)
        handle.error = exc
    if bytes_per_s is not None:
        remaining_s = start_s + handle.nbytes / bytes_per_s - time.perf_counter()
        if remaining_s > 0:
            time.sleep(remaining_s)
    stats.busy_s += time.perf_counter() - start_s
    stats.copied_bytes += handle.nbytes
    stats.copies += 1
    handle._source = None  # only now: NOTE [Release after copy] in device/base.py
    handle._done.set()
