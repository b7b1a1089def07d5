"""Chameleon training a GPT on CUDA, and the layer times of detailed traces.

``gpu`` tests (skipped without CUDA) train a small GPT with Chameleon on a real ``CudaDevice`` until its policy
is Stable, next to the same model without Chameleon: peaks from ``torch.cuda.max_memory_allocated`` below the
unswapped ones, losses and gradients ``torch.equal``. They also time layers with CUDA events. The CPU tests
check the layer-timing plumbing those rely on: forward and backward times per layer in every detailed
trace, one device wait per iteration, CUDA events behind ``CudaDevice.timer`` (against a fake
``torch.cuda``), and an op sequence that the backward hooks leave unchanged.
"""

from __future__ import annotations

import contextlib
import os
import types

import pytest
import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.device.base import HostTimer
from chameleon_dist.device.stream_device import EventTimer
from chameleon_dist.profiler.recorder import TraceRecorder
from chameleon_dist.profiler.signature import OpVocabulary
from chameleon_dist.trace import StepTrace
from launch.models.toy_gpt import GPT
from tests.models import lm_batch, lm_loss, make_lm

# cuBLAS is deterministic under torch.use_deterministic_algorithms only with a fixed workspace; it is read
# when the first cuBLAS handle is made, so it is set at import (collection), before any GPU test runs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

MODEL = dict(vocab=128, hidden=64, heads=4, layers=2, dropout=0.0)


# ---- CPU: layer times in detailed traces --------------------------------------------------------
def _emulated_run(iterations, timer=None, micro_batches=2, batch_seed=None):
    model = make_lm(0, **MODEL)
    chameleon = Chameleon({"min_swap_bytes": 0}, device=EmulatedDevice(10**9))
    if timer is not None:
        chameleon.profiler.timer = timer
    chameleon.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    reports = []
    for step in range(iterations):
        def closure():
            for micro in range(micro_batches):
                seed = (step if batch_seed is None else batch_seed) * micro_batches + micro
                tokens, labels = lm_batch(seed, batch=4, seq=16, vocab=MODEL["vocab"])
                (lm_loss(model, tokens, labels) / micro_batches).backward()

        chameleon.run_iteration(closure, optimizer=optimizer)
        optimizer.zero_grad(set_to_none=True)
        reports.append(chameleon.last_report)
    return chameleon, reports


def test_detailed_trace_times_every_layer_forward_and_backward(tmp_path):
    chameleon, _ = _emulated_run(1)
    trace = chameleon.last_trace
    assert set(trace.layer_times_s) == {0, 1} and set(trace.layer_backward_times_s) == {0, 1}
    assert all(t > 0 for t in [*trace.layer_times_s.values(), *trace.layer_backward_times_s.values()])
    again = StepTrace.load(trace.save(tmp_path / "trace.json"))
    assert again.layer_backward_times_s == trace.layer_backward_times_s
    older = trace.to_dict()
    del older["layer_backward_times_s"]  # a trace written before backward times existed
    assert StepTrace.from_dict(older).layer_backward_times_s == {}


class CountingTimer(HostTimer):
    """The host clock, counting marks and resolves."""

    def __init__(self, log: dict) -> None:
        self.log = log

    def mark(self) -> float:
        self.log["marks"] += 1
        return super().mark()

    def resolve(self) -> None:
        self.log["resolves"] += 1


def test_the_device_timer_is_resolved_once_per_traced_iteration():
    log = {"marks": 0, "resolves": 0}
    chameleon, reports = _emulated_run(2, timer=lambda: CountingTimer(log))
    assert [r.stage for r in reports] == ["warmup", "warmup"]
    assert log["resolves"] == 2
    # per layer call: enter, leave, backward start, backward end; 2 layers x 2 micro-batches x 2 iterations;
    # and the trace's own start and end (its T_iter is device time) per iteration
    assert log["marks"] == 4 * 2 * 2 * 2 + 2 * 2
    assert set(chameleon.last_trace.layer_backward_times_s) == {0, 1}


def test_backward_timing_leaves_the_op_sequence_unchanged():
    """Traced (WarmUp) iterations carry node hooks for backward times; untraced ones do not. Their op
    sequences must still be identical, or every policy would be matched against shifted ops."""
    _, reports = _emulated_run(5, micro_batches=1, batch_seed=0)
    assert [r.stage for r in reports][:3] == ["warmup", "warmup", "gen_policy"]
    assert not any(r.sequence_differs for r in reports[1:]), [r.sequence_change_kind for r in reports]


def test_cuda_event_timer_records_on_the_current_stream_and_synchronises_once(monkeypatch):
    stream = object()
    log = {"synchronize": []}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.stream = None

        def record(self, on):
            self.stream = on

        def elapsed_time(self, end):
            return 250.0  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log["synchronize"].append(device))
    from chameleon_dist.device.cuda import CudaBackend

    backend = CudaBackend.__new__(CudaBackend)  # (its constructor needs a GPU; the timer needs none of it)
    backend.index, backend.torch_device = 0, torch.device("cuda", 0)
    timer = EventTimer(backend)
    start, end = timer.mark(), timer.mark()
    assert start.stream is stream and end.stream is stream
    timer.resolve()
    assert log["synchronize"] == [torch.device("cuda", 0)]
    assert timer.elapsed_s(start, end) == 0.25


def test_cuda_device_hands_out_event_timers(monkeypatch):
    properties = types.SimpleNamespace(name="Fake GPU", total_memory=2**30)
    for name, value in {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
                        "get_device_properties": lambda index: properties,
                        "mem_get_info": lambda device=None: (2**30, 2**30), "memory_reserved": lambda device=None: 0,
                        "memory_allocated": lambda device=None: 0, "max_memory_allocated": lambda device=None: 0,
                        "max_memory_reserved": lambda device=None: 0,
                        "Stream": lambda device=None: object()}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    from chameleon_dist.device.cuda import CudaDevice

    # one timer for both backends: events on the device's own clock (the emulated device's is simulated)
    assert isinstance(CudaDevice().timer(), EventTimer)
    assert isinstance(EmulatedDevice(10**6).timer(), EventTimer)


# ---- GPU ----------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_MODEL = dict(vocab=1024, hidden=1024, heads=8, layers=4)  # head dim 128, bf16: flash attention
GPU_BATCH, GPU_SEQ = 4, 512


@pytest.fixture
def deterministic():
    """Deterministic kernels (flash attention, whose backward is then deterministic), restored afterwards: without them two
    runs of the same model differ in their last bits, with or without Chameleon."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # its backward is deterministic under the setting above
        yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]


def _gpu_model() -> GPT:
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = GPT(**GPU_MODEL)
    model = model.to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # kept between steps: every iteration starts from the same bytes
    return model


def _gpu_batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, GPU_MODEL["vocab"], (GPU_BATCH, GPU_SEQ + 1), generator=generator).cuda()


def _gpu_loss(model: GPT, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _plain_step(model, optimizer, batch) -> tuple[torch.Tensor, int, int]:
    """One step without Chameleon: (loss, bytes in use at its start, its peak)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    loss = _gpu_loss(model, batch)
    loss.backward()
    optimizer.step()
    torch.cuda.synchronize()
    return loss.detach(), start_bytes, torch.cuda.max_memory_allocated()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("allow_recompute", [False, True], ids=["swap-only", "swap+recompute"])
def test_gpu_chameleon_trains_a_gpt_below_the_unswapped_peak_bit_identically(deterministic, allow_recompute):
    """The two models train in lockstep on the same batches (both resident throughout, so process-wide
    peaks compare); Chameleon gets 70% of the activation peak the unswapped run measured. Gradients are
    compared right after each step, before either is zeroed."""
    reference, swapped = _gpu_model(), _gpu_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=1e-3)
    optimizer = torch.optim.SGD(swapped.parameters(), lr=1e-3)
    probe = _gpu_batch(-1)  # workspaces (cuBLAS, one handle per thread) exist before anything is measured
    _gpu_loss(reference, probe).backward()
    for p in reference.parameters():
        p.grad.zero_()
    chameleon = None
    stable_steps = []
    for step in range(20):
        batch = _gpu_batch(step)
        ref_loss, start_bytes, ref_peak = _plain_step(reference, ref_optimizer, batch)
        if chameleon is None:
            capacity = start_bytes + int(0.7 * (ref_peak - start_bytes))
            chameleon = Chameleon({"device": {"kind": "cuda", "capacity": capacity}, "memory_budget": 1.0,
                                   "profiler": {"policy_trials": 3},
                                   "executor": {"allow_recompute": allow_recompute}})
            chameleon.profiler.timer = chameleon.device.timer  # traced layer times from CUDA events
            chameleon.attach(swapped)
        loss = chameleon.run_iteration(lambda: _train_closure(swapped, batch), optimizer=optimizer)
        torch.cuda.synchronize()
        report = chameleon.last_report
        assert not report.emulated and not report.failed
        assert torch.equal(loss, ref_loss), f"step {step}: loss {loss.item()} != {ref_loss.item()}"
        for (name, p), q in zip(swapped.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: gradient of {name} differs"
            assert torch.equal(p, q), f"step {step}: {name} differs after the optimizer step"
        for model in (reference, swapped):
            for p in model.parameters():
                p.grad.zero_()
        if report.stage == "stable":
            stable_steps.append((step, report, ref_peak))
            if len(stable_steps) == 3:
                break
    assert len(stable_steps) == 3, f"Chameleon did not reach Stable in 20 steps (last stage {report.stage})"
    for step, report, ref_peak in stable_steps:
        assert report.peak_device_bytes < ref_peak, (
            f"step {step}: peak {report.peak_device_bytes} not below the unswapped {ref_peak} (capacity {capacity})")
        if not allow_recompute:
            assert report.swap_out_bytes > 0
    trace = chameleon.last_trace
    layers = set(range(GPU_MODEL["layers"]))
    assert set(trace.layer_times_s) == layers and set(trace.layer_backward_times_s) == layers
    chameleon.device.synchronize()


def _train_closure(model: GPT, batch: torch.Tensor) -> torch.Tensor:
    loss = _gpu_loss(model, batch)
    loss.backward()
    return loss.detach()


@pytest.mark.gpu
@gpu
def test_gpu_layer_times_come_from_cuda_events_read_once(deterministic, monkeypatch):
    from chameleon_dist.device.cuda import CudaDevice

    device = CudaDevice()
    model = _gpu_model()
    recorder = TraceRecorder(OpVocabulary(), device.live_bytes, set(), iteration=1, emulated=False,
                             timer=device.timer())
    recorder.watch_modules(model)
    synchronize = torch.cuda.synchronize
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device) or synchronize(device))
    with contextlib.ExitStack() as stack:
        stack.enter_context(recorder)
        _gpu_loss(model, _gpu_batch(0)).backward()
    trace = recorder.finish()
    assert len(calls) == 1, "layer times must be read with one device wait per iteration"
    layers = set(range(GPU_MODEL["layers"]))
    assert set(trace.layer_times_s) == layers and set(trace.layer_backward_times_s) == layers
    assert all(t > 0 for t in [*trace.layer_times_s.values(), *trace.layer_backward_times_s.values()])
