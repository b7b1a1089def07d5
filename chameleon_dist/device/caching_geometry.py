"""The sizes the CUDA caching allocator works in, shared by the simulated allocator model
(``device/simulated/caching.py``) and the CUDA backend's reading of an out-of-memory error.

Facts of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x): every request rounds up to 512 bytes; a request of at
most 1 MiB is served from the small pool, whose segments are 2 MiB; a larger one from the large pool, whose
segments are 20 MiB for a request under 10 MiB and the request rounded up to 2 MiB otherwise; a block is split
when the remainder is at least 512 bytes (small pool) or more than 1 MiB (large pool). The allocator's error
says "Tried to allocate <size>" with the size formatted to two decimals.
"""

from __future__ import annotations

import re

MIB = 2**20
ROUND_BYTES = 512
"""kMinBlockSize: every request rounds up to a multiple of it."""
SMALL_REQUEST_MAX_BYTES = 1 * MIB
"""kSmallSize: a request of at most this many bytes goes to the small pool."""
SMALL_SEGMENT_BYTES = 2 * MIB
"""kSmallBuffer: the small pool's segment (and, with expandable segments, its page)."""
LARGE_SEGMENT_BYTES = 20 * MIB
"""kLargeBuffer: the large pool's segment for requests under ``LARGE_DIRECT_MIN_BYTES`` (and its page)."""
LARGE_DIRECT_MIN_BYTES = 10 * MIB
"""kMinLargeAlloc: from here on a request gets a segment of its own size rounded up to ``SEGMENT_ROUND_BYTES``."""
SEGMENT_ROUND_BYTES = 2 * MIB
"""kRoundLarge."""

FRAGMENTATION_MARGIN_BYTES = 2 * MIB
"""Added to the shortfall read from a CUDA error: freed bytes land inside segments that live blocks pin, so
freeing exactly the request's bytes rarely frees a segment it fits in (``cuda_short_bytes``)."""

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)")


def round_request(nbytes: int) -> int:
    """The bytes a request of ``nbytes`` asks the allocator for (512-byte multiple; 0 stays 0)."""
    return -(-nbytes // ROUND_BYTES) * ROUND_BYTES if nbytes > 0 else 0


def is_small(rounded_bytes: int) -> bool:
    return rounded_bytes <= SMALL_REQUEST_MAX_BYTES


def segment_bytes(rounded_bytes: int) -> int:
    """The segment a new ``cudaMalloc`` makes for a request that no cached block serves."""
    if is_small(rounded_bytes):
        return SMALL_SEGMENT_BYTES
    if rounded_bytes < LARGE_DIRECT_MIN_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-rounded_bytes // SEGMENT_ROUND_BYTES) * SEGMENT_ROUND_BYTES


def page_bytes(rounded_bytes: int) -> int:
    """With expandable segments, the granule a pool's one segment grows by."""
    return SMALL_SEGMENT_BYTES if is_small(rounded_bytes) else LARGE_SEGMENT_BYTES


def should_split(small_pool: bool, remainder_bytes: int) -> bool:
    """Whether a free block larger than the request is split, leaving ``remainder_bytes`` free."""
    return remainder_bytes >= ROUND_BYTES if small_pool else remainder_bytes > SMALL_REQUEST_MAX_BYTES


def tried_to_allocate_bytes(message: str) -> int | None:
    """The size in a caching allocator's "Tried to allocate 20.00 MiB" (rounded up: the text has two
    decimals), or None when the message has none."""
    match = _TRIED.search(message)
    if match is None:
        return None
    return int(-(-float(match.group(1)) * _UNITS[match.group(2)] // 1))


def cuda_short_bytes(message: str, fallback_bytes: int) -> int:
    """What relief should free for a CUDA out-of-memory error: the segment the failed request needs (read from
    the error, not guessed from the op's arguments) plus ``FRAGMENTATION_MARGIN_BYTES``; ``fallback_bytes``
    when the message says nothing."""
    tried = tried_to_allocate_bytes(message)
    if tried is None:
        return max(fallback_bytes, 1)
    return segment_bytes(round_request(tried)) + FRAGMENTATION_MARGIN_BYTES
