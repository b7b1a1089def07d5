"""The simulated backend under the emulated device: a device clock that lags the host, memory as the
caching allocator reports it, out-of-memory at the allocation, the hazard checker, and relief inside the op.

Every figure here is set by the test (a fixed host cost per op, explicit rates), so expected times are
computed from those figures, not read back from the code under test."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from chameleon_dist.device import EmulatedDevice, StreamHazardError
from chameleon_dist.device.base import byte_view
from chameleon_dist.device.dispatch import retryable
from chameleon_dist.device.simulated import backend as backend_module
from chameleon_dist.device.simulated.clock import DeviceClock
from chameleon_dist.device.simulated.memory import block_bytes

MiB = 2**20


def _device(capacity_bytes=64 * MiB, **figures) -> EmulatedDevice:
    settings = dict(peak_flop_per_s=1e12, memory_bytes_per_s=1e11, launch_latency_s=1e-6, host_op_s=1e-6,
                    h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    settings.update(figures)
    return EmulatedDevice(capacity_bytes, **settings)


# ---- the clock ------------------------------------------------------------------------------------
def test_a_slow_device_lags_a_fast_host_and_events_answer_at_host_time():
    device = _device(peak_flop_per_s=1e9, memory_bytes_per_s=1e9)  # slow device, host 1 us per op
    backend = device.backend
    a = torch.ones(256, 256)
    device.track(a)
    with device.active():
        b = a @ a  # 2*256^3 FLOP at 1 GFLOP/s: 33.6 ms of device time
        event = backend.new_event()
        event.record(backend.current_stream())
        c = b + 1
    assert backend.clock.host_s < 1e-3, "the host only queued the kernels"
    assert not event.query(), "an event a few ops back has not fired while the device lags"
    expected_matmul_s = 2 * 256**3 / 1e9
    assert backend.compute_stream.ready_s >= expected_matmul_s
    event.synchronize()
    assert backend.clock.host_s >= expected_matmul_s and event.query()
    del c


def test_item_makes_the_host_wait_for_the_device():
    device = _device(peak_flop_per_s=1e9)
    a = device.track(torch.ones(128, 128))
    with device.active():
        total = (a @ a).sum().item()
    assert total == 128.0**3
    assert device.backend.clock.host_s >= 2 * 128**3 / 1e9  # .item() synchronised


def _run_fixed(host_op_s: float) -> tuple[float, float]:
    device = _device(host_op_s=host_op_s)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    device.track_module(model)
    x = device.track(torch.randn(32, 64))
    timer = device.timer()
    with device.active():
        start = timer.mark()
        model(x).square().sum().backward()
        end = timer.mark()
    timer.resolve()
    return timer.elapsed_s(start, end), device.backend.clock.host_s


def test_a_fixed_host_cost_repeats_exactly_and_a_larger_one_is_slower():
    torch.manual_seed(0)
    first = _run_fixed(1e-6)
    torch.manual_seed(0)
    assert _run_fixed(1e-6) == first
    torch.manual_seed(0)
    slow_host = _run_fixed(1e-3)  # host-bound: each op waits for the host
    assert slow_host[0] > first[0]


def test_the_measured_host_time_restarts_where_the_program_says(monkeypatch):
    """Measured host time: the wall time since the device's last op lands on its next op, unless the host
    measurement was restarted (a benchmark ran other devices meanwhile). A fake clock, so no timing is measured."""
    from chameleon_dist.device.simulated import backend as simulated_backend

    now = [100.0]

    class FakeTime:
        @staticmethod
        def perf_counter() -> float:
            return now[0]

    monkeypatch.setattr(simulated_backend, "time", FakeTime)
    device = _device(host_op_s=None)
    clock = device.backend.clock
    a = device.track(torch.ones(4))
    with device.active():
        now[0] += 2.0  # the host works 2 s before the first op
        a + 1
        assert clock.host_s == pytest.approx(2.0)
        now[0] += 5.0  # 5 s elsewhere (another device's iteration), then the measurement restarts
        device.backend.restart_host_measurement()
        now[0] += 0.5
        a + 1
        assert clock.host_s == pytest.approx(2.5)
        now[0] += 3.0  # no restart: those 3 s are this host's
        a + 1
        assert clock.host_s == pytest.approx(5.5)
    # the host's work before an event's record lands before it: a mark after 4 s of host work (and no op) is at 4 s
    timer = device.timer()
    before = timer.mark()
    now[0] += 4.0
    after = timer.mark()
    assert timer.elapsed_s(before, after) == pytest.approx(4.0) and clock.host_s == pytest.approx(9.5)
    fixed = _device(host_op_s=1e-3)
    b = fixed.track(torch.ones(4))
    with fixed.active():
        b + 1
        fixed.backend.restart_host_measurement()  # no effect with a fixed cost per op
        b + 1
    assert fixed.backend.clock.host_s == pytest.approx(2e-3)


def test_copies_take_bytes_over_the_link_rate_after_the_copy_stream_waits():
    device = _device(d2h_bytes_per_s=1e9, h2d_bytes_per_s=2e9, duplex_factor=1.0)
    with device.active():
        x = torch.ones(MiB // 4)  # 1 MiB
        handle = device.copy_to_host(x.untyped_storage())
    start_s = device.backend.clock.host_s
    device.synchronize()
    assert device.backend.d2h_link.busy_s == pytest.approx(MiB / 1e9)
    assert device.backend.clock.host_s >= start_s + MiB / 1e9 * 0.99
    assert handle.done()
    assert torch.equal(handle.result, byte_view(x.untyped_storage()))


# ---- memory -----------------------------------------------------------------------------------------
def test_allocations_round_to_512_bytes_and_zero_is_no_block():
    assert [block_bytes(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    device = _device()
    with device.active():
        before = device.live_bytes()
        small = torch.ones(3)  # 12 bytes
        assert device.live_bytes() - before == 512
        del small
    assert device.live_bytes() == before


def test_out_of_memory_is_raised_at_the_allocation_and_the_outputs_never_exist():
    device = _device(capacity_bytes=4 * MiB)
    outputs = []
    with device.active():
        a = torch.ones(MiB // 4)  # 1 MiB
        with pytest.raises(torch.OutOfMemoryError):
            outputs.append(a.repeat(4))  # 4 MiB more
        assert device.live_bytes() == MiB, "a failed op leaves nothing allocated"
    assert outputs == []


# ---- hazards ------------------------------------------------------------------------------------------
def test_a_copy_of_a_side_stream_tensor_not_ordered_after_its_producer_is_a_hazard():
    device = _device(peak_flop_per_s=1e9)
    backend = device.backend
    side = backend.new_stream("side")
    a = device.track(torch.ones(256, 256))
    with device.active():
        with backend.use_stream(side):
            produced = a @ a  # 33.6 ms on the side stream
        with pytest.raises(StreamHazardError, match="before stream side"):
            device.copy_to_host(produced.untyped_storage())  # ordered after the compute stream only


def test_a_copy_ordered_on_the_producing_stream_is_no_hazard():
    device = _device(peak_flop_per_s=1e9)
    backend = device.backend
    side = backend.new_stream("side")
    a = device.track(torch.ones(256, 256))
    with device.active():
        with backend.use_stream(side):
            produced = a @ a
        handle = device.copy_to_host(produced.untyped_storage(), stream=side)
        device.wait(handle)
    assert torch.equal(handle.result, byte_view(produced.untyped_storage()))


def test_a_block_freed_while_a_copy_still_reads_it_is_a_hazard():
    device = _device(d2h_bytes_per_s=1e6)  # 1 MiB takes ~1 s
    backend = device.backend
    with device.active():
        x = torch.ones(MiB // 4)
        with backend.host_side():
            host = torch.empty(MiB, dtype=torch.uint8)
        copy_stream = backend.new_stream("copy")
        copy_stream.wait_stream(backend.current_stream())  # after x's producer
        with backend.use_stream(copy_stream):
            backend.copy(host, byte_view(x.untyped_storage()))
        del x  # back to the compute stream while the copy still reads it: the next op raises
        gc.collect()
        with pytest.raises(StreamHazardError, match="still reads"):
            torch.ones(4)


def test_reading_a_swapped_in_tensor_before_its_copy_completed_is_a_hazard():
    device = _device(h2d_bytes_per_s=1e6)
    with device.active():
        x = torch.ones(MiB // 4)
        host = device.wait(device.copy_to_host(x.untyped_storage()))
        handle = device.copy_to_device(host)
        restored = handle.result.view(torch.float32)
        with pytest.raises(StreamHazardError, match="before stream h2d"):
            restored + 1  # not ordered after the copy (no wait)
        device.wait(handle)
        assert torch.equal(restored + 1, x + 1)


# ---- relief inside the op ------------------------------------------------------------------------------
def test_an_op_that_runs_short_is_relieved_and_retried_once():
    device = _device(capacity_bytes=4 * MiB)
    freed = []
    spare = [torch.ones(MiB // 4)]  # 1 MiB the handler can free
    device.track(spare[0])

    def handler(short_bytes: int) -> int:
        freed.append(short_bytes)
        spare.clear()
        return MiB

    device.set_pressure_handler(handler)
    with device.active():
        a = torch.ones(MiB // 4)
        b = a.repeat(2)  # 2 MiB: 4 live with the spare; short by 512 bytes... of blocks
        more = a.repeat(1)  # 1 MiB: over capacity until the spare goes
    assert len(freed) == 1 and freed[0] > 0
    assert device.dispatch.relieved_ops == 1
    assert torch.equal(more, a)
    del b


def test_ops_that_mutate_draw_random_numbers_or_communicate_are_never_retried():
    aten = torch.ops.aten
    assert retryable(aten.mm.default) and retryable(aten.add.Tensor)
    assert not retryable(aten.add_.Tensor)  # writes its input
    assert not retryable(aten.bernoulli.default)  # draws random numbers
    assert not retryable(aten.native_dropout.default)
    assert not retryable(torch.ops._c10d_functional.all_reduce.default)


def test_a_mutating_op_that_runs_short_raises_without_relief():
    device = _device(capacity_bytes=2 * MiB)
    calls = []
    device.set_pressure_handler(lambda short: calls.append(short) or 0)
    with device.active():
        a = torch.ones(MiB // 4)
        out = torch.empty(0)
        with pytest.raises(torch.OutOfMemoryError):
            torch.cat([a, a], out=out)  # resizes its out= argument: a mutating op
    assert calls == []


def test_making_an_emulated_device_leaves_the_random_generator_alone():
    """Measuring this CPU's rates must not draw random numbers: a device made between ``manual_seed`` and
    training would shift every dropout mask (scenario b's losses differed from iteration 1)."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    EmulatedDevice(MiB)  # no figures given: this CPU's rates are measured
    assert torch.equal(torch.rand(4), expected)


def test_a_write_under_a_swap_out_tears_its_host_copy_and_restoring_that_copy_is_a_hazard():
    device = _device(d2h_bytes_per_s=1e6)  # 1 MiB takes ~1 s: the copy is still reading
    with device.active():
        x = torch.ones(MiB // 4)
        handle = device.copy_to_host(x.untyped_storage())
        x.mul_(2)  # a GPU runs this race silently; the executor never restores such a copy (it counts the write)
        device.synchronize()
        with pytest.raises(StreamHazardError, match="torn"):
            device.copy_to_device(handle.result)


def test_indexing_with_a_boolean_mask_makes_the_host_wait_for_the_device():
    """The output's size depends on the mask's values: on a GPU the host reads them back (a sync)."""
    device = _device(peak_flop_per_s=1e9)
    a = device.track(torch.ones(128, 128))
    with device.active():
        mask = (a @ a) > 0  # 4.2 ms of device time before the mask exists
        picked = a[mask]
    assert picked.numel() == 128 * 128
    assert device.backend.clock.host_s >= 2 * 128**3 / 1e9


def test_host_work_counts_a_fixed_cost_per_call_or_the_measured_wall_time_since_its_mark(monkeypatch):
    """``HostWork``: with ``host_op_s`` each count adds that much host time; without, the wall time since the
    mark (and ``restart`` moves the mark, so the time before it is not counted)."""
    fixed = backend_module.HostWork(DeviceClock(), 0.25)
    fixed.count()
    fixed.count()
    assert fixed.clock.host_s == 0.5 and not fixed.measured

    wall_s = iter([10.0, 11.5, 20.0, 20.75])
    monkeypatch.setattr(backend_module, "time", types.SimpleNamespace(perf_counter=lambda: next(wall_s)))
    measured = backend_module.HostWork(DeviceClock(), None)  # mark at 10.0
    measured.count()  # 11.5: 1.5 s counted
    measured.restart()  # mark at 20.0: the 8.5 s between are not host work
    measured.count_measured()  # 20.75: 0.75 s counted
    assert measured.measured and measured.clock.host_s == 2.25
