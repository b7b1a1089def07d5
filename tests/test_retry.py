"""``run_iteration``'s out-of-memory retry: every gradient back to where the iteration began (also of
parameters outside attached models), the device's random state replayed, a failure in the optimizer step
named and leaving the optimizer usable, a host budget that refused the swaps named as the cause, and a
failed iteration visible in ``last_report``."""

import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.device.simulated.memory import block_bytes
from chameleon_dist.retry import GradientSnapshot, OptimizerStepOutOfMemoryError
from tests.models import lm_batch, lm_loss, make_lm

MODEL = dict(vocab=64, hidden=32, heads=4, layers=1, dropout=0.1)


class FailOnce(TorchDispatchMode):
    """Raises an out-of-memory error at the ``at``-th op (counting from the first op after ``arm()``),
    once; or at the ``at``-th call of ``func`` when one is given. ``times=2`` fails that op's retry after
    relief too (NOTE [Relief inside the op] in device/dispatch.py), so the error leaves the op."""

    def __init__(self, at, func=None, times=1):
        super().__init__()
        self.at, self.func, self.count, self.armed, self.times = at, func, 0, True, times

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.armed and (self.func is None or func is self.func):
            self.count += 1
            if self.at <= self.count < self.at + self.times:
                self.armed = self.count < self.at + self.times - 1
                raise torch.OutOfMemoryError(f"injected out of memory at {func}")
        return func(*args, **(kwargs or {}))


class WithHead(nn.Module):
    """A model split in two: ``body`` is attached to Chameleon, ``head`` (in the optimizer) is not."""

    def __init__(self):
        super().__init__()
        self.body = make_lm(0, **MODEL)
        self.head = nn.Linear(MODEL["vocab"], MODEL["vocab"])


def _two_micro_batches(model, step, fail=None):
    def closure():
        total = torch.zeros(())
        for micro in range(2):
            tokens, labels = lm_batch(2 * step + micro, vocab=MODEL["vocab"])
            if micro == 1 and fail is not None and fail.armed:
                with fail:  # the second micro-batch fails once: the first one's gradients are in place
                    loss = _loss(model, tokens, labels)
            else:
                loss = _loss(model, tokens, labels)
            (loss / 2).backward()
            total += loss.detach()
        return total

    return closure


def _loss(model, tokens, labels):
    logits = model.head(model.body(tokens))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _train(steps, fail_at=None, pass_optimizer=True, zero_grad=True, seed=0, set_to_none=True):
    torch.manual_seed(seed)
    model = WithHead()
    chameleon = Chameleon({"min_swap_bytes": 0}, device=EmulatedDevice(10**9))
    chameleon.attach(model.body)  # the head is not attached
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    torch.manual_seed(seed + 1)
    for step in range(steps):
        fail = FailOnce(fail_at) if fail_at is not None and step == 1 else None
        closure = _two_micro_batches(model, step, fail)
        chameleon.run_iteration(closure, optimizer=optimizer if pass_optimizer else None)
        if not pass_optimizer:
            optimizer.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        if zero_grad:
            optimizer.zero_grad(set_to_none=set_to_none)
    return grads, chameleon


def _assert_equal(reference, candidate):
    for step, (ref, got) in enumerate(zip(reference, candidate)):
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), f"gradient {i} differs at step {step}"


@pytest.mark.parametrize("zero_grad", [True, False], ids=["zeroed", "accumulating"])
def test_a_retry_restores_the_gradients_of_every_optimizer_parameter(zero_grad):
    reference, _ = _train(3, zero_grad=zero_grad)
    retried, chameleon = _train(3, fail_at=40, zero_grad=zero_grad)
    _assert_equal(reference, retried)


def test_a_retry_restores_gradients_zeroed_in_place_without_copying_them():
    """Gradient buffers zeroed in place (``zero_grad(set_to_none=False)``, Megatron's and DeepSpeed's
    buffers) are restored by zeroing them again: bit-identical, and no per-iteration host copy."""
    reference, _ = _train(3, set_to_none=False)
    retried, chameleon = _train(3, fail_at=40, set_to_none=False)
    _assert_equal(reference, retried)
    assert chameleon.last_report.oom_retries == 0
    model = WithHead()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert GradientSnapshot(model.parameters()).host_bytes == 0


def test_a_gradient_snapshot_gives_back_every_bit():
    """Zeros are not copied; anything else (a -0.0, a NaN, values, bf16, a sparse gradient) is, and every
    gradient comes back bit for bit, as the same tensor object."""
    shapes = [(3, 4), (5,), (2, 2), (7,), (4,), (6, 2)]
    params = [nn.Parameter(torch.ones(s)) for s in shapes]
    params[4] = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    grads = [torch.zeros(3, 4), torch.zeros(5), torch.full((2, 2), float("nan")), None,
             torch.zeros(4, dtype=torch.bfloat16), torch.sparse_coo_tensor([[1], [0]], [2.0], (6, 2), check_invariants=True)]
    grads[1][3] = -0.0
    for p, g in zip(params, grads):
        p.grad = g
    before = [None if g is None else g.clone() for g in grads]
    snapshot = GradientSnapshot(params + params[:2])  # a parameter listed twice is taken once
    assert len(snapshot) == len(params)
    assert snapshot.host_bytes == 0  # nothing is copied before backward is about to add to a gradient
    generator = torch.Generator().manual_seed(0)
    sum((p * torch.randn(p.shape, generator=generator).to(p.dtype)).sum() for p in params).backward()
    assert snapshot.host_bytes == (5 + 4) * 4 + 6 * 2 * 4  # the -0.0, the NaNs and the sparse one
    params[4].grad = None
    snapshot.restore()
    snapshot.close()
    for p, g, b in zip(params, grads, before):
        if g is None:
            assert p.grad is None
            continue
        assert p.grad is g
        if g.is_sparse:
            assert torch.equal(g.to_dense(), b.to_dense())
        else:
            bits = {2: torch.int16, 4: torch.int32}[g.element_size()]
            assert torch.equal(g.view(bits), b.view(bits)), "restored bit for bit (-0.0, NaN included)"


def test_without_the_optimizer_a_retry_warns_that_unknown_parameters_are_not_restored(caplog):
    with caplog.at_level(logging.WARNING, logger="chameleon_dist.runtime"):
        _train(3, fail_at=40, pass_optimizer=False)
    warnings = [r for r in caplog.records if "without optimizer=" in r.getMessage()]
    assert len(warnings) == 1 and "attach()" in warnings[0].getMessage()


def test_a_retry_replays_the_device_random_state():
    """On a GPU, dropout draws from the device's generator: the retry must restore it too."""
    states = []

    class RecordingDevice(EmulatedDevice):
        def __init__(self):
            super().__init__(10**9)
            self.generator_state = torch.tensor([0])

        def random_state(self):
            return self.generator_state.clone()

        def set_random_state(self, state):
            states.append(int(state))
            self.generator_state = state.clone()

    device = RecordingDevice()
    chameleon = Chameleon({"min_swap_bytes": 0}, device=device)
    calls = []

    def closure():
        calls.append(1)
        device.generator_state += 1  # the device generator advances as the attempt draws numbers
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return device.generator_state.clone()

    drawn_at = chameleon.run_iteration(closure)
    assert states == [0] and int(drawn_at) == 1  # the retry started from the same state


def test_out_of_memory_in_the_optimizer_step_is_named_and_leaves_the_optimizer_usable():
    model = make_lm(0, **MODEL)
    chameleon = Chameleon({"min_swap_bytes": 0}, device=EmulatedDevice(10**9))
    chameleon.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, labels = lm_batch(0, vocab=MODEL["vocab"])
    closure = lambda: lm_loss(model, tokens, labels).backward()  # noqa: E731
    # AdamW creates its state lazily; the op and its retry after relief both run short
    fail = FailOnce(3, func=torch.ops.aten.zeros_like.default, times=2)
    with pytest.raises(OptimizerStepOutOfMemoryError, match=r"optimizer\.step\(\)"):
        with fail:
            chameleon.run_iteration(closure, optimizer=optimizer)
    report = chameleon.last_report
    assert report.failed and "optimizer.step()" in report.error and report.oom_retries == 0
    assert not optimizer.state, "half-created state was discarded"
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()  # usable: no KeyError('exp_avg')

    reference = make_lm(0, **MODEL)
    for p, g in zip(reference.parameters(), grads):
        p.grad = g
    torch.optim.AdamW(reference.parameters(), lr=1e-3).step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_a_host_budget_that_refuses_every_swap_is_named_as_the_cause(caplog):
    model = make_lm(0, vocab=64, hidden=64, heads=4, layers=2, dropout=0.0)
    tokens, labels = lm_batch(0, batch=8, seq=32, vocab=64)
    measure = Chameleon({"enabled": False}, device=EmulatedDevice(10**9))
    measure.attach(model)
    measure.run_iteration(lambda: lm_loss(model, tokens, labels).backward())
    model.zero_grad(set_to_none=True)
    capacity_bytes = measure.last_report.peak_device_bytes * 3 // 4
    chameleon = Chameleon({"min_swap_bytes": 0, "host_memory_budget": "1KiB", "device": {"kind": "emulated", "capacity": capacity_bytes}})
    chameleon.attach(model)
    with caplog.at_level(logging.WARNING, logger="chameleon_dist.runtime"):
        with pytest.raises(torch.OutOfMemoryError, match="host_memory_budget") as info:
            chameleon.run_iteration(lambda: lm_loss(model, tokens, labels).backward())
    assert "raise host_memory_budget to at least" in str(info.value)
    assert "already swaps every saved activation" not in str(info.value)
    assert not any("min_swap_bytes lowered" in r.getMessage() for r in caplog.records)
    assert chameleon.last_report.failed and chameleon.last_report.oom_retries == 3


def test_a_failed_iteration_is_reported():
    model = make_lm(0, **MODEL)
    chameleon = Chameleon({"min_swap_bytes": 0}, device=EmulatedDevice(10**9))
    chameleon.attach(model)
    tokens, labels = lm_batch(0, vocab=MODEL["vocab"])
    chameleon.run_iteration(lambda: lm_loss(model, tokens, labels).backward())
    assert chameleon.last_report.iteration == 1 and not chameleon.last_report.failed

    def broken():
        lm_loss(model, tokens, labels).backward()
        raise ValueError("a bad batch")

    trace = chameleon.last_trace
    with pytest.raises(ValueError):
        chameleon.run_iteration(broken)
    assert chameleon.last_trace is trace, "the partial trace of a failed iteration is not kept"
    report = chameleon.last_report
    assert report.failed and report.error == "ValueError: a bad batch"
    assert report.iteration == 2 and report.swap_out_bytes > 0
    chameleon.run_iteration(lambda: lm_loss(model, tokens, labels).backward())
    assert chameleon.last_report.iteration == 2 and not chameleon.last_report.failed


@pytest.mark.parametrize("swapped", [False, True])
def test_a_graph_left_from_a_failed_attempt_gives_its_memory_to_the_retry(swapped):
    """An error inside backward can leave the attempt's graph alive where the garbage collector cannot reach
    it (PyTorch's engine holds a graph whose backward raised; here a list does, to be sure). Its saved
    tensors, kept or swapped, must not hold device or host memory through the retry, and running backward
    on it afterwards is an error, never stale data."""
    from chameleon_dist.executor import IterationContext, SwapExecutor

    # (a fixed device model: with this CPU's measured rates the forward's kernels can still be running on the
    # device clock at the retry, and a host buffer is in use until the copy into it has run, as on a GPU)
    device = EmulatedDevice(2**30, preset="h100-pcie", host_op_s=2e-5)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    device.track_module(model)
    executor = SwapExecutor(device, min_swap_bytes=1024 if swapped else 2**40)
    executor.protect(model)
    left_behind = []
    with device.active():
        base_bytes = device.live_bytes()
        with executor.active(IterationContext()):
            left_behind.append(model(torch.randn(512, 256)).sum())  # the failed attempt's graph
            loss_bytes = block_bytes(4)  # a one-element loss is a 512-byte block
            if swapped:  # its activations wait on the host
                assert device.host_pool.in_use_bytes >= 3 * 512 * 256 * 4
            else:  # ... or on the device
                assert device.live_bytes() >= base_bytes + loss_bytes + 3 * 512 * 256 * 4
            executor.new_attempt()  # the retry begins
            assert device.live_bytes() == base_bytes + loss_bytes, "the retry starts with what the iteration began with"
            assert device.host_pool.in_use_bytes == 0
            with pytest.raises(RuntimeError, match="ran out of memory and was retried"):
                left_behind[0].backward()
            loss = model(torch.randn(512, 256)).sum()  # the retry's own graph works
            loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_retry_does_not_inherit_the_failed_attempts_frames():
    """The out-of-memory error can stay referenced after the retry began (PyTorch's engine can hold an
    error raised inside backward; here a list holds it): the tensors the failed attempt's frames held
    must not stay on the device through the retry."""
    device = EmulatedDevice(2**30)
    chameleon = Chameleon({}, device=device)
    live_at_start, held = [], []

    def closure():
        live_at_start.append(device.live_bytes())
        activations = torch.zeros(256, 1024)  # 1 MiB on the device, referenced only by this frame
        if len(live_at_start) == 1:
            try:
                raise torch.OutOfMemoryError("out of memory (raised by the test)")
            except torch.OutOfMemoryError as exc:
                held.append(exc)
                raise
        return activations.sum()

    chameleon.run_iteration(closure)
    assert len(live_at_start) == 2 and chameleon.last_report.oom_retries == 1
    assert live_at_start[1] == live_at_start[0], "the failed attempt's 1 MiB is gone before the retry"


def _decaying_train(fail_at=None, decay_in_place=True):
    """Gradients accumulate across iterations (never zeroed); each closure first decays them in place
    (``grad.mul_(0.5)``), before backward reaches them, then runs two micro-batches."""
    torch.manual_seed(0)
    model = WithHead()
    chameleon = Chameleon({"min_swap_bytes": 0}, device=EmulatedDevice(10**9))
    chameleon.attach(model.body)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        fail = FailOnce(fail_at) if fail_at is not None and step == 1 else None
        inner = _two_micro_batches(model, step, fail)

        def closure(inner=inner):
            if decay_in_place:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(0.5)
            return inner()

        chameleon.run_iteration(closure, optimizer=optimizer)
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def test_a_gradient_written_in_place_before_backward_is_an_error_on_retry_not_a_wrong_gradient():
    """The snapshot keeps a gradient's starting bits when backward first adds to it; a closure that decays
    the gradients first would have its decay kept as the 'start', and the retry would decay twice. It must
    raise instead. Without the decay, the same retry is bit-identical."""
    _assert_equal(_decaying_train(decay_in_place=False), _decaying_train(fail_at=40, decay_in_place=False))
    _decaying_train(decay_in_place=True)  # (no retry: fine)
    with pytest.raises(RuntimeError, match="written in place inside the closure before backward"):
        _decaying_train(fail_at=40, decay_in_place=True)
