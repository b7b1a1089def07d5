"""``SharedLock``: one re-entrant lock over a group of state that several threads share.

NOTE [Threads and locks]
~~~~~~~~~~~~~~~~~~~~~~~~
On a GPU the autograd engine runs a backward pass on one worker thread per device, not on the caller's: the
saved-tensor hooks (the swap executor's unpack, its prefetches and releases) and every op of the pass run
there, and a model split over two GPUs (``device_map``) runs two such threads at once, both driving ONE
executor and ONE device. The engine hands each worker the caller's thread-local state (dispatch modes,
saved-tensor hooks, grad mode), so their ops go through the same dispatch layer. On the CPU the engine runs
the pass on the calling thread; a thread of the program's own joins an iteration with
``SwapExecutor.joined()`` (which hands it the same state, as the engine would).

So each shared object group has one re-entrant lock, taken around every public entry point that reads or
changes its state:

1. the **executor's** (``SwapExecutor``: its per-attempt lists and dicts, the placed schedule, counters, the
   entries' transitions, pressure relief): pack, unpack, ``on_op``, relief, ``new_attempt``, ``note_writes``;
2. the **device's** (``StreamDevice``: held sources, host buffers waiting for their copies, stall timing;
   on the simulated backend the same lock also guards its clock, streams, counters and hazard checks):
   copies, waits, releases, ``synchronize``.

**Order**: the executor's lock before the device's, never the reverse. Nothing holding the device's lock calls
into the executor: relief runs from the dispatch layer once the op that ran short has left the backend, and a
swap-in's allocation (which may ask for relief) is made before the device's lock is taken. Leaf locks below
these two (the host pool's, the simulated allocator's) are taken last and call nothing back.

**Finalizers** (a dropped copy handle's stream wait, a swap entry's host buffer, a dead storage's forgotten
key) run wherever garbage collection runs: possibly inside a locked section on the same thread (hence
re-entrant locks), possibly on a thread that holds a leaf lock while another thread holds this one. A
finalizer therefore never blocks: ``run_or_defer`` runs its work at once when the lock is free or already
held by its thread (always, with one thread: the single-threaded behaviour is unchanged), else queues it for
the holder, which runs it before it lets go of the lock.

The cost with one thread is one uncontended acquire per entry point (not per tensor or per op of a loop).

Not covered yet: an op relieved on one thread is retried once, and another thread's allocation may take what
relief freed before the retry runs (under a tight budget two threads can run out of memory where one fits);
the simulated allocator's own finalizer (a dead block) still waits for its lock.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from typing import Callable

logger = logging.getLogger(__name__)


class SharedLock:
    """A re-entrant lock (``with lock:``) plus the work finalizers queued while another thread held it (NOTE
    [Threads and locks]). ``rlock`` may be an existing ``threading.RLock`` to share (the simulated clock's)."""

    __slots__ = ("rlock", "_deferred", "_depth")

    def __init__(self, rlock=None) -> None:
        self.rlock = rlock if rlock is not None else threading.RLock()
        self._deferred: deque[tuple[Callable[..., None], tuple]] = deque()
        self._depth = 0  # nesting of this SharedLock's holder (only the holder changes it)

    def __enter__(self) -> "SharedLock":
        self.rlock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        try:
            if self._deferred and not self._depth:
                self._run_deferred()  # (still holding the lock: work that takes it again nests)
        finally:
            self.rlock.release()

    def run_or_defer(self, work: Callable[..., None], *args) -> None:
        """Run ``work(*args)`` under the lock now if this thread can take it without waiting, else queue it for
        the thread that holds it (never blocks: for finalizers). Exceptions from ``work`` are logged, not raised."""
        if self.rlock.acquire(blocking=False):
            self._depth += 1
            try:
                _run_quietly(work, args)
            finally:
                self.__exit__()
            return
        self._deferred.append((work, args))
        if self.rlock.acquire(blocking=False):  # the holder let go meanwhile: nobody else will run it
            self._depth += 1
            self.__exit__()

    def _run_deferred(self) -> None:
        deferred = self._deferred
        while deferred:
            try:
                work, args = deferred.popleft()
            except IndexError:
                return
            _run_quietly(work, args)


def _run_quietly(work: Callable[..., None], args: tuple) -> None:
    try:
        work(*args)
    except Exception:  # noqa: BLE001 - finalizer work must not raise into whoever happens to hold the lock
        logger.debug("deferred finalizer work %r failed", work, exc_info=True)


def lock_entry_points(cls: type, *names: str) -> None:
    """Make each named method of ``cls`` run under its instance's ``_lock`` (NOTE [Threads and locks])."""
    for name in names:
        setattr(cls, name, _locked(getattr(cls, name)))


def _locked(method):
    @functools.wraps(method)
    def run_locked(self, *args, **kwargs):
        lock = self._lock  # (``SharedLock.__enter__`` / ``__exit__`` inlined: this runs per pack, unpack and copy)
        with lock.rlock:
            lock._depth += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                lock._depth -= 1
                if lock._deferred and not lock._depth:
                    lock._run_deferred()

    return run_locked
