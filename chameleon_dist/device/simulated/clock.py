"""The simulated device clock: streams, events and copy links on a device timeline that lags the host.

NOTE [The simulated device clock]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two clocks, in seconds from the device's creation:

- the **host clock** (``DeviceClock.host_s``) advances by the host's own work: the wall time the training
  thread spends outside kernels (the loop, the framework, Chameleon itself), or a fixed cost per op for
  runs that must repeat exactly; and it jumps forward when the host synchronises with the device;
- each **stream** has the device time at which the work queued on it so far will have run
  (``SimStream.ready_s``). Work queued at host time ``h`` starts at ``max(h, ready_s)``, after what the
  stream waits on, and occupies the stream for its modelled cost. So the host runs ahead of the device
  exactly when its work per op is shorter than the device's, as on a GPU.

An event recorded on a stream takes the time the stream reaches it; ``query()`` compares that time with
the host clock (an event recorded a few ops ago has usually not fired when the device lags);
``synchronize()`` moves the host clock to it. A copy occupies its direction of the host link for
``nbytes / bytes_per_s`` (each direction slows to ``duplex_factor`` of its rate while the other one
copies too), after its stream's earlier work and the events it waits on. The data itself is computed
eagerly on the CPU when the work is queued: values are exact, and the hazard checker
(``simulated/hazards.py``) proves that no access could have seen them differ on the device's timeline.
"""

from __future__ import annotations

import math
import threading

_INSTANT = math.inf


class GraphCaptureQueryError(RuntimeError):
    """An event was queried or the host waited on the device during a (simulated) CUDA graph capture."""


class DeviceClock:
    """The host clock and every stream's and link's device time (one per simulated device)."""

    def __init__(self) -> None:
        self.host_s = 0.0
        self.streams: list[SimStream] = []
        self.capturing = False  # a CUDA graph is being captured: events and streams may not be queried
        # every stream's, link's and the host's time change under this lock: threads share the device (NOTE
        # [Threads and locks] in device/locking.py; the backend's and the device's lock are this one)
        self.lock = threading.RLock()

    def refuse_under_capture(self, what: str) -> None:
        """CUDA refuses a query or a host wait while a stream is capturing (and invalidates the capture)."""
        if self.capturing:
            raise GraphCaptureQueryError(
                f"{what} while a CUDA graph is being captured (simulated): CUDA refuses it with "
                "cudaErrorStreamCaptureUnsupported and invalidates the capture")

    def advance_host(self, seconds: float) -> None:
        with self.lock:
            self.host_s += seconds

    def wait_for(self, device_s: float) -> None:
        """The host blocks until the device reaches ``device_s``."""
        with self.lock:
            if device_s > self.host_s:
                self.host_s = device_s

    def device_idle_s(self) -> float:
        """When every stream's queued work has run."""
        return max([self.host_s, *(s.ready_s for s in self.streams)])


class SimStream:
    """One stream on the device timeline. ``busy_s`` is the device time its work occupied it."""

    __slots__ = ("clock", "name", "ready_s", "busy_s", "__weakref__")

    def __init__(self, clock: DeviceClock, name: str) -> None:
        self.clock = clock
        self.name = name
        self.ready_s = 0.0
        self.busy_s = 0.0
        clock.streams.append(self)

    def __repr__(self) -> str:
        return f"<simulated stream {self.name} ready at {self.ready_s * 1e3:.3f} ms>"

    def start_s(self) -> float:
        """When work queued now would start (after the host queued it and the stream's earlier work)."""
        host_s = self.clock.host_s
        return host_s if host_s > self.ready_s else self.ready_s

    def launch(self, duration_s: float) -> tuple[float, float]:
        """Queue work of ``duration_s`` device seconds; returns its (start, end) on the device timeline."""
        with self.clock.lock:
            start_s = self.start_s()
            end_s = start_s + duration_s
            self.ready_s = end_s
            self.busy_s += duration_s
        return start_s, end_s

    def wait_event(self, event: "SimEvent") -> None:
        with self.clock.lock:
            if event.time_s is not None and event.time_s > self.ready_s:
                self.ready_s = max(event.time_s, self.clock.host_s)

    def wait_stream(self, other: "SimStream") -> None:
        with self.clock.lock:
            if other.ready_s > self.ready_s:
                self.ready_s = max(other.ready_s, self.clock.host_s)

    def synchronize(self) -> None:
        self.clock.refuse_under_capture("the host waited for a stream")
        self.clock.wait_for(self.ready_s)


class SimEvent:
    """An event on the device timeline (a CUDA event's semantics; an unrecorded event is complete)."""

    __slots__ = ("clock", "time_s", "timing")

    def __init__(self, clock: DeviceClock, timing: bool = False) -> None:
        self.clock = clock
        self.time_s: float | None = None
        self.timing = timing

    def record(self, stream: SimStream) -> None:
        self.time_s = stream.launch(0.0)[1]

    def query(self) -> bool:
        self.clock.refuse_under_capture("an event was queried")
        return self.time_s is None or self.time_s <= self.clock.host_s

    def synchronize(self) -> None:
        self.clock.refuse_under_capture("the host waited for an event")
        if self.time_s is not None:
            self.clock.wait_for(self.time_s)

    def elapsed_s(self, end: "SimEvent") -> float:
        if self.time_s is None or end.time_s is None:
            raise RuntimeError("elapsed time between simulated events that were not both recorded")
        return end.time_s - self.time_s


class SimLink:
    """One direction of the host link: copies on it run one after another at ``bytes_per_s``
    (``math.inf``: instant), slowed to ``duplex_factor`` of it while the other direction copies too."""

    __slots__ = ("name", "bytes_per_s", "duplex_factor", "ready_s", "busy_s", "copied_bytes", "copies", "other")

    def __init__(self, name: str, bytes_per_s: float | None, duplex_factor: float) -> None:
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"device.{name}_bytes_per_s must be > 0 bytes/s, got {bytes_per_s}")
        self.name = name
        self.bytes_per_s = _INSTANT if bytes_per_s is None else float(bytes_per_s)
        self.duplex_factor = duplex_factor
        self.ready_s = 0.0
        self.busy_s = 0.0
        self.copied_bytes = 0
        self.copies = 0
        self.other: SimLink | None = None

    def transfer_s(self, nbytes: int, start_s: float) -> float:
        """Seconds a copy of ``nbytes`` starting at ``start_s`` takes (the other direction's copies queued
        so far overlap its start; later ones are not re-timed: a simplification)."""
        rate = self.bytes_per_s
        if rate == _INSTANT or nbytes == 0:
            return 0.0
        other = self.other
        overlap_s = other.ready_s - start_s if other is not None else 0.0
        if overlap_s <= 0 or self.duplex_factor >= 1.0:
            return nbytes / rate
        slow_rate = rate * self.duplex_factor
        if nbytes <= overlap_s * slow_rate:
            return nbytes / slow_rate
        return overlap_s + (nbytes - overlap_s * slow_rate) / rate

    def copy(self, stream: SimStream, nbytes: int) -> tuple[float, float]:
        """Queue a copy of ``nbytes`` on ``stream`` over this link; returns its (start, end)."""
        with stream.clock.lock:
            start_s = max(stream.start_s(), self.ready_s)
            duration_s = self.transfer_s(nbytes, start_s)
            end_s = start_s + duration_s
            stream.ready_s = end_s
            stream.busy_s += duration_s
            self.ready_s = end_s
            self.busy_s += duration_s
            self.copied_bytes += nbytes
            self.copies += 1
        return start_s, end_s


def link_pair(h2d_bytes_per_s: float | None, d2h_bytes_per_s: float | None, duplex_factor: float) -> tuple[SimLink, SimLink]:
    """The two directions of one host link, each slowing the other while both copy."""
    h2d = SimLink("h2d", h2d_bytes_per_s, duplex_factor)
    d2h = SimLink("d2h", d2h_bytes_per_s, duplex_factor)
    h2d.other, d2h.other = d2h, h2d
    return h2d, d2h
