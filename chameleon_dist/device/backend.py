"""The small interface ``StreamDevice`` runs over: streams, events, copies, allocation and memory figures.

NOTE [One device code path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
There is one device implementation, ``StreamDevice`` (a copy stream per direction, done-events, a pinned
host pool, stream-ordered release, relief of memory pressure), and two backends under it:

- the CUDA backend (``device/cuda.py``): real streams and events, the caching allocator, ``mem_get_info``;
- the simulated backend (``device/simulated/``): CPU tensors computed eagerly (bit-identity is checked for
  real), with a device clock that lags the host, an allocator model that raises out-of-memory at the
  allocation, and a hazard checker that raises ``StreamHazardError`` on any access the clock would let race.

A backend only answers "do this on that stream" and "what does memory look like". Every decision (when
to release, what to wait for, how to relieve pressure) lives above it, so the emulated device runs the
code a GPU runs. A behaviour that exists on one backend only is a defect.

Streams and events follow CUDA's semantics: an event recorded on a stream completes when the
stream's work queued before it has run; ``query()`` answers now, without waiting; ``Stream.wait_event``
orders later work on the stream after the event without blocking the host; ``synchronize`` blocks the host.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol

import torch


class BackendEvent(Protocol):
    def record(self, stream: Any) -> None: ...

    def query(self) -> bool:
        """True once the work queued before the record has run (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block the host until the event has completed."""
        ...


class BackendStream(Protocol):
    def wait_event(self, event: BackendEvent) -> None:
        """Later work on this stream runs after ``event`` (the host does not block)."""
        ...

    def wait_stream(self, other: "BackendStream") -> None:
        """Later work on this stream runs after everything queued on ``other`` so far."""
        ...

    def synchronize(self) -> None: ...


class Backend(Protocol):
    """What ``StreamDevice`` needs from an accelerator runtime (see NOTE [One device code path])."""

    name: str
    emulated: bool
    meta_tensors: bool  # the device's tensors are meta tensors (sizes only; the simulated backend's option)
    capacity_bytes: int

    def current_stream(self) -> BackendStream: ...

    def new_stream(self) -> BackendStream: ...

    def use_stream(self, stream: BackendStream) -> ContextManager[None]:
        """Make ``stream`` current on this thread inside the block."""
        ...

    def new_event(self, timing: bool = False) -> BackendEvent: ...

    def host_time_s(self) -> float:
        """The host's clock now, in seconds (the simulated backend: its simulated host clock)."""
        ...

    def elapsed_s(self, start: BackendEvent, end: BackendEvent) -> float:
        """Device seconds between two completed timing events."""
        ...

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """``destination.copy_(source)`` queued on the current stream without blocking the host."""
        ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory (uint8) on the current stream; raises ``torch.OutOfMemoryError``."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: BackendStream) -> None:
        """``Tensor.record_stream`` (a program's own cross-stream use; Chameleon itself never calls it)."""
        ...

    def host_allocator(self) -> Callable[[int], torch.Tensor] | None:
        """Page-locked host buffers of exactly ``nbytes`` (None: plain host tensors)."""
        ...

    def host_side(self) -> ContextManager[None]:
        """Ops inside the block make host tensors (host buffers), not device memory."""
        ...

    def active(self) -> ContextManager[None]:
        """Entered around one training iteration on the training thread."""
        ...

    def run_op(self, func, args: tuple, kwargs: dict) -> Any:
        """Run one aten op as the device runs it (the simulated backend also meters and times it); raises
        ``torch.OutOfMemoryError`` before the op's outputs exist when its allocations do not fit."""
        ...

    def is_capturing(self) -> bool:
        """True while a CUDA graph is being captured (ops must not be retried then)."""
        ...

    def is_device_tensor(self, tensor: torch.Tensor) -> bool: ...

    def track(self, tensor: torch.Tensor) -> None:
        """Count a tensor made outside an iteration as device memory (the simulated backend; else a no-op)."""
        ...

    def live_bytes(self) -> int: ...

    def peak_bytes(self) -> int: ...

    def reset_peak(self) -> None: ...

    def synchronize(self) -> None:
        """Block the host until every stream is idle."""
        ...

    def random_state(self) -> torch.Tensor | None: ...

    def set_random_state(self, state: torch.Tensor) -> None: ...
