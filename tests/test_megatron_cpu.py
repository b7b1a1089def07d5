"""Megatron-core GPTModel on CPU through the patch mechanism (single process, gloo, world size 1)."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chameleon_dist.integrations.megatron import CPU_PATCHES, CudaLiteralsToCpu
from chameleon_dist.models import TransformerShape
from chameleon_dist.patching import upstream_original

gpt = pytest.importorskip("chameleon_dist.integrations.megatron.gpt")
from megatron.core import parallel_state  # noqa: E402  (only after the skip above)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
TINY = TransformerShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32, micro_batch_size=4
)


def _train(shape, steps: int, seed: int = SEED, lr: float = 3e-3, **config_overrides):
    """Run ``steps`` Adam steps in a fresh session; return the loss tensors and the last step's gradients."""
    with gpt.megatron_cpu_session(seed=seed):
        model = gpt.build_gpt(shape, seed=seed, **config_overrides)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = gpt.gpt_loss(model, gpt.synthetic_batch(shape, step=step, seed=seed))
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().clone())
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return losses, grads


def _assert_nothing_left_behind():
    assert not parallel_state.model_parallel_is_initialized()
    assert not dist.is_initialized()
    for patch in CPU_PATCHES:
        module_name, _, attrs = patch.target.partition(":")
        value = functools.reduce(getattr, attrs.split("."), sys.modules[module_name])
        assert upstream_original(value) is value, f"{patch.name} still applied"


def test_tiny_gpt_trains_and_loss_falls():
    losses, grads = _train(TINY, steps=20, lr=1e-2)
    first, last = torch.stack(losses[:4]).mean().item(), torch.stack(losses[-4:]).mean().item()
    assert last < first - 0.3, [round(x.item(), 3) for x in losses]
    assert all(torch.isfinite(g).all() for g in grads.values())
    _assert_nothing_left_behind()


def test_same_seed_gives_bit_identical_losses_and_gradients():
    losses_a, grads_a = _train(TINY, steps=3)
    losses_b, grads_b = _train(TINY, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b, strict=True))
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_full_recompute_is_bit_identical_to_no_recompute():
    """Exercises the RNG get/set shims: recompute saves and replays the (CPU) RNG state."""
    plain_losses, plain_grads = _train(TINY, steps=2)
    recompute_losses, recompute_grads = _train(
        TINY, steps=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, recompute_losses, strict=True))
    assert all(torch.equal(plain_grads[n], recompute_grads[n]) for n in plain_grads)


def test_build_twice_with_same_seed_gives_identical_parameters():
    with gpt.megatron_cpu_session(seed=SEED):
        first = gpt.build_gpt(TINY, seed=7)
        torch.rand(5)  # the caller's RNG use must not matter
        second = gpt.build_gpt(TINY, seed=7)
        other = gpt.build_gpt(TINY, seed=8)
    pairs = list(zip(first.named_parameters(), second.named_parameters(), strict=True))
    assert pairs and all(na == nb and torch.equal(a, b) for (na, a), (nb, b) in pairs)
    assert not all(torch.equal(a, b) for a, b in zip(first.parameters(), other.parameters()))


def test_session_can_be_entered_twice_and_cleans_up():
    for _ in range(2):
        with gpt.megatron_cpu_session(seed=SEED) as session:
            assert session.world_size == 1 and session.created_process_group and session.patches.active
            assert parallel_state.model_parallel_is_initialized()
        _assert_nothing_left_behind()


def test_session_cleans_up_after_an_error_and_refuses_nesting():
    with pytest.raises(ValueError, match="boom"):
        with gpt.megatron_cpu_session(seed=SEED):
            with pytest.raises(RuntimeError, match="exit the other megatron_cpu_session"):
                with gpt.megatron_cpu_session(seed=SEED):
                    pass
            raise ValueError("boom")
    _assert_nothing_left_behind()


def test_default_causal_mask_shim_matches_an_explicit_mask():
    batch = gpt.synthetic_batch(TINY, step=0, seed=SEED)
    with gpt.megatron_cpu_session(seed=SEED):
        model = gpt.build_gpt(TINY, seed=SEED)
        with torch.no_grad():
            explicit = gpt.gpt_loss(model, batch)
            implicit = gpt.gpt_loss(model, {**batch, "attention_mask": None})
    assert torch.equal(explicit, implicit)


def test_shape_and_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="num_attention_heads"):
        TransformerShape(num_layers=1, hidden_size=30, num_attention_heads=4, vocab_size=8, seq_length=4,
                         micro_batch_size=1)
    assert TINY.ffn_hidden_size == 4 * TINY.hidden_size
    with pytest.raises(RuntimeError, match="megatron_cpu_session"):
        gpt.build_gpt(TINY)
    with gpt.megatron_cpu_session(seed=SEED):
        with pytest.raises(ValueError, match="hidden_dropout=0.0"):
            gpt.build_gpt(TINY, hidden_dropout=0.1)


def test_synthetic_batch_is_deterministic_and_learnable():
    a, b = gpt.synthetic_batch(TINY, 3, SEED), gpt.synthetic_batch(TINY, 3, SEED)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tokens"], gpt.synthetic_batch(TINY, 4, SEED)["tokens"])
    assert torch.equal(a["tokens"][:, 1:], a["labels"][:, :-1])
    assert a["tokens"].shape == (TINY.micro_batch_size, TINY.seq_length)


def test_cuda_literals_mode_turns_cuda_into_cpu():
    with CudaLiteralsToCpu():
        made = torch.zeros(2, device="cuda")
        moved = made.to("cuda", torch.float64)
        pinned = torch.tensor([1, 2], device="cuda", pin_memory=True)
        assert made.cuda() is made
    assert made.device.type == moved.device.type == pinned.device.type == "cpu"
    assert moved.dtype == torch.float64
    assert made.type() == "torch.FloatTensor"  # type names only on request


def test_cuda_type_names_answer_what_megatrons_optimizers_compare():
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with CudaLiteralsToCpu(cuda_type_names=True):
        assert (half.type(), torch.zeros(1).type(), torch.zeros(1, dtype=torch.float16).type()) == (
            "torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor", "torch.cuda.HalfTensor")
        with CudaLiteralsToCpu(cuda_type_names=True):  # nested (a patched __init__ calling another)
            assert half.type() == "torch.cuda.BFloat16Tensor"
        assert half.type(torch.float32).dtype == torch.float32  # a conversion is not a name
    assert half.type() == "torch.BFloat16Tensor"


@pytest.mark.slow  # (out of the quick tier: a fresh interpreter, 8 s loaded)
def test_import_chameleon_dist_imports_no_framework():
    code = (
        "import sys\n"
        "import chameleon_dist, chameleon_dist.integrations, chameleon_dist.integrations.megatron\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
