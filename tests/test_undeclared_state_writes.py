"""Ops that write state their schema does not declare (trace/state_writes.py): batch norm's running statistics.

``native_batch_norm`` (and ``cudnn_batch_norm``, ``miopen_batch_norm``, ``batch_norm_update_stats``...) updates
``running_mean``/``running_var`` in place while training, yet its schema marks neither as written and no
version counter moves. Run again, it applies the momentum update a second time: a per-tensor recompute of its
output in backward, or a retry after relief when it ran out of memory (the emulated device, like a GPU kernel
that wrote before an allocation failed, raises after the op ran). Both must leave the running statistics
``torch.equal`` to a plain run's: the recompute keeps the tensor instead, the dispatch layer lets the error
leave the op instead of retrying it. Not training (``training=False``), the op writes nothing and stays
recomputable and retryable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chameleon_dist.device.dispatch import retryable
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.simulated.memory import block_bytes
from chameleon_dist.executor import IterationContext, SwapExecutor
from chameleon_dist.policy.model import Decision
from chameleon_dist.trace.exactness import name_replays_exactly, replays_exactly, writes_undeclared_state
from chameleon_dist.trace.state_writes import UNDECLARED_STATE_WRITES
from tests.by_hand import Producers, policy_by_hand

aten = torch.ops.aten
FEATURES, ROWS = 64, 64
KEY = f"float32[{ROWS}, {FEATURES}]"
MiB = 2**20


class _Model(nn.Module):
    """x*2 -> BatchNorm1d -> gelu -> sin: batch norm saves x*2, gelu saves batch norm's output (the second
    saved storage of this shape, which the by-hand policy recomputes)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(FEATURES)

    def forward(self, x):
        return torch.nn.functional.gelu(self.bn(x * 2)).sin().sum()


def _x() -> torch.Tensor:
    return torch.linspace(-2, 2, ROWS * FEATURES).reshape(ROWS, FEATURES)


def _statistics(bn: nn.BatchNorm1d) -> tuple[torch.Tensor, ...]:
    return bn.running_mean, bn.running_var, bn.num_batches_tracked


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---- a planned recomputation of batch norm's output ------------------------------------------------------
@pytest.mark.parametrize("training", [True, False])
def test_recomputing_batch_norms_output_leaves_the_running_statistics_as_a_plain_run(training):
    reference = _Model().train(training)
    x_plain = _x().requires_grad_()
    reference(x_plain).backward()

    model = _Model().train(training)
    device = EmulatedDevice(10**9)
    device.track_module(model)
    executor = SwapExecutor(device, min_swap_bytes=0)
    x = device.track(_x()).requires_grad_()
    policy = policy_by_hand([None, Decision.RECOMPUTE], KEY)  # batch norm's input kept, its output recomputed
    with device.active(), executor.active(IterationContext(policy=policy)) as counters, Producers(executor):
        model(x).backward()
    assert _same(_statistics(model.bn), _statistics(reference.bn)), "the momentum update was applied twice"
    assert torch.equal(x.grad, x_plain.grad)
    assert torch.equal(model.bn.weight.grad, reference.bn.weight.grad)
    if training:  # it would write the statistics again: kept on the device instead
        assert (counters.recomputed_storages, counters.recompute_unavailable) == (0, 1)
    else:  # (the control) it writes nothing: rebuilt from its producer, bit for bit
        assert (counters.recomputed_storages, counters.recompute_unavailable) == (1, 0)


# ---- an out-of-memory retry of batch norm --------------------------------------------------------------
def _short_at_batch_norm(training: bool):
    """Batch norm on an emulated device that fits its outputs only once a spare MiB is freed by the pressure
    handler. Returns (the model, the plain run's model, the output or the error, the handler's calls)."""
    torch.manual_seed(0)
    model = nn.BatchNorm1d(256).train(training)
    plain = nn.BatchNorm1d(256).train(training)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(1024, 256)
    expected = plain(x)
    outputs = aten.native_batch_norm.default(x, plain.weight, plain.bias, plain.running_mean.clone(),
                                             plain.running_var.clone(), training, 0.1, 1e-5)
    out_bytes = sum(block_bytes(t.untyped_storage().nbytes()) for t in outputs)
    spare = [torch.ones(MiB // 4)]
    resident_bytes = sum(block_bytes(t.untyped_storage().nbytes()) for t in (x, spare[0], *model.parameters(),
                                                                             *model.buffers()))
    device = EmulatedDevice(resident_bytes + out_bytes - 512)  # its outputs are one block short
    device.track_module(model)
    device.track(x)
    device.track(spare[0])
    calls = []

    def handler(short_bytes: int) -> int:
        calls.append(short_bytes)
        spare.clear()
        return MiB

    device.set_pressure_handler(handler)
    try:
        with device.active():
            result = model(x)
    except torch.OutOfMemoryError as error:
        result = error
    return model, plain, expected, result, calls, device


def test_batch_norm_that_runs_short_while_training_is_not_retried():
    model, plain, _, result, calls, device = _short_at_batch_norm(training=True)
    assert _same(_statistics(model), _statistics(plain)), "the retry applied the momentum update twice"
    assert isinstance(result, torch.OutOfMemoryError)  # the error leaves the op (run_iteration's to handle)
    assert calls == [] and device.dispatch.relieved_ops == 0


def test_batch_norm_that_runs_short_in_eval_is_relieved_and_retried():
    """(The control) not training, it writes nothing: relieved and run again, equal to the plain run."""
    model, plain, expected, result, calls, device = _short_at_batch_norm(training=False)
    assert len(calls) == 1 and device.dispatch.relieved_ops == 1
    assert torch.equal(result, expected)
    assert _same(_statistics(model), _statistics(plain))


# ---- the table and both of its users ------------------------------------------------------------------
T = torch.empty(0)  # a tensor argument whose value does not matter
WRITE = [  # (op, args, kwargs): writes running statistics
    (aten.native_batch_norm.default, (T, T, T, T, T, True, 0.1, 1e-5), {}),
    (aten.native_batch_norm.default, (T, None, None, T, None, True, 0.1, 1e-5), {}),  # one statistic given
    (aten.cudnn_batch_norm.default, (T, T, T, T, T, True, 0.1, 1e-5), {}),
    (aten.miopen_batch_norm.default, (T, T, T, T, T, True, 0.1, 1e-5), {}),
    (aten.batch_norm_update_stats.default, (T, T, T, 0.1), {}),
    (aten.batch_norm_gather_stats.default, (T, T, T, T, T, 0.1, 1e-5, 8), {}),
    (aten.batch_norm_gather_stats_with_counts.default, (T, T, T, T, T, 0.1, 1e-5, T), {}),
    (aten.batch_norm.default, (T, T, T, T, T, True, 0.1, 1e-5, False), {}),
    (aten._batch_norm_impl_index.default, (T, T, T, T, T, True, 0.1, 1e-5, True), {}),
    (aten.instance_norm.default, (T, T, T, T, T, True, 0.1, 1e-5, False), {}),
    (aten.native_batch_norm.default, (), {}),  # arguments not known: assumed to write
]
NO_WRITE = [
    (aten.native_batch_norm.default, (T, T, T, T, T, False, 0.1, 1e-5), {}),  # not training
    (aten.native_batch_norm.default, (T, T, T, None, None, True, 0.1, 1e-5), {}),  # no statistics to update
    (aten.cudnn_batch_norm.default, (T, T, T, T, T), {"training": False, "exponential_average_factor": 0.1,
                                                     "epsilon": 1e-5}),
    (aten.instance_norm.default, (T, T, T, T, T, False, 0.1, 1e-5, False), {}),  # uses the running stats
    (aten.batch_norm_update_stats.default, (T, None, None, 0.1), {}),
    # functional variants return the new statistics; "no_training"/"no_update" read them only
    (aten._native_batch_norm_legit_functional.default, (T, T, T, T, T, True, 0.1, 1e-5), {}),
    (aten._batch_norm_with_update_functional.default, (T, T, T, T, T, 0.1, 1e-5), {}),
    (aten._native_batch_norm_legit_no_training.default, (T, T, T, T, T, 0.1, 1e-5), {}),
    (aten._batch_norm_no_update.default, (T, T, T, T, T, 0.1, 1e-5), {}),
    (aten.mm.default, (T, T), {}),
]


def _id(case) -> str:
    func, args, kwargs = case
    return f"{func}({', '.join(repr(a) for a in args if not isinstance(a, torch.Tensor))}{kwargs or ''})"


@pytest.mark.parametrize("case", WRITE, ids=_id)
def test_ops_that_write_state_undeclared_are_neither_replayed_nor_retried(case):
    func, args, kwargs = case
    assert not func._schema.is_mutable, "declared: the schema rule refuses it already, no table entry needed"
    assert writes_undeclared_state(func, args, kwargs)
    assert not replays_exactly(func, args, kwargs)
    assert not retryable(func, args, kwargs)


@pytest.mark.parametrize("case", NO_WRITE, ids=_id)
def test_the_same_ops_writing_nothing_replay_and_retry(case):
    func, args, kwargs = case
    assert not writes_undeclared_state(func, args, kwargs)
    assert replays_exactly(func, args, kwargs)
    assert retryable(func, args, kwargs)


def test_the_table_names_real_ops_with_undeclared_arguments_and_a_reason():
    for name, write in UNDECLARED_STATE_WRITES.items():
        packet = getattr(aten, name)
        schema = packet.default._schema
        assert not schema.is_mutable, name
        names = {a.name for a in schema.arguments}
        assert set(write.written) <= names and (write.unless_false is None or write.unless_false in names), name
        assert write.reason, name
    # a trace that recorded no arguments: the arguments decide, so refused
    assert not name_replays_exactly("aten.native_batch_norm.default")
    # declared writers need no entry: the schema rule refuses them already
    assert aten._batch_norm_with_update.default._schema.is_mutable
    assert aten._native_batch_norm_legit.default._schema.is_mutable
    assert not retryable(aten._batch_norm_with_update.default) and not retryable(aten._native_batch_norm_legit.default)
