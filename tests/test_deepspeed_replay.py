"""Out-of-memory replay of a DeepSpeed accumulation window on one rank (gloo, in-process): ``run_window`` under
ZeRO-0/2/3 and ``PipelineEngine.train_batch`` replay a window that failed in its 2nd micro-batch and train
bit-identically to a run without the failure; the user's own loop discards the window and the next one starts
clean. The failure is a one-shot ``torch.OutOfMemoryError`` injected from a module's forward or backward."""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.nn import functional as F

deepspeed = pytest.importorskip("deepspeed")
from tests.deepspeed_session import TokenEmbedding, one_rank_deepspeed, token_cross_entropy  # noqa: E402
import torch.distributed as dist  # noqa: E402

from chameleon_dist.integrations.deepspeed.engine import initialize  # noqa: E402
from chameleon_dist.integrations.deepspeed.replay import WindowDiscardedOutOfMemoryError  # noqa: E402
from chameleon_dist.retry import OptimizerStepOutOfMemoryError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")

VOCAB, HIDDEN, SEQ, BATCH = 64, 64, 16, 4
WINDOWS, ACCUMULATION = 2, 2  # window 1 fails in its 2nd micro-batch (the user-loop test runs a 3rd)
CHAMELEON = {"device": {"kind": "emulated", "capacity": "1GB"}, "min_swap_bytes": "4KiB"}
SECOND_WINDOW_SECOND_BACKWARD = ("backward", ACCUMULATION + 2)  # window 1, micro-batch 1 (0-based)


class Fault:
    """Raises ``torch.OutOfMemoryError`` once: at the ``at``-th forward (or backward) through its point."""

    def __init__(self, phase: str | None = None, at: int = 0) -> None:
        self.phase, self.at, self.fired = phase, at, 0
        self.seen = {"forward": 0, "backward": 0}

    def check(self, phase: str) -> None:
        self.seen[phase] += 1
        if phase == self.phase and self.seen[phase] == self.at:
            self.fired += 1
            raise torch.OutOfMemoryError(f"injected out of memory in {phase} {self.at}")


class _FaultPoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fault):
        ctx.fault = fault
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.fault.check("backward")
        return grad, None


class FaultLayer(nn.Module):
    """Between two blocks: a backward that fails here has already produced (and ZeRO reduced) the later
    blocks' gradients."""

    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.fault = fault

    def forward(self, x):
        if torch.is_grad_enabled():
            self.fault.check("forward")
        return _FaultPoint.apply(x, self.fault)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                 nn.Linear(4 * HIDDEN, HIDDEN), nn.Dropout(0.1))

    def forward(self, x):
        return x + self.mlp(x)


class TinyGPT(nn.Module):
    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(), FaultLayer(fault), Block()])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), labels.reshape(-1))


def _config(stage: int, bf16: bool = False) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        # small buckets: the failing backward has already reduced a bucket (params_already_reduced set)
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000},
        "steps_per_print": 10**9, "chameleon": CHAMELEON,
    }
    if bf16:  # with ZeRO-1: DeepSpeed's BF16_Optimizer, fp32 gradient accumulators
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    return config


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield from one_rank_deepspeed()


def _micro_batches(window: int) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(window * 10 + m))
            for m in range(ACCUMULATION)]


def _params(engine, stage: int) -> list[torch.Tensor]:
    full = deepspeed.utils.safe_get_full_fp32_param if stage == 3 else (lambda p: p)
    return [full(p).detach().clone() for p in engine.module.parameters()]


def _run_windows(stage: int, fault: Fault, bf16: bool = False):
    torch.manual_seed(0)
    engine, *_ = initialize(model=TinyGPT(fault), model_parameters=None, config=_config(stage, bf16))
    assert not bf16 or type(engine.optimizer).__name__ == "BF16_Optimizer"
    losses, retries = [], []
    for window in range(WINDOWS):
        batches = _micro_batches(window)

        def window_closure():
            out = []
            for tokens in batches:
                loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                out.append(loss.detach().clone())
            return out

        losses += engine.chameleon.run_window(window_closure)
        retries.append(engine.chameleon.last_report.oom_retries)
    assert engine.chameleon.last_report.iteration == WINDOWS and engine.global_steps == WINDOWS
    params = _params(engine, stage)
    engine.chameleon.close()
    return losses, params, retries


def _identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("stage,bf16,phase_at", [  # (ZeRO-3 and bf16: 7 and 10 s loaded, out of the quick tier)
    (0, False, SECOND_WINDOW_SECOND_BACKWARD), (2, False, SECOND_WINDOW_SECOND_BACKWARD),
    (2, False, ("forward", ACCUMULATION + 2)), pytest.param(3, False, SECOND_WINDOW_SECOND_BACKWARD, marks=pytest.mark.slow),
    pytest.param(1, True, SECOND_WINDOW_SECOND_BACKWARD, marks=pytest.mark.slow),
])
def test_run_window_replays_a_window_bit_identically(stage, bf16, phase_at):
    ref_losses, ref_params, ref_retries = _run_windows(stage, Fault(), bf16)
    fault = Fault(*phase_at)
    losses, params, retries = _run_windows(stage, fault, bf16)
    assert fault.fired == 1 and ref_retries == [0, 0] and retries == [0, 1]
    assert _identical(ref_losses, losses)  # micro-batch 0 of the replayed window drew the same dropout mask
    assert _identical(ref_params, params)  # micro-batch 0's reduced gradient was not counted twice


def _pipeline(fault: Fault):
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    model = PipelineModule([LayerSpec(TokenEmbedding, VOCAB, HIDDEN), LayerSpec(Block), LayerSpec(FaultLayer, fault),
                            LayerSpec(Block), LayerSpec(nn.Linear, HIDDEN, VOCAB)], num_stages=1,
                           loss_fn=token_cross_entropy, partition_method="uniform")
    engine, *_ = initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                            config=_config(1))
    data = iter([(t[:, :-1], t[:, 1:]) for window in range(WINDOWS) for t in _micro_batches(window)])
    losses, retries = [], []
    for _ in range(WINDOWS):  # one iterator for all batches: a replay that took new items would run dry
        losses.append(engine.train_batch(data).detach().clone())
        retries.append(engine.chameleon.last_report.oom_retries)
    assert next(data, None) is None and engine.chameleon.last_report.iteration == WINDOWS
    params = _params(engine, 1)
    engine.chameleon.close()
    return losses, params, retries


def test_pipeline_train_batch_replays_the_same_micro_batches_bit_identically():
    ref_losses, ref_params, _ = _pipeline(Fault())
    fault = Fault(*SECOND_WINDOW_SECOND_BACKWARD)
    losses, params, retries = _pipeline(fault)
    assert fault.fired == 1 and retries == [0, 1]
    assert _identical(ref_losses, losses) and _identical(ref_params, params)


def _user_loop(stage: int, fault: Fault, windows: list[int]):
    torch.manual_seed(0)
    engine, *_ = initialize(model=TinyGPT(fault), model_parameters=None, config=_config(stage))
    errors = []
    for window in windows:
        torch.manual_seed(100 + window)
        try:
            for tokens in _micro_batches(window):
                engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
                engine.step()
        except WindowDiscardedOutOfMemoryError as error:
            errors.append(error)
            _assert_window_start(engine, stage, micro_steps=ACCUMULATION * window)
    params = _params(engine, stage)
    engine.chameleon.close()
    return engine, errors, params


def _assert_window_start(engine, stage: int, micro_steps: int) -> None:
    """Nothing accumulated anywhere, and the engine's counters at the window's start."""
    optimizer = engine.optimizer
    assert engine.micro_steps == micro_steps and engine.global_steps == micro_steps // ACCUMULATION
    assert all(p.grad is None and getattr(p, "grad_accum", None) is None for p in engine.module.parameters())
    assert not any(optimizer.params_already_reduced.values() if stage == 3 else optimizer.params_already_reduced)
    assert all(not bucket.params for bucket in optimizer.ipg_buckets.values())
    if stage == 3:
        assert optimizer.micro_step_id == 0 and not optimizer.grad_partitions_flat_buffer.any()
    else:
        assert all(g is None for g in [*optimizer.averaged_gradients.values(), *optimizer.all_grad_tensors.values()])
        assert optimizer.grads_in_partition is None and optimizer.grads_in_partition_offset == 0
    report = engine.chameleon.last_report
    assert report.failed and report.iteration == micro_steps // ACCUMULATION + 1


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])  # (ZeRO-3: 5 s loaded, not quick)
def test_user_loop_discards_the_window_and_the_next_starts_clean(stage):
    fault = Fault(*SECOND_WINDOW_SECOND_BACKWARD)
    engine, errors, params = _user_loop(stage, fault, [0, 1, 2])
    assert fault.fired == 1 and len(errors) == 1
    message = str(errors[0])
    assert "discarded" in message and "engine.chameleon.run_window(closure)" in message
    assert engine.global_steps == 2 and engine.chameleon.last_report.iteration == 2
    _, _, skipped_params = _user_loop(stage, Fault(), [0, 2])  # window 1's data never seen
    assert _identical(skipped_params, params)


def _fail_first_optimizer_step(engine) -> dict:
    """``engine.optimizer.step`` raises ``torch.OutOfMemoryError`` on its first call (window 0's boundary)."""
    original, calls = engine.optimizer.step, {"n": 0}

    def step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("injected out of memory in the optimizer step")
        return original(*args, **kwargs)

    engine.optimizer.step = step
    return calls


def _assert_step_failure(engine, error: BaseException, calls: dict) -> None:
    assert isinstance(error, OptimizerStepOutOfMemoryError) and "optimizer step" in str(error)
    assert "injected" in str(error.__cause__)
    assert calls["n"] == 1  # not replayed: the step may have changed parameters
    report = engine.chameleon.last_report
    assert report.failed and report.iteration == 1 and report.oom_retries == 0
    assert engine.global_steps == 0 and not engine.chameleon.open_iteration.active


def test_out_of_memory_in_the_boundary_step_is_not_replayed_and_the_next_window_runs():
    """run_window: the boundary's optimizer step fails; the window is discarded, never replayed, and the
    next window trains as iteration 1."""
    torch.manual_seed(0)
    engine, *_ = initialize(model=TinyGPT(Fault()), model_parameters=None, config=_config(2))
    calls = _fail_first_optimizer_step(engine)

    def window(batches):
        def run():
            for tokens in batches:
                engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
                engine.step()
        return run

    with pytest.raises(torch.OutOfMemoryError) as raised:
        engine.chameleon.run_window(window(_micro_batches(0)))
    _assert_step_failure(engine, raised.value, calls)
    assert engine.micro_steps == 0
    engine.chameleon.run_window(window(_micro_batches(1)))
    assert engine.global_steps == 1 and engine.chameleon.last_report.iteration == 1
    assert not engine.chameleon.last_report.failed
    engine.chameleon.close()


def test_out_of_memory_in_the_pipeline_optimizer_step_is_not_replayed():
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    model = PipelineModule([LayerSpec(TokenEmbedding, VOCAB, HIDDEN), LayerSpec(Block), LayerSpec(nn.Linear, HIDDEN, VOCAB)],
                           num_stages=1, loss_fn=token_cross_entropy, partition_method="uniform")
    engine, *_ = initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                            config=_config(1))
    calls = _fail_first_optimizer_step(engine)
    data = iter([(t[:, :-1], t[:, 1:]) for window in range(WINDOWS) for t in _micro_batches(window)])
    with pytest.raises(torch.OutOfMemoryError) as raised:
        engine.train_batch(data)
    _assert_step_failure(engine, raised.value, calls)
    engine.train_batch(data)
    assert engine.global_steps == 1 and engine.chameleon.last_report.iteration == 1
    assert next(data, None) is None
    engine.chameleon.close()
