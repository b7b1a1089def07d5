"""The hazard checker of the simulated backend: any access that the device clock would let race raises.

NOTE [Stream hazards]
~~~~~~~~~~~~~~~~~~~~~
Every device block remembers, on the device timeline, the last stream that wrote it (and when that write
ends) and, per stream, when its latest read ends. A kernel or copy on stream X that starts at ``t``:

- reading or writing a block whose last write, by another stream, ends after ``t`` is a hazard: a copy
  that reads a tensor before its producer's kernel ended, a swapped-in tensor read before its
  host-to-device copy completed;
- writing a block that another stream's kernel still reads after ``t`` is a hazard. A write under a
  device-to-host copy that still reads it tears the copy instead: its host buffer is marked, and a later
  copy that reads that host buffer back is the hazard (a GPU runs the same race silently; the executor
  never restores such a copy, since it counts the write and raises autograd's in-place error at unpack);

When a block dies it goes back to the stream it was allocated on, at once, as the CUDA caching allocator
hands it back (after the streams the program named with ``record_stream``, as the allocator defers it): the next allocation on that stream may reuse it from ``max(host time, that stream's
queued work)``. Another stream's access ending later is a hazard (a block reused while a copy still reads
or writes it); the fix is the allocation stream waiting on the copy's done-event before the last reference
goes, never ``record_stream``. A hazard found while a storage is being freed (in a finaliser, where an
exception cannot propagate) is raised at the next op or copy. This is what PyTorch's CUDA sanitizer checks on
a GPU; here it runs in every test.
"""

from __future__ import annotations

from chameleon_dist.device.simulated.clock import SimStream


class StreamHazardError(RuntimeError):
    """Two streams touch one device block in an order the device timeline does not guarantee."""


class BlockAccess:
    """The device-timeline accesses of one block that a later access or a free must not race."""

    __slots__ = ("stream", "write_stream", "write_end_s", "reads", "copied_to", "recorded")

    def __init__(self, stream: SimStream) -> None:
        self.stream = stream  # the allocation stream
        self.write_stream: SimStream | None = None
        self.write_end_s = 0.0
        self.reads: dict[SimStream, float] | None = None  # stream -> when its latest read of the block ends
        self.copied_to: dict[SimStream, int] | None = None  # copy stream -> the host buffer its read fills
        self.recorded: set[SimStream] | None = None  # streams the program recorded (``record_stream``)


class HazardChecker:
    """Checks accesses and frees of device blocks on the device timeline (NOTE [Stream hazards])."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.checked_accesses = 0
        self._pending: StreamHazardError | None = None
        self.torn_host_buffers: set[int] = set()  # keys of host buffers a racing write tore

    def raise_pending(self) -> None:
        pending = self._pending
        if pending is not None:
            self._pending = None
            raise pending

    def access(self, block: BlockAccess, stream: SimStream, start_s: float, end_s: float, write: bool,
               what: str, copied_to: int | None = None) -> None:
        """One access of ``block`` on ``stream`` from ``start_s`` to ``end_s``; ``copied_to``: a copy's read
        that fills the host buffer with this key."""
        if not self.enabled:
            return
        self.checked_accesses += 1
        writer = block.write_stream
        if writer is not None and writer is not stream and block.write_end_s > start_s + 1e-15:
            raise StreamHazardError(
                f"{what} on stream {stream.name} starts at {start_s * 1e6:.3f} us on the device, before stream "
                f"{writer.name}'s write of the block ends ({block.write_end_s * 1e6:.3f} us): order the stream "
                f"after the writer (wait_stream / wait_event) first"
            )
        reads = block.reads
        if write:
            if reads:
                for reader, read_end_s in reads.items():
                    if reader is not stream and read_end_s > start_s + 1e-15:
                        torn = (block.copied_to or {}).get(reader)
                        if torn is not None:
                            self.torn_host_buffers.add(torn)
                            continue
                        raise StreamHazardError(
                            f"{what} on stream {stream.name} writes a block at {start_s * 1e6:.3f} us while "
                            f"stream {reader.name} still reads it until {read_end_s * 1e6:.3f} us"
                        )
                block.reads = None
                block.copied_to = None
            block.write_stream = stream
            block.write_end_s = end_s
        else:
            if reads is None:
                reads = block.reads = {}
            if reads.get(stream, 0.0) < end_s:
                reads[stream] = end_s
            if copied_to is not None:
                if block.copied_to is None:
                    block.copied_to = {}
                block.copied_to[stream] = copied_to
                self.torn_host_buffers.discard(copied_to)  # filled anew

    def read_host(self, key: int, what: str) -> None:
        """A copy reads the host buffer ``key``: a torn one is a hazard."""
        if self.enabled and key in self.torn_host_buffers:
            raise StreamHazardError(
                f"{what} reads a host buffer whose device-to-host copy was torn: a kernel wrote the source "
                f"while the copy still read it (order the write after the copy's done-event)"
            )

    def freed(self, block: BlockAccess, nbytes: int) -> None:
        """``block`` went back to its allocation stream now (possibly from a finaliser: deferred raise)."""
        if not self.enabled or self._pending is not None:
            return
        owner = block.stream
        reuse_s = owner.start_s()
        recorded = block.recorded or ()  # the allocator defers reuse until these streams' work has run
        late = []
        if (block.write_stream is not None and block.write_stream is not owner and block.write_stream not in recorded
                and block.write_end_s > reuse_s + 1e-15):
            late.append((block.write_stream, block.write_end_s, "writes"))
        for reader, read_end_s in (block.reads or {}).items():
            if reader is not owner and reader not in recorded and read_end_s > reuse_s + 1e-15:
                late.append((reader, read_end_s, "reads"))
        if late:
            stream, end_s, verb = late[0]
            self._pending = StreamHazardError(
                f"a {nbytes}-byte block went back to its allocation stream {owner.name}, which may reuse it from "
                f"{reuse_s * 1e6:.3f} us, while stream {stream.name} still {verb} it until {end_s * 1e6:.3f} us: "
                f"the allocation stream must wait on that work's event before the last reference is dropped"
            )
