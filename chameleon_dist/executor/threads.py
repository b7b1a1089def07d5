"""Which threads drive a ``SwapExecutor``, and the one lock they share (NOTE [Threads and locks] in
``device/locking.py``).

NOTE [Threads of an iteration]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An iteration's ops run where the iteration's thread-local state is: the dispatch modes (the device's dispatch
layer, the profiler's) and the executor's saved-tensor hooks, entered by ``Chameleon.iteration()`` on the
caller's thread. On a GPU the autograd engine's device threads (one per GPU: two at once for a model split
over two GPUs with a ``device_map``) get that state from the engine with each backward pass; nothing to do.
On the CPU the engine runs the pass on the calling thread. A thread the program starts itself has none of
that state: its ops would not be metered, relieved or seen by the profiler, its saves not swapped. It joins
the iteration with ``with executor.threads.joined():``, which gives it the iteration thread's state as the
engine gives its workers (the same mode objects and hooks); its ops then go through the same dispatch layer
and its saves through the same executor, under the executor's lock. Unpacking a tensor of the iteration on
a thread that has not joined (no dispatch mode at all) raises, naming ``joined()``: a wrong meter is as bad
as a wrong gradient for a runtime whose job is fitting memory.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from chameleon_dist.device.locking import SharedLock


class IterationThreads:
    """The executor's lock (``lock``) and the thread-local state of its active iteration, for threads that join it."""

    def __init__(self) -> None:
        self.lock = SharedLock()
        self._modes: list | None = None  # the iteration thread's dispatch modes, bottom first; None: no iteration
        self._hooks: tuple | None = None  # its saved-tensor hooks (the executor's)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """The iteration's block (inside its modes and hooks): what it has here, other threads may join."""
        self._modes = _get_current_dispatch_mode_stack()
        self._hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            yield
        finally:
            self._modes = self._hooks = None

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """Run this thread's ops inside the iteration active on another thread (NOTE [Threads of an iteration]).

        Raises:
            RuntimeError: when no iteration is active (enter ``Chameleon.iteration()`` on the main thread first).
        """
        modes, hooks = self._modes, self._hooks
        if modes is None or hooks is None:
            raise RuntimeError("executor.threads.joined(): no iteration is active to join (enter "
                               "Chameleon.iteration() on the training thread first, then join from the worker)")
        for mode in modes:
            _push_mode(mode)
        torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
        try:
            yield
        finally:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            for _ in modes:
                _pop_mode()

    def check_thread(self) -> None:
        """An unpack: raise when this thread runs outside the iteration's state (it neither is the iteration's
        thread nor joined it, nor is an autograd worker that inherited it)."""
        if self._modes and torch._C._len_torch_dispatch_stack() == 0:
            raise RuntimeError(
                "a tensor saved in a Chameleon iteration was unpacked on a thread outside it: its ops would run "
                "unmetered. Run that thread's work inside `with chameleon.executor.threads.joined():` (NOTE "
                "[Threads of an iteration] in executor/threads.py)")
