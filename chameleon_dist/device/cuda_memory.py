"""What a CUDA device's memory budget is measured in, and against what.

Importing this module makes no CUDA call. Three pieces, used by the CUDA device (``device/cuda.py``):

- ``usable_capacity_bytes``: the capacity, read once at start (``CapacityReading``);
- ``enforce_capacity``: make the caching allocator raise out-of-memory at that capacity;
- ``PeakReader``: one iteration's peak, without ever resetting the process's peak statistics.

NOTE [The budget compares memory_allocated]
Every figure the budget is compared with (``live_bytes``, ``peak_bytes``, the policy's trace, the
``memory_budget``) is ``torch.cuda.memory_allocated``: the bytes of the caching allocator's blocks that
tensors hold, rounding (512 bytes) and unsplit block tails included, since a block counts at its size, not
at the size asked for. Not ``memory_reserved``, because reserved does not drop when a tensor dies (its
block stays cached): the executor measures what a release freed as a drop of ``live_bytes`` and stops
prefetching when ``live_bytes`` plus the prefetch would pass the budget, and both would stall on a number
that only grows. Allocated is also what the emulated device counts (live storages), so a budget means the
same on both backends.
Like with like, then, the capacity is in allocated bytes too: what the process could hold from the GPU
(``mem_get_info``'s free memory plus ``memory_reserved``, the part of it this process's allocator
already holds) less what will not be available to tensors (NOTE [The reserve]).

NOTE [The reserve]
Measured at start from the figures read then, two parts:
1. Fragmentation headroom: blocks the caching allocator keeps reserved but cannot hand to a request
   (cached blocks of the wrong size or stream, free tails of segments a live block pins). Swap-ins of many
   sizes widen this gap during training. It is the larger of the gap measured now (``memory_reserved -
   memory_allocated``) and ``FRAGMENTATION_FRACTION`` of what the process could hold.
2. Lazy memory outside the caching allocator: what other code takes from free memory after start, where
   ``mem_get_info`` cannot see it yet and ``memory_allocated`` never will. Mostly NCCL: a communicator is
   built at the first collective of its group, with its buffers from ``cudaMalloc``/``cuMem``; NVIDIA/nccl
   #964 measured 544 MB for a 2-GPU and 688 MB for a 4-GPU communicator (A100, NVLink), NVIDIA/nccl #2363
   a 512 MiB shared P2P buffer allocated at a lazily initialised group's first collective, and Megatron
   builds one group per parallel dimension. Also CUDA's lazy module loading as new kernels run. It is
   ``OUTSIDE_ALLOCATOR_FRACTION`` of the free memory measured now (what those will take from).
   cuBLAS and cuBLASLt workspaces need no share: PyTorch takes them from the caching allocator (8 MiB +
   128 KiB per handle and stream under the default ``CUBLAS_WORKSPACE_CONFIG``, 32 MiB for cuBLASLt on
   Hopper, pytorch/pytorch #120925), so they are in ``memory_allocated`` once they exist.
The CUDA context, other processes and NCCL communicators that already exist are not reserved: free
memory already excludes them. A caller who knows better passes ``reserve_bytes``; a user sets
``device.capacity``.

NOTE [A configured capacity above the usable one]
A configured capacity (``device.capacity``) is kept even when it is above the usable figure, with a
warning: the user may know what the start-time reading cannot (no NCCL on this job, another process about
to exit), and a configured capacity keeps runs comparable across nodes whose free memory differs. The
warning names ``device.capacity``. Only when nothing is configured and nothing is usable is it an error.

NOTE [Peaks without resetting]
``torch.cuda.reset_peak_memory_stats`` resets the process's peaks for everyone: Megatron's memory report
and DeepSpeed's ``see_memory_usage`` would then report our iteration's peak, not theirs. ``PeakReader``
never resets them; it reads this iteration's peak as a difference (see ``PeakReader``). DeepSpeed itself
resets them in ``see_memory_usage`` and ``empty_cache``; a reset seen during an iteration (the maximum
went down) makes that iteration's peak a lower bound.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

COMPARED_AGAINST = "memory_allocated"  # the statistic the budget, live_bytes and peak_bytes are in
FRAGMENTATION_FRACTION = 0.05  # of free + reserved: at least this much stays cached but unusable
OUTSIDE_ALLOCATOR_FRACTION = 0.03  # of free memory at start: NCCL communicators, lazily loaded kernels


@dataclass(frozen=True)
class CapacityReading:
    """The figures read at start for one device, and the capacity they give (NOTE [The reserve]).

    ``capacity_bytes`` is what the policy plans against and compares with ``memory_allocated``: the
    configured capacity when one was given, else ``usable_bytes``."""

    device_index: int
    total_bytes: int
    free_bytes: int  # mem_get_info: free on the GPU, for every process
    reserved_bytes: int  # memory_reserved: held by this process's caching allocator
    allocated_bytes: int  # memory_allocated: of which tensors hold this much
    fragmentation_reserve_bytes: int
    outside_allocator_reserve_bytes: int
    given_reserve_bytes: int | None = None  # the caller's reserve, replacing the two measured parts
    configured_bytes: int | None = None

    @property
    def reserve_bytes(self) -> int:
        if self.given_reserve_bytes is not None:
            return self.given_reserve_bytes
        return self.fragmentation_reserve_bytes + self.outside_allocator_reserve_bytes

    @property
    def pool_bytes(self) -> int:
        """What this process could hold from the GPU now: free memory plus its allocator's reserved."""
        return self.free_bytes + self.reserved_bytes

    @property
    def usable_bytes(self) -> int:
        return max(self.pool_bytes - self.reserve_bytes, 0)

    @property
    def capacity_bytes(self) -> int:
        return self.usable_bytes if self.configured_bytes is None else self.configured_bytes

    @property
    def above_usable(self) -> bool:
        return self.configured_bytes is not None and self.configured_bytes > self.usable_bytes

    def describe(self) -> str:
        if self.given_reserve_bytes is not None:
            reserve = f"a given reserve of {format_bytes(self.given_reserve_bytes)}"
        else:
            reserve = (
                f"a reserve of {format_bytes(self.reserve_bytes)} (fragmentation "
                f"{format_bytes(self.fragmentation_reserve_bytes)}, outside the allocator "
                f"{format_bytes(self.outside_allocator_reserve_bytes)})"
            )
        usable = (
            f"cuda:{self.device_index}: {format_bytes(self.usable_bytes)} usable = "
            f"{format_bytes(self.free_bytes)} free + {format_bytes(self.reserved_bytes)} reserved by this "
            f"process - {reserve}, of {format_bytes(self.total_bytes)} total"
        )
        if self.configured_bytes is None:
            capacity = "capacity: the usable figure"
        else:
            capacity = f"capacity: device.capacity {format_bytes(self.configured_bytes)}"
        return f"{usable}; {capacity}, compared against {COMPARED_AGAINST}"


def usable_capacity_bytes(
    device_index: int,
    configured_capacity_bytes: int | None = None,
    reserve_bytes: int | None = None,
) -> CapacityReading:
    """Read ``device_index``'s memory now: free + reserved by this process - reserve (NOTE [The reserve]).

    ``configured_capacity_bytes`` (``device.capacity``) is kept when given, with a warning when it is above
    the usable figure (NOTE [A configured capacity above the usable one]). ``reserve_bytes`` replaces the
    measured reserve.

    Raises:
        ValueError: a negative capacity or reserve.
        RuntimeError: nothing configured and nothing usable (the GPU is full), naming ``device.capacity``.
    """
    if configured_capacity_bytes is not None and configured_capacity_bytes < 0:
        raise ValueError(f"device.capacity must be >= 0 bytes, got {configured_capacity_bytes}")
    if reserve_bytes is not None and reserve_bytes < 0:
        raise ValueError(f"the memory reserve must be >= 0 bytes, got {reserve_bytes}")
    free_bytes, total_bytes = (int(n) for n in torch.cuda.mem_get_info(device_index))
    reserved_bytes = int(torch.cuda.memory_reserved(device_index))
    allocated_bytes = int(torch.cuda.memory_allocated(device_index))
    pool_bytes = free_bytes + reserved_bytes
    reading = CapacityReading(
        device_index=device_index,
        total_bytes=total_bytes,
        free_bytes=free_bytes,
        reserved_bytes=reserved_bytes,
        allocated_bytes=allocated_bytes,
        fragmentation_reserve_bytes=max(reserved_bytes - allocated_bytes,
                                        math.ceil(FRAGMENTATION_FRACTION * pool_bytes)),
        outside_allocator_reserve_bytes=math.ceil(OUTSIDE_ALLOCATOR_FRACTION * free_bytes),
        given_reserve_bytes=None if reserve_bytes is None else int(reserve_bytes),
        configured_bytes=None if configured_capacity_bytes is None else int(configured_capacity_bytes),
    )
    if reading.configured_bytes is None and reading.usable_bytes == 0:
        raise RuntimeError(
            f"{reading.describe()}: nothing is left for Chameleon (other processes hold "
            f"{format_bytes(max(total_bytes - pool_bytes, 0))}); free the GPU, or set device.capacity in the "
            "chameleon config to the device memory this process may use"
        )
    if reading.above_usable:
        logger.warning(
            "device.capacity %s is above the %s usable on cuda:%d (%s): kept as configured, so the "
            "device may run out of memory below it; lower device.capacity, or leave it null to use the "
            "usable figure",
            format_bytes(reading.configured_bytes),
            format_bytes(reading.usable_bytes),
            device_index,
            reading.describe(),
        )
    return reading


def enforce_capacity(device_index: int, capacity_bytes: int) -> float:
    """Make the caching allocator raise ``torch.OutOfMemoryError`` where the capacity ends; returns the
    per-process memory fraction it replaced (to restore it with ``set_per_process_memory_fraction``).

    ``set_per_process_memory_fraction(capacity / total)`` caps what the allocator holds from the GPU (its
    reserved bytes; it frees its cached blocks and retries before it raises). Allocated bytes are never
    above reserved, so no allocation takes ``memory_allocated`` past the capacity; a fragmented allocator
    may raise a little below it, which the fragmentation reserve is for. The cap is per process and device,
    and stays until changed.

    Raises:
        ValueError: a capacity above the device's total memory, naming ``device.capacity`` and
            ``device.enforce_capacity``.
    """
    _free_bytes, total_bytes = (int(n) for n in torch.cuda.mem_get_info(device_index))
    if not 0 <= capacity_bytes <= total_bytes:
        raise ValueError(
            f"device.enforce_capacity: device.capacity {format_bytes(capacity_bytes)} is not within cuda:"
            f"{device_index}'s {format_bytes(total_bytes)}; lower device.capacity, or set "
            "device.enforce_capacity: false"
        )
    previous = float(torch.cuda.get_per_process_memory_fraction(device_index))
    fraction = capacity_bytes / total_bytes
    torch.cuda.set_per_process_memory_fraction(fraction, device_index)
    logger.info(
        "cuda:%d: the caching allocator now raises out-of-memory at %s (fraction %.6f of %s; was %.6f)",
        device_index, format_bytes(capacity_bytes), fraction, format_bytes(total_bytes), previous,
    )
    return previous


@dataclass(frozen=True)
class PeakReading:
    """One iteration's peak ``memory_allocated`` (``peak_bytes``) and ``memory_reserved``.

    ``exact``: the process's maximum grew during the iteration, so it is the iteration's peak. Otherwise the
    peak is a lower bound: the highest value seen (samples fed with ``note``, the values at ``begin`` and
    now, and the maximum since a reset someone else made), while the true one lies at or below
    ``upper_bound_bytes``, the process's maximum at ``begin`` (``None`` after a reset: unknown). A reset
    followed by a new high cannot be told from a plain new high: ``exact`` is then the peak since the reset."""

    peak_bytes: int
    exact: bool
    upper_bound_bytes: int | None
    peak_reserved_bytes: int
    reserved_exact: bool
    reset_seen: bool  # someone reset the peak statistics during the iteration


def allocator_bytes(device_index: int) -> tuple[int, int, int, int]:
    """(``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``, ``max_memory_reserved``) from one
    read of the caching allocator's statistics. ``torch.cuda.memory_allocated`` and the other three each
    build ``memory_stats()``, which flattens and sorts every statistic into a new dict; the nested dict is
    the same C++ read without that, and one read serves all four figures."""
    stats = torch.cuda.memory_stats_as_nested_dict(device_index)
    allocated = stats.get("allocated_bytes", {}).get("all", {})
    reserved = stats.get("reserved_bytes", {}).get("all", {})
    return (int(allocated.get("current", 0)), int(allocated.get("peak", 0)), int(reserved.get("current", 0)),
            int(reserved.get("peak", 0)))


class PeakReader:
    """This iteration's peak from ``max_memory_allocated`` read as a difference; never resets it.

    ``begin()`` at the start of an iteration remembers the process's maxima and current values; ``note``
    takes samples of ``memory_allocated`` (``sample()`` reads and notes one). At the end, when the maximum
    grew since ``begin``, the new maximum was reached in this iteration: its peak, exact. When it did not,
    the iteration stayed at or below an earlier peak and ``peak_bytes`` is the highest value seen, a lower
    bound (NOTE [Peaks without resetting]). Feeding samples where memory peaks (after each op, after a
    swap-in) tightens that bound. Built already begun."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self.begin()

    def begin(self) -> None:
        (self._sampled_bytes, self._max_allocated_at_begin_bytes, self._reserved_at_begin_bytes,
         self._max_reserved_at_begin_bytes) = allocator_bytes(self.device_index)

    def note(self, allocated_bytes: int) -> None:
        """A ``memory_allocated`` sample taken during the iteration."""
        if allocated_bytes > self._sampled_bytes:
            self._sampled_bytes = int(allocated_bytes)

    def sample(self) -> int:
        """Read ``memory_allocated`` now (one statistics read: ``allocator_bytes``), note it, and return it."""
        allocated_bytes = allocator_bytes(self.device_index)[0]
        self.note(allocated_bytes)
        return allocated_bytes

    def read(self) -> PeakReading:
        allocated_bytes, max_allocated_bytes, reserved_bytes, max_reserved_bytes = allocator_bytes(self.device_index)
        self.note(allocated_bytes)
        peak_bytes, exact, reset_allocated = _peak_since(
            max_allocated_bytes, self._max_allocated_at_begin_bytes, self._sampled_bytes
        )
        seen_reserved = max(self._reserved_at_begin_bytes, reserved_bytes)
        peak_reserved_bytes, reserved_exact, reset_reserved = _peak_since(
            max_reserved_bytes, self._max_reserved_at_begin_bytes, seen_reserved
        )
        return PeakReading(
            peak_bytes=peak_bytes, exact=exact,
            upper_bound_bytes=peak_bytes if exact else None if reset_allocated else self._max_allocated_at_begin_bytes,
            peak_reserved_bytes=peak_reserved_bytes, reserved_exact=reserved_exact,
            reset_seen=reset_allocated or reset_reserved,
        )

    def peak_bytes(self) -> int:
        """This iteration's peak ``memory_allocated``: exact, or a lower bound (``read().exact`` says)."""
        return self.read().peak_bytes


def _peak_since(max_now_bytes: int, max_at_begin_bytes: int, seen_bytes: int) -> tuple[int, bool, bool]:
    """(peak, exact, reset seen) from a monotone maximum read at begin and now, and the highest value seen."""
    if max_now_bytes > max_at_begin_bytes:
        return max_now_bytes, True, False
    if max_now_bytes < max_at_begin_bytes:  # reset by someone else: the maximum since then is in this iteration
        return max(max_now_bytes, seen_bytes), False, True
    return seen_bytes, False, False
