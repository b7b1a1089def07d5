"""The one judge of exact recomputation (trace/exactness.py), checked against the real aten schemas (every
one exists in a CPU build, so the CUDA-only fused attention kernels are covered too), and its two users:
the recorder, which keeps the forward ops it refuses with their arguments, and the policy, which refuses to
recompute what they produced."""

from __future__ import annotations

import pytest
import torch

from chameleon_dist.policy.candidates import find_candidates
from chameleon_dist.profiler.recorder import TraceRecorder
from chameleon_dist.profiler.signature import OpVocabulary
from chameleon_dist.trace.exactness import (
    Replay,
    ReplayJudge,
    name_replays_exactly,
    op_named,
    replays_exactly,
    schema_verdict,
)
from tests.policy_traces import OP_NAMES, layered_trace

aten = torch.ops.aten
T = None  # a tensor argument: the judge reads only the schema and the non-tensor arguments
S = torch.empty(0)  # a running statistic: given (a tensor) or not (None) decides whether batch norm writes it

REFUSED = [
    # fused attention that draws its dropout mask inside the kernel (CUDA), dropout_p above zero
    (aten._scaled_dot_product_flash_attention.default, (T, T, T, 0.1), {}),
    (aten._scaled_dot_product_flash_attention.default, (T, T, T), {"dropout_p": 0.1}),
    (aten._scaled_dot_product_efficient_attention.default, (T, T, T, T, True, 0.2), {}),
    (aten._scaled_dot_product_cudnn_attention.default, (T, T, T, T, True), {"dropout_p": 0.3}),
    (aten._flash_attention_forward.default, (T, T, T, T, T, 8, 8, 0.1, False, False), {}),
    (aten._efficient_attention_forward.default, (T, T, T, T, T, T, 8, 8, 0.1, 0), {}),
    (aten._scaled_dot_product_flash_attention_for_cpu.default, (T, T, T, 0.5), {}),
    (aten._scaled_dot_product_attention_math.default, (T, T, T, T, 0.1), {}),
    # dropout that draws: p above zero in training; native_dropout draws even at p=0 unless train is false
    (aten.native_dropout.default, (T, 0.1, True), {}),
    (aten.native_dropout.default, (T, 0.0, True), {}),
    (aten.native_dropout.default, (T, 0.1, None), {}),
    (aten.dropout.default, (T, 0.1, True), {}),
    (aten.feature_alpha_dropout.default, (T, 0.5, True), {}),
    # a Generator argument, or seeded with nothing to say it draws nothing
    (aten.bernoulli.p, (T, 0.5), {}),
    (aten.bernoulli.default, (T,), {}),
    (aten.normal.Tensor_float, (T,), {}),
    (aten.uniform.default, (T,), {}),
    (aten._fused_dropout.default, (T, 0.1), {}),
    (aten.rand.default, ([4],), {}),
    (aten.randn_like.default, (T,), {}),
    (aten.randperm.default, (8,), {}),
    (aten.multinomial.default, (T, 2), {}),
    (aten.rrelu_with_noise.default, (T, T), {}),
    (aten.rrelu_with_noise.default, (T, T, 0.1, 0.3, False), {}),  # (by name even when not training)
    # atomics-based kernels
    (aten.bincount.default, (T,), {}),
    (aten.histc.default, (T,), {}),
    (aten.index_add.default, (T, 0, T, T), {}),
    (aten.scatter_add.default, (T, 0, T, T), {}),
    (aten.index_put.default, (T, [T], T, True), {}),
    (aten.index_put.default, (T, [T], T), {"accumulate": True}),
    (aten._unsafe_index_put.default, (T, [T], T, True), {}),
    (aten.embedding_dense_backward.default, (T, T, 10, -1, False), {}),
    (aten.scatter.reduce, (T, 0, T, T), {"reduce": "add"}),
    (aten.scatter.value_reduce, (T, 0, T, 1.0), {"reduce": "multiply"}),
    (aten.scatter_reduce.two, (T, 0, T, T, "sum"), {}),
    # uninitialised memory: whatever filled it made the bytes
    (aten.empty.memory_format, ([4],), {}),
    (aten.empty_like.default, (T,), {}),
    (aten.empty_strided.default, ([4], [1]), {}),
    (aten.new_empty.default, (T, [4]), {}),
    # mutable: in place, out=, side buffers
    (aten.add_.Tensor, (T, T), {}),
    (aten.mm.out, (T, T), {"out": T}),
    (aten.copy_.default, (T, T), {}),
    (aten._native_batch_norm_legit.default, (T, T, T, T, T, True, 0.1, 1e-5), {}),
    # writes its running statistics while training, though its schema declares no write (trace/state_writes.py)
    (aten.native_batch_norm.default, (T, T, T, S, S, True, 0.1, 1e-5), {}),
    (aten.native_batch_norm.default, (T, T, T, S, S), {"training": True, "momentum": 0.1, "eps": 1e-5}),
    (aten.cudnn_batch_norm.default, (T, T, T, S, S, True, 0.1, 1e-5), {}),
    (aten.batch_norm_update_stats.default, (T, S, None, 0.1), {}),
]

ALLOWED = [
    (aten.mm.default, (T, T), {}),
    (aten.addmm.default, (T, T, T), {}),
    (aten._softmax.default, (T, -1, False), {}),
    (aten.gelu.default, (T,), {}),
    (aten.gelu.default, (T,), {"approximate": "tanh"}),
    (aten.native_layer_norm.default, (T, [8], T, T, 1e-5), {}),
    (aten.silu.default, (T,), {}),
    # attention without dropout touches no generator
    (aten._scaled_dot_product_flash_attention.default, (T, T, T), {}),
    (aten._scaled_dot_product_flash_attention.default, (T, T, T, 0.0, True), {}),
    (aten._scaled_dot_product_efficient_attention.default, (T, T, T, T, True), {"dropout_p": 0.0}),
    (aten._scaled_dot_product_cudnn_attention.default, (T, T, T, T, False, 0.0), {}),
    (aten._flash_attention_forward.default, (T, T, T, T, T, 8, 8, 0.0, True, False), {}),
    (aten._efficient_attention_forward.default, (T, T, T, T, T, T, 8, 8, 0.0, 1), {}),
    (aten._scaled_dot_product_flash_attention_for_cpu.default, (T, T, T), {"is_causal": True}),
    (aten._scaled_dot_product_attention_math.default, (T, T, T, T, 0.0, True), {}),
    # dropout that draws nothing: p=0 (the composite returns its input), or not training
    (aten.dropout.default, (T, 0.0, True), {}),
    (aten.dropout.default, (T, 0.5, False), {}),
    (aten.native_dropout.default, (T, 0.5, False), {}),
    # a ``p`` that is not a probability
    (aten.norm.Scalar, (T, 3), {}),
    (aten.norm.ScalarOpt_dim, (T, 1, [0]), {}),
    (aten.dist.default, (T, T, 1), {}),
    (aten._pdist_forward.default, (T, 0.5), {}),
    (aten.renorm.default, (T, 2, 0, 1.0), {}),
    # batch norm that writes no statistics: not training, or none given; the functional form returns them
    (aten.native_batch_norm.default, (T, T, T, S, S, False, 0.1, 1e-5), {}),
    (aten.native_batch_norm.default, (T, T, T, None, None, True, 0.1, 1e-5), {}),
    (aten._native_batch_norm_legit_functional.default, (T, T, T, S, S, True, 0.1, 1e-5), {}),
    (aten._native_batch_norm_legit_no_training.default, (T, T, T, S, S, 0.1, 1e-5), {}),
]


def _id(case) -> str:
    func, args, kwargs = case
    values = [a for a in args if a is not None and not isinstance(a, (list, torch.Tensor))] + [f"{k}={v}" for k, v in kwargs.items()]
    return f"{func}({', '.join(map(str, values))})"


@pytest.mark.parametrize("case", REFUSED, ids=_id)
def test_refused_on_the_real_schema(case):
    func, args, kwargs = case
    assert not replays_exactly(func, args, kwargs)
    assert not ReplayJudge()(func, args, kwargs)


@pytest.mark.parametrize("case", ALLOWED, ids=_id)
def test_allowed_on_the_real_schema(case):
    func, args, kwargs = case
    assert replays_exactly(func, args, kwargs)
    assert ReplayJudge()(func, args, kwargs)


def test_the_judges_cache_keeps_the_arguments_deciding():
    judge, flash = ReplayJudge(), aten._scaled_dot_product_flash_attention.default
    assert [judge(flash, (T, T, T, p)) for p in (0.0, 0.1, 0.0)] == [True, False, True]
    assert schema_verdict(flash) is Replay.BY_ARGUMENTS
    assert schema_verdict(aten.mm.default) is Replay.EXACT and schema_verdict(aten.bincount.default) is Replay.REFUSED


def test_ops_outside_aten_are_refused():
    """A custom op (a fused kernel's binding, a Triton kernel) and a collective: not known to replay."""
    lib = torch.library.Library("chameleon_exactness_test", "FRAGMENT")  # noqa: TOR901 (a test-only namespace)
    lib.define("scale(Tensor x) -> Tensor")
    lib.impl("scale", lambda x: x * 2, "CompositeExplicitAutograd")
    op = torch.ops.chameleon_exactness_test.scale.default
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    assert not replays_exactly(op, (T,))
    assert not name_replays_exactly("chameleon_exactness_test.scale.default")
    assert not replays_exactly(torch.ops._c10d_functional.all_reduce.default, (T, "sum", "0"))
    assert not replays_exactly(object())  # no schema at all


def test_names_resolve_to_the_ops_a_trace_records():
    assert op_named("aten.gelu.default") is aten.gelu.default
    assert op_named("aten.gelu") is None and op_named("aten.no_such_op.default") is None
    assert name_replays_exactly("aten.mm.default")
    # a verdict that depends on arguments nobody recorded: refused
    assert not name_replays_exactly("aten._scaled_dot_product_flash_attention.default")
    assert not name_replays_exactly("aten.mm.default.bwd")


# ---- the recorder keeps the forward ops it refuses, judged with their arguments ------------------------
def test_the_recorder_keeps_the_forward_ops_that_would_not_replay():
    recorder = TraceRecorder(OpVocabulary(), live_bytes=lambda: 0, parameter_storage_keys=set(), iteration=0,
                             emulated=True)
    x = torch.randn(8, 8, requires_grad=True)
    with recorder:
        y = torch.mm(x, x)  # 0
        aten.native_dropout.default(y, 0.5, False)  # 1: not training, draws nothing
        aten.native_dropout.default(y, 0.5, True)  # 2: draws
        torch.bincount(torch.tensor([1, 2, 2]))  # 3: atomics on a GPU
        q = y.reshape(1, 1, 8, 8)  # (a view: one op)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)  # no dropout: exact
    trace = recorder.finish()
    names = [trace.op_names[op.name_id] for op in trace.ops]
    refused = {names[i] for i in trace.inexact_ops}
    assert trace.inexact_ops and names[trace.inexact_ops[0]] == "aten.native_dropout.default"
    assert [i for i, n in enumerate(names) if n == "aten.native_dropout.default"] == [1, 2]
    assert 2 in trace.inexact_ops and 1 not in trace.inexact_ops
    assert "aten.bincount.default" in refused and "aten.mm.default" not in refused
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in names
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in refused
    again = type(trace).from_dict(trace.to_dict())
    assert again.inexact_ops == trace.inexact_ops


def test_the_recorder_refuses_batch_norm_only_while_it_updates_its_statistics():
    recorder = TraceRecorder(OpVocabulary(), live_bytes=lambda: 0, parameter_storage_keys=set(), iteration=0,
                             emulated=True)
    bn, x = torch.nn.BatchNorm1d(8), torch.randn(4, 8)
    with recorder:
        bn.eval()(x)  # reads the statistics
        bn.train()(x)  # updates them in place
    trace = recorder.finish()
    names = [trace.op_names[op.name_id] for op in trace.ops]
    at = [i for i, n in enumerate(names) if n == "aten.native_batch_norm.default"]
    assert len(at) == 2 and at[0] not in trace.inexact_ops and at[1] in trace.inexact_ops
    assert not name_replays_exactly("aten.native_batch_norm.default")  # arguments not recorded: refused


# ---- the policy refuses to recompute what a refused op produced ----------------------------------------
def _first_activation_exact(producer: str, inexact_ops: list[int] | None) -> bool:
    """A two-op layer whose first activation (op 0, no inputs but a parameter) ``producer`` made."""
    trace = layered_trace([[1 << 16, 1 << 16]], producer_names=[[0, 1]])
    trace.op_names = [producer, *OP_NAMES[1:]]
    trace.inexact_ops = inexact_ops
    (candidate,) = [c for c in find_candidates(trace) if c.created_at == 0]
    return candidate.recompute_exact


def test_the_policy_reads_the_recorded_judgement():
    flash = "aten._scaled_dot_product_flash_attention.default"
    assert _first_activation_exact(flash, [])  # recorded with dropout_p=0
    assert not _first_activation_exact(flash, [0])  # recorded with dropout_p>0
    assert not _first_activation_exact(flash, None)  # not recorded: the arguments decide, so refused
    assert _first_activation_exact("aten.mm.default", None)
    for refused in ("aten.bincount.default", "aten.empty.memory_format", "chameleon_custom.fused.default"):
        assert not _first_activation_exact(refused, []), refused
