"""Megatron-core mixture of experts on CPU: the router shim, ``build_gpt(num_experts=...)`` and the launcher's
MoE flags (single process; the multi-rank MoE job is in tests/test_megatron_ranks.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chameleon_dist.integrations.megatron.cuda_on_cpu import MEGATRON_ROUTER_GATING_LINEAR_ON_CPU
from chameleon_dist.models import TransformerShape
from chameleon_dist.patching import apply_patches

gpt = pytest.importorskip("chameleon_dist.integrations.megatron.gpt")
from megatron.core.transformer.moe import moe_utils, router  # noqa: E402  (only after the skip above)
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
TINY = TransformerShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32, micro_batch_size=2
)


def _router_inputs(bias: bool, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(7)
    inp = torch.randn(5, 3, 16, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(4, 16, generator=gen, dtype=dtype, requires_grad=True)
    b = torch.randn(4, generator=gen, dtype=dtype, requires_grad=True) if bias else None
    return inp, weight, b


@pytest.mark.parametrize("bias", [False, True])
def test_router_gating_shim_matches_a_plain_linear_layer(bias):
    inp, weight, b = _router_inputs(bias)
    with apply_patches([MEGATRON_ROUTER_GATING_LINEAR_ON_CPU]):
        logits = router.router_gating_linear(inp, weight, b, torch.float32)
        grads = torch.autograd.grad(logits.square().sum(), [t for t in (inp, weight, b) if t is not None])
    reference = F.linear(inp, weight, b)
    expected = torch.autograd.grad(reference.square().sum(), [t for t in (inp, weight, b) if t is not None])
    assert logits.shape == (5, 3, 4) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert router.router_gating_linear is moe_utils.router_gating_linear  # restored on exit


def test_router_gating_shim_computes_in_the_router_dtype():
    inp, weight, _ = _router_inputs(bias=False)
    with apply_patches([MEGATRON_ROUTER_GATING_LINEAR_ON_CPU]):
        logits = router.router_gating_linear(inp, weight, None, torch.float64)
        logits.sum().backward()
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, F.linear(inp.double(), weight.double()))
    assert inp.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine installed")
def test_without_the_shim_megatrons_router_gating_fails_on_cpu():
    """Why the shim exists; when this fails, upstream works without Transformer Engine: drop the patch."""
    inp, weight, _ = _router_inputs(bias=False)
    with pytest.raises(NameError, match="te_general_gemm"):
        router.router_gating_linear(inp, weight, None, torch.float32)


def _train_moe(steps: int, **overrides):
    with gpt.megatron_cpu_session(seed=SEED):
        model = gpt.build_gpt(TINY, seed=SEED, num_experts=4, **overrides)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = gpt.gpt_loss(model, gpt.synthetic_batch(TINY, step=step, seed=SEED))
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().clone())
    return model, losses


def test_build_gpt_with_experts_trains_deterministically():
    model, losses = _train_moe(3)
    layers = model.decoder.layers
    assert all(isinstance(layer.mlp, MoELayer) for layer in layers)
    assert len(layers[0].mlp.experts.local_experts) == 4
    config = model.config
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_token_dispatcher_type) == (4, 2, "allgather")
    assert config.add_bias_linear is False and config.moe_grouped_gemm is False
    assert all(torch.isfinite(loss) for loss in losses)
    assert all(p.grad is not None for n, p in model.named_parameters() if "router" in n)
    _, again = _train_moe(3)
    assert all(torch.equal(a, b) for a, b in zip(losses, again, strict=True))


def test_moe_overrides_win_and_dense_stays_dense():
    with gpt.megatron_cpu_session(seed=SEED):
        moe = gpt.build_gpt(TINY, seed=SEED, num_experts=4, moe_router_topk=3)
        dense = gpt.build_gpt(TINY, seed=SEED)
    assert moe.config.moe_router_topk == 3
    assert dense.config.num_moe_experts is None and dense.config.add_bias_linear is True
    assert not any(isinstance(layer.mlp, MoELayer) for layer in dense.decoder.layers)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"num_moe_experts": 4}, "num_experts="),
        ({"num_experts": 0}, "num_experts=0"),
        ({"num_experts": 4, "moe_grouped_gemm": True}, "moe_grouped_gemm=False"),
    ],
)
def test_moe_misuse_names_the_setting(kwargs, names):
    with gpt.megatron_cpu_session(seed=SEED):
        with pytest.raises(ValueError, match=names):
            gpt.build_gpt(TINY, seed=SEED, **kwargs)


@pytest.fixture(scope="module")
def launcher():
    from launch import train_megatron

    return train_megatron


def test_launcher_moe_flags(launcher, capsys):
    assert launcher.parse_args([]).num_experts == 0
    args = launcher.parse_args(["--num-experts", "4", "--moe-router-topk", "1"])
    assert (args.num_experts, args.moe_router_topk) == (4, 1)
    for bad in (["--num-experts", "2", "--moe-router-topk", "3"], ["--num-experts", "-1"]):
        with pytest.raises(SystemExit):
            launcher.parse_args(bad)
        assert "--moe-router-topk" in capsys.readouterr().err


def test_launcher_builds_moe_chunks_and_top1_routes_after_softmax(launcher):
    """Megatron rejects top-1 routing unless the softmax comes first; the launcher sets that for --moe-router-topk 1."""
    args = launcher.parse_args(["--num-experts", "4", "--moe-router-topk", "1", "--num-layers", "2", "--seq-length", "32"])
    with gpt.megatron_cpu_session(seed=SEED):
        (chunk,) = launcher.build_chunks(args, launcher.shape_for(args, args.seq_length), on_cpu=True)
    config = chunk.config
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_router_pre_softmax) == (4, 1, True)
    assert all(isinstance(layer.mlp, MoELayer) for layer in chunk.module.decoder.layers)
