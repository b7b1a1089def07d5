"""The emulated device's caching allocator model (NOTE [The caching allocator model] in
device/simulated/caching.py), and relief judged by the request fitting there (issue 37, item 5)."""

from __future__ import annotations

import pytest
import torch

from chameleon_dist.device import caching_geometry as geometry
from chameleon_dist.device.cuda import CudaBackend
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.simulated.caching import CachingAllocatorModel
from chameleon_dist.device.simulated.memory import EmulatedOutOfMemoryError
from chameleon_dist.executor import IterationContext, SwapExecutor
from tests.by_hand import policy_by_hand

MiB = 2**20
KiB = 2**10
A, B = object(), object()  # two streams


# ---- the model, against CUDACachingAllocator.cpp's rules ---------------------------------------------------
def test_small_requests_share_a_2_mib_segment_and_large_ones_get_20_mib_or_their_own():
    cache = CachingAllocatorModel(10**12)
    first = cache.malloc(1000, A)
    assert first.size == 1024 and cache.reserved_bytes == 2 * MiB  # rounded to 512 B, a small segment
    cache.malloc(MiB, A)
    assert cache.reserved_bytes == 2 * MiB and len(cache.segments) == 1  # (split from the same segment)
    cache.malloc(MiB + 1, A)
    assert cache.reserved_bytes == 22 * MiB  # over 1 MiB: the large pool's 20 MiB segment
    cache.malloc(11 * MiB, A)
    assert cache.reserved_bytes == 22 * MiB  # (best fit: split from the 20 MiB segment's free rest)
    cache.malloc(21 * MiB - 1, A)
    assert cache.reserved_bytes == 22 * MiB + 22 * MiB  # >= 10 MiB: its own size rounded up to 2 MiB
    # (its 1 MiB remainder is not split off: memory_allocated counts the whole 22 MiB block)
    assert cache.allocated_bytes == 1024 + MiB + geometry.round_request(MiB + 1) + 11 * MiB + 22 * MiB


def test_a_large_block_is_not_split_for_a_remainder_of_1_mib_or_less():
    cache = CachingAllocatorModel(10**12)
    block = cache.malloc(19 * MiB, A)  # 20 MiB segment, 1 MiB left: not split
    assert block.size == 20 * MiB and cache.allocated_bytes == 20 * MiB  # memory_allocated counts the block
    cache.free(block)
    assert cache.malloc(18 * MiB, A).size == 18 * MiB  # 2 MiB left: split


def test_a_freed_block_serves_only_its_own_stream_and_merges_with_free_neighbours():
    cache = CachingAllocatorModel(4 * MiB)
    blocks = [cache.malloc(512 * KiB, A) for _ in range(4)]  # one full small segment on A
    cache.free(blocks[1])
    cache.free(blocks[2])  # merged with its free neighbour: one 1 MiB block
    assert cache.fits(MiB, A) and not cache.fits(MiB + 512 * KiB, A)
    other = cache.malloc(MiB, B)  # B cannot use A's free block: a segment of its own
    assert other.segment is not blocks[0].segment and cache.reserved_bytes == 4 * MiB
    assert cache.fits(MiB, B) and cache.allocated_bytes == 2 * MiB
    C = object()
    assert not cache.fits(512 * KiB, C)  # no room for a third segment, none wholly free
    cache.free(other)
    assert cache.fits(512 * KiB, C)  # B's segment is wholly free now: released before a new one
    assert cache.malloc(512 * KiB, C) is not None and cache.released_segments == 1


def test_expandable_segments_join_the_free_bytes_that_separate_segments_strand():
    for expandable in (False, True):
        cache = CachingAllocatorModel(40 * MiB, expandable_segments=expandable)
        blocks = [cache.malloc(8 * MiB, A) for _ in range(4)]
        assert all(b is not None for b in blocks) and cache.reserved_bytes == 40 * MiB
        cache.free(blocks[1])
        cache.free(blocks[2])
        assert cache.free_cached_bytes() == 24 * MiB
        assert cache.fits(16 * MiB, A) is expandable  # 16 MiB free in one run only where the segments join


# ---- the emulated device: capacity bounds reserved bytes, errors name expandable_segments ----------------
def _fill_and_free_the_middle(device):
    with device.active():
        held = [torch.empty(2 * MiB, dtype=torch.float32) for _ in range(4)]  # 8 MiB each
        del held[1:3]
        return held, torch.empty(4 * MiB, dtype=torch.float32)  # 16 MiB


def test_fragmented_free_bytes_raise_an_error_that_names_expandable_segments():
    device = EmulatedDevice(40 * MiB, caching_allocator=True)
    with pytest.raises(EmulatedOutOfMemoryError, match="expandable_segments") as error:
        _fill_and_free_the_middle(device)
    assert error.value.fragmented and error.value.reserved_bytes == 40 * MiB and error.value.live_bytes == 16 * MiB
    assert device.live_bytes() == 16 * MiB and device.backend.reserved_bytes() == 40 * MiB


def test_with_expandable_segments_the_same_allocations_fit():
    device = EmulatedDevice(40 * MiB, caching_allocator=True, expandable_segments=True)
    held, tensor = _fill_and_free_the_middle(device)
    assert device.live_bytes() == 32 * MiB and device.backend.reserved_bytes() == 40 * MiB
    del held, tensor
    assert device.live_bytes() == 0


def test_meta_tensors_work_on_the_caching_model():
    device = EmulatedDevice(10**12, caching_allocator=True, meta_tensors=True)
    with device.active():
        big = torch.empty(2**30, dtype=torch.float32, device="meta")
        assert device.live_bytes() == 4 * 2**30 and device.backend.reserved_bytes() == 4 * 2**30
        del big
    assert device.live_bytes() == 0 and device.backend.reserved_bytes() == 4 * 2**30  # cached, as on a GPU


# ---- relief: done when the request fits, not when "enough" bytes were freed ------------------------------
ROWS, COLS = 128, 1024  # 512 KiB float32 activations: four per small segment


def _chain(x, hold):
    """Five tanh outputs (saved by autograd) and a 512 KiB tensor the caller holds between the first two; then a
    1 MiB cat. Segments: [x, t1, held, t2] [t3, t4, t5, free]."""
    y = x.tanh()
    held = hold(y)
    for _ in range(4):
        y = y.tanh()
    return torch.cat([y, y]).sum(), held


def _chain_under_pressure(device):
    """The kept outputs (the policy swaps nothing) fill both 2 MiB segments but one 512 KiB slot, and the cat
    runs short by 512 KiB. Passive swaps of t1 and t2 free "enough" (1 MiB), but in two runs that the held
    tensor separates: the retry fits only once t3 and t4 made one 1 MiB run."""
    torch.manual_seed(0)
    executor = SwapExecutor(device, min_swap_bytes=0)
    device.set_pressure_handler(executor.relieve_pressure)
    x = device.track(torch.randn(ROWS, COLS)).requires_grad_()
    with device.active(), executor.active(IterationContext(policy=policy_by_hand([], "none"))) as counters:
        loss, held = _chain(x, lambda y: torch.empty_like(y))
        loss.backward()
    return x.grad, counters


def _reference_grad():
    torch.manual_seed(0)
    x = torch.randn(ROWS, COLS).requires_grad_()
    _chain(x, lambda y: None)[0].backward()
    return x.grad


def test_relief_goes_on_until_the_request_fits_in_a_fragmented_allocator():
    device = EmulatedDevice(4 * MiB, caching_allocator=True)
    grad, counters = _chain_under_pressure(device)
    assert torch.equal(grad, _reference_grad())
    assert counters.passive_swaps >= 4  # two freed the bytes missing, two more made them one block
    assert device.dispatch.relieved_ops >= 1


def test_the_same_chain_needs_one_passive_swap_without_segments():
    device = EmulatedDevice(4 * MiB)  # the block model: every freed byte serves any request
    grad, counters = _chain_under_pressure(device)
    assert torch.equal(grad, _reference_grad())
    assert device.dispatch.relieved_ops >= 1 and counters.passive_swaps == 2


# ---- a swap-in's allocation is relieved once, on one path ------------------------------------------------
def test_a_swap_in_allocation_that_runs_short_is_relieved_once():
    device = EmulatedDevice(MiB)
    calls = []
    device.set_pressure_handler(lambda short_bytes: calls.append(short_bytes) or 0)
    host = torch.empty(2 * MiB, dtype=torch.uint8)
    with device.active():
        with pytest.raises(torch.OutOfMemoryError):
            device.copy_to_device(host)
    assert len(calls) == 1, calls


# ---- CUDA: the shortfall comes from the error, with a fragmentation margin --------------------------------
CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "1.02 GiB is free. Of the allocated memory 70.12 GiB is allocated by PyTorch, and 3.20 GiB is reserved "
                "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_cuda_short_bytes_are_read_from_the_error_not_the_arguments():
    error = torch.OutOfMemoryError(CUDA_MESSAGE)
    # a factory op: no tensor arguments at all (today's estimate: 1 MiB)
    short_bytes = CudaBackend.short_bytes(None, error, torch.ops.aten.empty.memory_format, ([2**28],), {})
    assert short_bytes == geometry.segment_bytes(int(1.5 * 2**30)) + geometry.FRAGMENTATION_MARGIN_BYTES
    assert geometry.tried_to_allocate_bytes("Tried to allocate 20.00 MiB.") == 20 * MiB
    assert CudaBackend.short_bytes(None, torch.OutOfMemoryError("no size"), None, (torch.empty(3 * MiB // 4),),
                                   {}) == 3 * MiB


# ---- the prefetch limit asks the allocator too ------------------------------------------------------------
def test_a_planned_prefetch_the_fragmented_pools_cannot_serve_waits_though_it_is_under_the_limit():
    from types import SimpleNamespace

    device = EmulatedDevice(4 * MiB, caching_allocator=True)
    executor = SwapExecutor(device, min_swap_bytes=0, prefetch_limit_bytes=4 * MiB)
    with device.active():
        held = [torch.empty(128 * KiB, dtype=torch.float32) for _ in range(8)]  # 512 KiB each: both segments
        del held[1], held[3]  # (indices shift: the 2nd and 5th go) 1 MiB free, in two runs
        entry = SimpleNamespace(nbytes=MiB, reader=device.backend.current_stream())
        assert device.live_bytes() + entry.nbytes <= executor.prefetch_limit_bytes  # the old check lets it go
        assert executor._prefetch_would_not_fit(entry)
        del held[0]  # the 1st joins the 2nd's run: 1 MiB in one block
        assert not executor._prefetch_would_not_fit(entry)


# ---- the hazard checker's free semantics hold on the caching model -----------------------------------------
def test_a_block_freed_while_a_copy_reads_it_is_still_a_hazard_on_the_caching_model():
    import gc

    from chameleon_dist.device import StreamHazardError
    from chameleon_dist.device.base import byte_view

    device = EmulatedDevice(64 * MiB, caching_allocator=True, peak_flop_per_s=1e12, memory_bytes_per_s=1e11,
                            launch_latency_s=1e-6, host_op_s=1e-6, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e6)
    backend = device.backend
    with device.active():
        x = torch.ones(MiB // 4)
        with backend.host_side():
            host = torch.empty(MiB, dtype=torch.uint8)
        copy_stream = backend.new_stream("copy")
        copy_stream.wait_stream(backend.current_stream())
        with backend.use_stream(copy_stream):
            backend.copy(host, byte_view(x.untyped_storage()))  # ~1 s over the link
        del x  # back to the compute stream's pool while the copy still reads it
        gc.collect()
        assert device.backend.reserved_bytes() == 2 * MiB and device.live_bytes() == 0  # cached, not given back
        with pytest.raises(StreamHazardError, match="still reads"):
            torch.ones(4)


def test_fits_agrees_with_malloc_on_random_sequences():
    import random

    sizes = [700, 64 * KiB, 512 * KiB, MiB, 3 * MiB, 9 * MiB, 12 * MiB]
    for expandable in (False, True):
        rng = random.Random(0)
        cache = CachingAllocatorModel(64 * MiB, expandable_segments=expandable)
        live, outcomes = [], set()
        for _ in range(400):
            if live and rng.random() < 0.45:
                cache.free(live.pop(rng.randrange(len(live))))
                continue
            nbytes, stream = rng.choice(sizes), rng.choice((A, B))
            predicted = cache.fits(nbytes, stream)
            block = cache.malloc(nbytes, stream)
            assert predicted == (block is not None), (expandable, nbytes)
            outcomes.add(predicted)
            assert cache.reserved_bytes <= 64 * MiB and cache.allocated_bytes <= cache.reserved_bytes
            if block is not None:
                live.append(block)
        assert outcomes == {True, False}  # (both answers were put to the test)
