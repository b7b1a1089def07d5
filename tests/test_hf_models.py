"""Hugging Face transformers models under Chameleon (issue 12, item 7): tiny random-init Llama, Mixtral and
GPT-2 built from configs (nothing is downloaded), trained on the emulated device.

1. On a device between the swap floor and the unswapped peak, 9 iterations (WarmUp, GenPolicy, Stable)
   of SGD give every loss and every gradient ``torch.equal`` to the same loop without Chameleon.
2. ``use_cache``: a training forward returns the model's KV cache (``past_key_values``) by default. While
   the output object is alive, the cache holds every layer's keys and values, so swapping them frees
   nothing: with every eligible tensor swapped, the peak is higher by exactly the cache's bytes.
3. The README's Hugging Face example runs, swaps and stays within its device.

Skipped when transformers is not installed (``pip install -e .[hf]``)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from tests.scenario_models import one_thread

transformers = pytest.importorskip("transformers")

KINDS = ["llama", "mixtral", "gpt2"]
ITERATIONS = 9  # WarmUp 2 + GenPolicy 5 + Stable 2 (held past its first iteration) with the default profiler settings
VOCAB, HIDDEN, LAYERS, HEADS, FFN = 128, 64, 2, 4, 128
BATCH, SEQ = 4, 32
UNBOUNDED = 10**12
SWAP_ALL = {"profiler": {"warmup_iterations": 0}, "min_swap_bytes": 0}  # no trace, no policy: swap everything
CAPACITY_POSITION = 0.6  # the capacity lies this far from the swap floor towards the unswapped peak
BUDGET_FRACTION = 0.95  # memory_budget, of the capacity


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def build(kind: str) -> torch.nn.Module:
    """The same random weights on every call. Every model uses multi-head attention (as many key/value
    heads as heads), so the KV cache holds exactly the key and value tensors saved for backward."""
    torch.manual_seed(0)
    if kind == "gpt2":  # (dropout 0.1 in embeddings, attention and residuals: the seed below fixes the masks)
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                                         n_positions=SEQ, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config).train()
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                  attn_implementation="eager")
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).train()
    config = transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config).train()


def batches(n: int = ITERATIONS) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + i)) for i in range(n)]


@dataclasses.dataclass
class Run:
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor | None]]
    params: dict[str, torch.Tensor]
    reports: list  # IterationReport per iteration (empty without Chameleon)


def train(kind: str, chameleon: Chameleon | None = None, iterations: int = ITERATIONS, use_cache: bool = False,
          keep_output: bool = True) -> Run:
    """The README's loop. ``keep_output``: the closure holds the output object until after backward
    (``out = model(...); out.loss.backward()``); otherwise it keeps only the loss."""
    model = build(kind)
    if chameleon is not None:
        model = chameleon.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run([], [], {}, [])
    torch.manual_seed(1)  # the dropout masks
    for batch in batches(iterations):
        optimizer.zero_grad(set_to_none=True)

        def forward_backward():
            if keep_output:
                out = model(input_ids=batch, labels=batch, use_cache=use_cache)
                out.loss.backward()
                return out.loss.detach()
            loss = model(input_ids=batch, labels=batch, use_cache=use_cache).loss  # the output object is gone
            loss.backward()
            return loss.detach()

        if chameleon is None:
            loss = forward_backward()
            optimizer.step()
        else:
            loss = chameleon.run_iteration(forward_backward, optimizer=optimizer)
            run.reports.append(chameleon.last_report)
        run.losses.append(loss)
        run.grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def peak(kind: str, config: dict, iterations: int = 2, **loop) -> int:
    """The largest peak over ``iterations`` on an unbounded emulated device."""
    reports = train(kind, Chameleon(config, device=EmulatedDevice(UNBOUNDED)), iterations, **loop).reports
    assert not any(r.failed for r in reports)
    return max(r.peak_device_bytes for r in reports)


def cache_bytes() -> int:
    """Keys and values of every layer, float32, for one batch (multi-head attention: HEADS * head_dim = HIDDEN)."""
    return 2 * LAYERS * BATCH * SEQ * HIDDEN * 4


@pytest.mark.parametrize("kind", KINDS)
def test_training_under_swap_is_bit_identical(kind):
    unswapped = peak(kind, {"enabled": False})
    floor = peak(kind, SWAP_ALL)
    assert floor < unswapped
    capacity = int(floor + CAPACITY_POSITION * (unswapped - floor))
    config = {"min_swap_bytes": 1024, "memory_budget": BUDGET_FRACTION}
    chameleon = Chameleon(config, device=EmulatedDevice(capacity, host_op_s=1e-6))  # (trials rank alike)
    swapped, plain = train(kind, chameleon), train(kind)

    reports = swapped.reports
    assert not any(r.failed for r in reports)
    assert max(r.peak_device_bytes for r in reports) <= capacity < unswapped
    assert [r.stage for r in reports][:8] == ["warmup"] * 2 + ["gen_policy"] * 5 + ["stable"]
    assert all(r.swap_out_bytes > 0 for r in reports), [r.swap_out_bytes for r in reports]  # the capacity needs it
    for i, (a, b) in enumerate(zip(swapped.losses, plain.losses)):
        assert torch.equal(a, b), f"iteration {i + 1}: loss {a.item()} != {b.item()}"
    for i, (got, want) in enumerate(zip(swapped.grads, plain.grads)):
        assert got.keys() == want.keys()
        for name in want:
            g, w = got[name], want[name]
            assert (g is None) == (w is None) and (w is None or torch.equal(g, w)), f"iteration {i + 1}: grad of {name}"
    for name, value in plain.params.items():
        assert torch.equal(swapped.params[name], value), name


@pytest.mark.parametrize("kind", KINDS)
def test_a_kept_output_holds_the_kv_cache_and_raises_the_swap_floor(kind):
    """With every eligible tensor swapped, a training forward with ``use_cache=True`` (the default) peaks
    higher by exactly the cache's keys and values as long as the output object lives through backward; with
    ``use_cache=False``, or when only the loss is kept, it does not. (A kept output also keeps the logits,
    which backward does not need.) Without swapping the cache costs nothing here: these keys and values are
    saved for backward anyway."""
    floors = {(cache, kept): peak(kind, SWAP_ALL, use_cache=cache, keep_output=kept)
              for cache in (True, False) for kept in (True, False)}
    assert floors[True, True] - floors[False, True] == cache_bytes(), floors
    assert floors[True, False] == floors[False, False], floors
    assert floors[False, True] - floors[False, False] == BATCH * SEQ * VOCAB * 4, floors  # the logits
    assert peak(kind, {"enabled": False}, use_cache=True) == peak(kind, {"enabled": False}, use_cache=False)


def test_the_default_training_forward_returns_a_cache():
    """What the test above relies on: transformers returns ``past_key_values`` in training mode unless
    ``use_cache=False``."""
    model, batch = build("llama"), batches(1)[0]
    assert model(input_ids=batch, labels=batch).past_key_values is not None
    assert model(input_ids=batch, labels=batch, use_cache=False).past_key_values is None


def test_readme_example_runs_and_swaps(capsys):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Training a Hugging Face transformers model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    torch.manual_seed(0)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_hf_example"})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    swapped = [float(re.search(r"swapped out ([\d.]+) MiB", line).group(1)) for line in lines]
    peaks = [float(re.search(r"peak ([\d.]+) MiB", line).group(1)) for line in lines]
    assert all(s > 0 for s in swapped) and max(peaks) <= 1.75, lines
