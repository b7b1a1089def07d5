"""``DeviceDispatch``: every op of an iteration runs through the device's backend here, and an op that runs
out of memory is relieved and retried once, the same way on a GPU and on the emulated device.

NOTE [Relief inside the op]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The CUDA caching allocator raises ``torch.OutOfMemoryError`` inside the allocating op, after freeing its
own cached blocks; its out-of-memory observers cannot make it retry, and its free-memory callbacks run
under the allocator's lock. So relief belongs around the op, at the dispatcher: this mode catches the
error, leaves the ``except`` block (its traceback holds the op's arguments and would pin them), lets the
pressure handler free memory (the executor's NOTE [Relief under pressure]: stream-ordered release of held
sources, evicting prefetched tensors, passive swap of idle kept tensors), and runs the op once more. The
simulated backend raises at the allocation too, before the op's outputs exist, so both devices take this
path. Never retried: ops that write their inputs (a partial write cannot be undone), ops that write state
their schema does not declare (batch norm's running statistics while training: the momentum update would be
applied twice; NOTE [Undeclared state writes] in trace/state_writes.py), ops that draw random numbers (a
retry would shift the generator; the exactness judge's rule, so fused attention at ``dropout_p == 0`` is
retried whatever its ``nondeterministic_seeded`` tag), collectives (the other ranks are inside them),
anything while a CUDA graph is captured, and any op while relief itself runs (its own ops do not re-enter it).

Relief is done when the failed request would fit, not when it freed as many bytes as were missing: on a caching
allocator freed bytes stay in their stream's pool, inside segments that live blocks pin (NOTE [The caching
allocator model] in ``simulated/caching.py``). Where the backend can tell (``request_fit``), the handler asks
``request_fits()`` while it works. Chameleon's own swap-in allocation is one ``aten.empty`` that must not be
relieved here as well as by its caller (``StreamDevice._allocate_device_bytes``): it runs under ``direct()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chameleon_dist.device.base import PressureHandler
from chameleon_dist.device.producers import ProducerStreams
from chameleon_dist.trace.exactness import draws_random_numbers, writes_undeclared_state
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def retryable(func, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether ``func(*args, **kwargs)``, which ran out of memory, may run again after relief (NOTE [Relief
    inside the op]). Arguments not given count as unknown, except where the schema defaults them."""
    if func._schema.is_mutable or func.namespace in _COLLECTIVE_NAMESPACES:
        return False
    return not writes_undeclared_state(func, args, kwargs) and not draws_random_numbers(func, args, kwargs)


class DeviceDispatch(TorchDispatchMode):
    """Runs each op through ``backend.run_op``; relieves and retries one that runs out of memory."""

    def __init__(self, backend) -> None:
        super().__init__()
        self.backend = backend
        self.handler: PressureHandler | None = None
        self._relief = threading.local()  # ``relieving``, per thread: another thread short meanwhile waits its turn
        self.relieved_ops = 0  # ops that ran out of memory, were relieved and ran again
        self.relief_freed_bytes = 0
        self.producers = ProducerStreams()  # NOTE [Producer and reader streams] in producers.py
        # called with (func, args, kwargs) before each op runs (the runtime's ``BufferSnapshot``: NOTE
        # [Buffers a retry gives back] in retry_buffers.py); None: nothing to hear
        self.before_write: Callable[[Any, tuple, dict], None] | None = None

    @property
    def relieving(self) -> bool:
        """This thread runs relief now (its ops do not re-enter it; NOTE [Threads and locks] in locking.py)."""
        return getattr(self._relief, "active", False)

    @relieving.setter
    def relieving(self, active: bool) -> None:
        self._relief.active = active

    def __enter__(self):
        self.producers.begin(self.backend.current_stream())
        return super().__enter__()

    def __exit__(self, *exc):
        self.producers.end()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        backend = self.backend
        if self.before_write is not None:
            self.before_write(func, args, kwargs)
        try:
            out = backend.run_op(func, args, kwargs)
            self.producers.note(out, backend.current_stream())
            return out
        except torch.OutOfMemoryError as error:
            if self.handler is None or self.relieving or self.direct_now or backend.is_capturing() \
                    or not retryable(func, args, kwargs):
                raise
            short_bytes = backend.short_bytes(error, func, args, kwargs)
            fits = backend.request_fit(error)
        self.relieve(short_bytes, str(func), fits)  # outside the except block: NOTE [Relief inside the op]
        self.relieved_ops += 1
        out = backend.run_op(func, args, kwargs)
        self.producers.note(out, backend.current_stream())
        return out

    @property
    def direct_now(self) -> bool:
        """This thread's ops raise out-of-memory without relief (``direct``)."""
        return getattr(self._relief, "direct", False)

    @contextlib.contextmanager
    def direct(self):
        """Ops in here are not relieved (the caller relieves once itself: a swap-in's allocation)."""
        before = self.direct_now
        self._relief.direct = True
        try:
            yield
        finally:
            self._relief.direct = before

    def request_fits(self) -> bool | None:
        """During relief: whether the request that ran short would fit now (None: the backend cannot tell)."""
        fits = getattr(self._relief, "fits", None)
        return None if fits is None else bool(fits())

    def relieve(self, short_bytes: int, what: str, fits=None) -> int:
        """Ask the pressure handler for ``short_bytes``; its own ops never re-enter relief. ``fits``: a callable
        saying whether the short request would fit now (``request_fits``)."""
        handler = self.handler
        if handler is None or self.relieving:
            return 0
        self.relieving = True
        self._relief.fits = fits
        try:
            with self.backend.host_side():
                freed_bytes = handler(short_bytes)
        finally:
            self.relieving = False
            self._relief.fits = None
        self.relief_freed_bytes += freed_bytes
        logger.debug("out of memory in %s (%s short): relief freed %s; retrying once", what,
                     format_bytes(short_bytes), format_bytes(freed_bytes))
        return freed_bytes
