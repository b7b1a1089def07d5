"""``DeferringLock``: the host pool's and the host arena's lock, safe for finalizers.

A host buffer's finalizer (its storage died: an arena range goes back, a swap entry's buffer is released)
runs wherever garbage collection runs or a last reference is dropped: inside ``HostBufferPool.acquire``
on the thread that holds the pool's lock (an eviction drops an idle buffer; an allocation collects), or on
another thread while one holds it. A plain lock deadlocks on the first, and a re-entrant one lets the
finalizer change the pool's lists while the interrupted operation is halfway through them. So work that
may come from a finalizer goes through ``run_or_defer``: it runs at once when the lock is free, and is
queued otherwise (re-entered by its own holder, or held by another thread); the holder runs the queue when
its outermost section ends, before anyone else can take the lock. It never blocks, and it never runs work
inside another section of the same lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

logger = logging.getLogger(__name__)


class DeferringLock:
    """A re-entrant lock (``with lock:``) whose ``run_or_defer`` work never runs inside a held section."""

    __slots__ = ("_rlock", "_depth", "_deferred")

    def __init__(self) -> None:
        self._rlock = threading.RLock()
        self._depth = 0  # nesting of the holder's sections (only the holder changes it)
        self._deferred: deque[tuple[Callable[..., None], tuple]] = deque()

    def __enter__(self) -> "DeferringLock":
        self._rlock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._depth == 1:
                self._run_deferred()
        finally:
            self._depth -= 1
            self._rlock.release()
        if self._depth == 0 and self._deferred:  # queued between the run above and the release
            self._drain_if_free()

    def run_or_defer(self, work: Callable[..., None], *args) -> None:
        """``work(*args)`` under the lock now when it is free, else queued for its holder (see the module)."""
        if self._rlock.acquire(blocking=False):
            if self._depth == 0:  # free: nobody is halfway through anything
                self._depth += 1
                try:
                    work(*args)
                finally:
                    self.__exit__()
                return
            self._rlock.release()  # re-entered by this thread's own section: after it
        self._deferred.append((work, args))
        self._drain_if_free()  # the holder may have let go meanwhile

    def _drain_if_free(self) -> None:
        if self._rlock.acquire(blocking=False):
            if self._depth == 0:
                self._depth += 1
                self.__exit__()
            else:
                self._rlock.release()

    def _run_deferred(self) -> None:
        while self._deferred:
            try:
                work, args = self._deferred.popleft()
            except IndexError:
                return
            try:
                work(*args)
            except Exception:  # noqa: BLE001 - deferred work must not raise into an unrelated section
                logger.exception("deferred host-buffer work %r failed", work)
