"""A model of the CUDA caching allocator's segments, per-stream pools and splitting, for the simulated backend.

NOTE [The caching allocator model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a GPU the bytes a tensor frees do not go back to the device: its block returns, free, to the pool of the
stream it was allocated on, inside the segment (one ``cudaMalloc``) it was cut from, and merges with the free
neighbours there. A later request is served only by one free block of that stream's pool that is large enough;
else the allocator asks for a new segment, and when that does not fit it releases every segment that is
wholly free (``release_cached_blocks``) and asks once more, before it raises. So relief that frees "enough"
bytes may still leave the retry short: the freed blocks sit in segments that live blocks pin, or on another
stream. This model follows ``CUDACachingAllocator.cpp`` (sizes in ``device/caching_geometry.py``): requests
round to 512 B; a small pool (requests <= 1 MiB, 2 MiB segments) and a large pool (20 MiB segments for
requests < 10 MiB, larger ones their size rounded to 2 MiB) per stream; best fit (the smallest free block
that fits, same stream and pool); a block is split when the remainder is large enough; free blocks merge
with free neighbours. ``allocated_bytes`` is what ``memory_allocated`` says (block sizes), ``reserved_bytes``
what ``memory_reserved`` says (segments), and the capacity bounds the reserved bytes, as a GPU's memory (or
``set_per_process_memory_fraction``) bounds its ``cudaMalloc`` calls.

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) each stream's pool has one
segment of virtual addresses that grows by mapping pages (2 MiB small, 20 MiB large); releasing cached memory
unmaps every page that lies wholly inside a free block, and those pages serve any stream next. Fragmentation
between segments then largely disappears: what stays is the rounding to pages.

Blocks are known by the caller's handle (the simulated allocator keys them by storage identity), never by a
data pointer, so meta tensors work the same. Offsets are virtual and only order a segment's blocks.
"""

from __future__ import annotations

from chameleon_dist.device import caching_geometry as geometry

_VIRTUAL_BYTES = 1 << 60  # an expandable segment's address range: unbounded for any model run


class CacheBlock:
    """A run of one segment's bytes: allocated (handed to a tensor) or free (cached in its pool)."""

    __slots__ = ("segment", "offset", "size", "allocated", "prev", "next")

    def __init__(self, segment: "Segment", offset: int, size: int) -> None:
        self.segment = segment
        self.offset = offset
        self.size = size
        self.allocated = False
        self.prev: CacheBlock | None = None
        self.next: CacheBlock | None = None


class Segment:
    """One ``cudaMalloc`` (or, expandable, one pool's virtual range and the pages mapped in it)."""

    __slots__ = ("stream", "small", "size", "expandable", "mapped_pages", "page_bytes", "head")

    def __init__(self, stream: object, small: bool, size: int, expandable: bool, page_bytes: int) -> None:
        self.stream = stream
        self.small = small
        self.size = size
        self.expandable = expandable
        self.page_bytes = page_bytes
        self.mapped_pages: set[int] = set()
        self.head = CacheBlock(self, 0, size)

    def reserved_bytes(self) -> int:
        return len(self.mapped_pages) * self.page_bytes if self.expandable else self.size

    def pages_of(self, block: CacheBlock, whole: bool) -> range:
        """The pages ``block`` touches (``whole``: only those lying wholly inside it)."""
        page = self.page_bytes
        if whole:
            return range(-(-block.offset // page), (block.offset + block.size) // page)
        return range(block.offset // page, -(-(block.offset + block.size) // page))


class CachingAllocatorModel:
    """Segments, per-stream small and large pools, splitting and merging (NOTE [The caching allocator model]).

    ``malloc(nbytes, stream)`` returns a ``CacheBlock`` or None when even after releasing the cached segments the
    request does not fit under ``capacity_bytes`` (reserved bytes); ``free(block)`` returns it to its pool.
    ``force=True`` allocates past the capacity (what the device held before metering began: parameters).
    """

    def __init__(self, capacity_bytes: int, expandable_segments: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.expandable_segments = expandable_segments
        self.segments: list[Segment] = []
        self._free: dict[tuple[int, bool], set[CacheBlock]] = {}  # (id(stream), small) -> free blocks
        self._expandable: dict[tuple[int, bool], Segment] = {}
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.released_segments = 0  # segments (or pages) given back by release_cached (a GPU's cudaFree calls)

    # ---- queries ----------------------------------------------------------------------------
    def fits(self, nbytes: int, stream: object) -> bool:
        """Whether ``malloc(nbytes, stream)`` would succeed now (releasing cached segments if it must)."""
        size = geometry.round_request(nbytes)
        if size == 0:
            return True
        small = geometry.is_small(size)
        block = self._best_fit(size, stream, small)
        room_bytes = self.capacity_bytes - self.reserved_bytes
        if self.expandable_segments:
            if block is None:  # (the pool has no segment yet: malloc makes one, from offset 0)
                page = geometry.page_bytes(size)
                return -(-size // page) * page <= room_bytes + self.releasable_bytes()
            need_bytes = self._pages_to_map(block, size) * block.segment.page_bytes
            if need_bytes <= room_bytes:
                return True
            # a release unmaps the block's own whole free pages too: they are mapped again for it
            touched = block.segment.pages_of(CacheBlock(block.segment, block.offset, size), False)
            own_bytes = sum(1 for page in _mapped_inside(block.segment, block) if page in touched) \
                * block.segment.page_bytes
            return need_bytes + own_bytes <= room_bytes + self.releasable_bytes()
        if block is not None:
            return True
        return geometry.segment_bytes(size) <= room_bytes + self.releasable_bytes()

    def releasable_bytes(self) -> int:
        """Reserved bytes ``release_cached`` would give back: wholly free segments (expandable: wholly free pages)."""
        total = 0
        for segment in self.segments:
            if segment.expandable:
                total += sum(len(_mapped_inside(segment, b)) for b in _blocks(segment) if not b.allocated) \
                    * segment.page_bytes
            elif not segment.head.allocated and segment.head.next is None:
                total += segment.size
        return total

    def free_cached_bytes(self) -> int:
        """Reserved but not allocated (``memory_reserved - memory_allocated``): the fragmentation a failed
        request may be stuck behind."""
        return self.reserved_bytes - self.allocated_bytes

    def largest_free_block_bytes(self, stream: object, nbytes: int) -> int:
        small = geometry.is_small(geometry.round_request(nbytes))
        blocks = self._free.get((id(stream), small), ())
        return max((b.size for b in blocks if not b.segment.expandable), default=0)

    # ---- malloc and free ----------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: object, force: bool = False) -> CacheBlock | None:
        size = geometry.round_request(nbytes)
        if size == 0:
            size = geometry.ROUND_BYTES  # (callers give 0-byte storages no block; kept total for safety)
        small = geometry.is_small(size)
        if self.expandable_segments:
            block = self._malloc_expandable(size, stream, small, force)
        else:
            block = self._best_fit(size, stream, small)
            if block is None:
                block = self._new_segment(size, stream, small, force)
            if block is None:
                self.release_cached()
                block = self._new_segment(size, stream, small, force)
        if block is None:
            return None
        self._take(block, size)
        return block

    def free(self, block: CacheBlock) -> None:
        assert block.allocated, "caching allocator model: a block freed twice"
        block.allocated = False
        self.allocated_bytes -= block.size
        for neighbour in (block.next, block.prev):
            if neighbour is not None and not neighbour.allocated:
                self._pool(block.segment).discard(neighbour)
                block = _merge(block, neighbour)
        self._pool(block.segment).add(block)

    def release_cached(self) -> int:
        """``release_cached_blocks``: give back every wholly free segment (expandable: unmap every page lying
        wholly inside a free block). Returns the reserved bytes given back."""
        before = self.reserved_bytes
        kept = []
        for segment in self.segments:
            if segment.expandable:
                for block in _blocks(segment):
                    if not block.allocated:
                        unmapped = _mapped_inside(segment, block)
                        segment.mapped_pages.difference_update(unmapped)
                        self.released_segments += len(unmapped)
                        self.reserved_bytes -= len(unmapped) * segment.page_bytes
                kept.append(segment)
            elif not segment.head.allocated and segment.head.next is None:
                self._pool(segment).discard(segment.head)
                self.reserved_bytes -= segment.size
                self.released_segments += 1
            else:
                kept.append(segment)
        self.segments = kept
        return before - self.reserved_bytes

    # ---- internals ----------------------------------------------------------------------------
    def _pool(self, segment: Segment) -> set[CacheBlock]:
        return self._free.setdefault((id(segment.stream), segment.small), set())

    def _best_fit(self, size: int, stream: object, small: bool) -> CacheBlock | None:
        best = None
        for block in self._free.get((id(stream), small), ()):
            if block.size >= size and (best is None or (block.size, block.offset) < (best.size, best.offset)):
                best = block
        return best

    def _new_segment(self, size: int, stream: object, small: bool, force: bool) -> CacheBlock | None:
        segment_size = geometry.segment_bytes(size)
        if not force and self.reserved_bytes + segment_size > self.capacity_bytes:
            return None
        segment = Segment(stream, small, segment_size, False, segment_size)
        self.segments.append(segment)
        self._reserve(segment_size)
        return segment.head

    def _malloc_expandable(self, size: int, stream: object, small: bool, force: bool) -> CacheBlock | None:
        key = (id(stream), small)
        segment = self._expandable.get(key)
        if segment is None:
            segment = self._expandable[key] = Segment(stream, small, _VIRTUAL_BYTES, True,
                                                      geometry.page_bytes(size))
            self.segments.append(segment)
            self._pool(segment).add(segment.head)
        block = self._best_fit(size, stream, small)  # (the virtual tail always fits)
        need_bytes = self._pages_to_map(block, size) * segment.page_bytes
        if not force and self.reserved_bytes + need_bytes > self.capacity_bytes:
            self.release_cached()
            need_bytes = self._pages_to_map(block, size) * segment.page_bytes
            if self.reserved_bytes + need_bytes > self.capacity_bytes:
                return None
        pages = block.segment.pages_of(CacheBlock(segment, block.offset, size), False)
        new_pages = [p for p in pages if p not in segment.mapped_pages]
        segment.mapped_pages.update(new_pages)
        self._reserve(len(new_pages) * segment.page_bytes)
        return block

    def _pages_to_map(self, block: CacheBlock, size: int) -> int:
        segment = block.segment
        pages = segment.pages_of(CacheBlock(segment, block.offset, size), False)
        return sum(1 for p in pages if p not in segment.mapped_pages)

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def _take(self, block: CacheBlock, size: int) -> None:
        """Hand out ``block`` for a ``size`` request, split when the remainder is large enough."""
        segment = block.segment
        self._pool(segment).discard(block)
        remainder = block.size - size
        if segment.expandable or geometry.should_split(segment.small, remainder):
            if remainder > 0:
                rest = CacheBlock(segment, block.offset + size, remainder)
                rest.prev, rest.next = block, block.next
                if block.next is not None:
                    block.next.prev = rest
                block.next = rest
                block.size = size
                self._pool(segment).add(rest)
        block.allocated = True
        self.allocated_bytes += block.size


def _blocks(segment: Segment):
    block = segment.head
    while block is not None:
        yield block
        block = block.next


def _mapped_inside(segment: Segment, block: CacheBlock) -> list[int]:
    """The mapped pages lying wholly inside free ``block`` (the virtual tail spans far more pages than are mapped)."""
    inside = segment.pages_of(block, True)
    return [page for page in segment.mapped_pages if page in inside]


def _merge(block: CacheBlock, neighbour: CacheBlock) -> CacheBlock:
    """Join two adjacent blocks of one segment; returns the one that remains (the lower)."""
    low, high = (block, neighbour) if block.offset < neighbour.offset else (neighbour, block)
    low.size += high.size
    low.next = high.next
    if high.next is not None:
        high.next.prev = low
    return low
