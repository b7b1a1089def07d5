"""``chameleon_dist.integrations.deepspeed.initialize`` on one rank (gloo): the drop-in for
``deepspeed.initialize``, the ``"chameleon"`` block checked before DeepSpeed builds anything, one iteration
per gradient-accumulation window, and losses and parameters bit-identical with and without swapping."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

deepspeed = pytest.importorskip("deepspeed")
from tests.deepspeed_session import TokenEmbedding, one_rank_deepspeed, token_cross_entropy  # noqa: E402
import torch.distributed as dist  # noqa: E402

from chameleon_dist.config import ConfigError  # noqa: E402
from chameleon_dist.integrations.deepspeed.engine import initialize  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")

VOCAB, HIDDEN, SEQ, BATCH = 64, 64, 32, 4


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                                  nn.Linear(4 * HIDDEN, HIDDEN)) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), labels.reshape(-1))


def _config(stage: int, accumulation: int = 1, chameleon: dict | None = None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        # DeepSpeed's default buckets (5e8 elements) would be 2 GB of device memory; the emulated device counts them
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000, "allgather_bucket_size": 50_000},
        "steps_per_print": 10**9,
    }
    if chameleon is not None:
        config["chameleon"] = chameleon
    return config


CHAMELEON = {"device": {"kind": "emulated", "capacity": "1GB"}, "min_swap_bytes": "4KiB"}


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield from one_rank_deepspeed()


def _train(config: dict, steps: int = 4, accumulation: int = 1):
    torch.manual_seed(0)
    engine, *_ = initialize(model=TinyGPT(), model_parameters=None, config=config)
    losses, reports = [], []
    for step in range(steps * accumulation):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
        if engine.chameleon is not None and engine.chameleon.last_report is not None:
            reports.append(engine.chameleon.last_report)
    full = deepspeed.utils.safe_get_full_fp32_param if config["zero_optimization"]["stage"] == 3 else (lambda p: p)
    params = [full(p).detach().clone() for p in engine.module.parameters()]
    assert all(p.numel() > 0 for p in params)
    return engine, losses, params, reports


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_swap_is_bit_identical_under_zero(stage):
    off_engine, off_losses, off_params, _ = _train(_config(stage))
    on_engine, on_losses, on_params, reports = _train(_config(stage, chameleon=CHAMELEON))
    assert off_engine.chameleon is None
    assert on_engine.chameleon.last_report.iteration == 4 and reports[0].swap_out_bytes > 0  # WarmUp swapped
    assert all(torch.equal(a, b) for a, b in zip(off_losses, on_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(off_params, on_params, strict=True))
    on_engine.chameleon.close()


def test_one_iteration_per_accumulation_window():
    engine, losses, _, _ = _train(_config(1, accumulation=4, chameleon=CHAMELEON), steps=3, accumulation=4)
    report = engine.chameleon.last_report
    assert report.iteration == 3 and len(losses) == 12
    trace = engine.chameleon.last_trace  # WarmUp: the four micro-batches of window 2, named 0..3
    assert [mb for phase, mb in trace.phase_runs()] == [0, 0, 1, 1, 2, 2, 3, 3]
    engine.chameleon.close()


def test_a_bad_block_fails_before_deepspeed_builds_anything():
    bad = _config(1, chameleon={"memory_budget": "lots", "unknown_key": 1, "device": {"kind": "emulated"}})
    before = copy.deepcopy(bad)
    with pytest.raises(ConfigError) as error:
        initialize(model=TinyGPT(), config=bad)
    message = str(error.value)
    assert "chameleon.memory_budget" in message and "chameleon.unknown_key" in message
    assert bad == before  # the dict DeepSpeed would hold is never changed


def _pipeline_losses(chameleon: dict | None, batches: int = 4, micro_batches: int = 4):
    from deepspeed.pipe import LayerSpec, PipelineModule

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

        def forward(self, x):
            return x + self.mlp(x)

    torch.manual_seed(0)
    model = PipelineModule([LayerSpec(TokenEmbedding, VOCAB, HIDDEN), LayerSpec(Block), LayerSpec(Block),
                            LayerSpec(nn.Linear, HIDDEN, VOCAB)],
                           num_stages=1, loss_fn=token_cross_entropy, partition_method="uniform")
    config = _config(1, accumulation=micro_batches, chameleon=chameleon)
    engine, *_ = initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
    losses, reports = [], []
    for batch in range(batches):
        data = []
        for m in range(micro_batches):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(batch * 100 + m))
            data.append((tokens[:, :-1], tokens[:, 1:]))
        losses.append(engine.train_batch(iter(data)).detach().clone())
        if engine.chameleon is not None:
            reports.append(engine.chameleon.last_report)
    evaluated = engine.eval_batch(iter(data))
    return engine, losses, [p.detach().clone() for p in engine.module.parameters()], reports, evaluated


def test_pipeline_engine_train_batch_is_one_iteration_and_bit_identical():
    off_engine, off_losses, off_params, _, off_eval = _pipeline_losses(None)
    on_engine, on_losses, on_params, reports, on_eval = _pipeline_losses(CHAMELEON)
    assert [r.iteration for r in reports] == [1, 2, 3, 4] and reports[0].swap_out_bytes > 0
    assert all(torch.equal(a, b) for a, b in zip(off_losses, on_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(off_params, on_params, strict=True))
    assert torch.equal(off_eval, on_eval) and on_engine.chameleon.last_report.iteration == 4  # eval: no iteration
    runs = [mb for phase, mb in on_engine.chameleon.last_trace.phase_runs()]
    assert runs == [0, 0, 1, 1, 2, 2, 3, 3], runs  # the k-th forward and backward: micro-batch k
    on_engine.chameleon.close()


@pytest.mark.parametrize("block, keys", [
    ({"min_swap_bytes": "12 parsecs"}, ["chameleon.min_swap_bytes"]),  # a bad size
    ({"enabled": "sometimes", "profiler": 3}, ["chameleon.enabled", "chameleon.profiler"]),  # wrong types
    ({"memory_budget": "2GB", "device": {"kind": "emulated", "capacity": "1GB"}}, ["chameleon.memory_budget"]),
    ([1, 2], ["chameleon"]),  # not a mapping
], ids=["bad-size", "wrong-types", "budget-above-capacity", "not-a-mapping"])
def test_every_bad_block_names_its_keys_before_training(block, keys, monkeypatch):
    built = []
    monkeypatch.setattr(deepspeed, "initialize", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError) as error:
        initialize(model=TinyGPT(), config=_config(2, chameleon=block))
    assert all(key in str(error.value) for key in keys), str(error.value)
    assert not built, "DeepSpeed must not build an engine for a config whose block is wrong"


class RoutedRegressor(nn.Module):
    """Not a GPT: a feature regressor whose every layer routes each row to one of four expert MLPs by a
    learned gate (top-1, data dependent: the rows per expert, hence the saved shapes and the op sequence,
    change from micro-batch to micro-batch)."""

    def __init__(self, features: int = 48, experts: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.gates = nn.ModuleList(nn.Linear(features, experts) for _ in range(layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Sequential(nn.Linear(features, 4 * features), nn.Tanh(), nn.Linear(4 * features, features))
                          for _ in range(experts)) for _ in range(layers))
        self.out = nn.Linear(features, 1)

    def forward(self, x, target):
        for gate, experts in zip(self.gates, self.experts):
            weight, choice = gate(x).softmax(-1).max(-1)
            mixed = torch.zeros_like(x)
            for index, expert in enumerate(experts):
                rows = (choice == index).nonzero(as_tuple=True)[0]
                if rows.numel():  # an idle expert does not run: its ops are missing from the iteration
                    mixed = mixed.index_add(0, rows, expert(x[rows]) * weight[rows, None])
            x = x + mixed
        return F.mse_loss(self.out(x).squeeze(-1), target)


def _train_routed(chameleon: dict | None, windows: int = 5, accumulation: int = 2):
    torch.manual_seed(0)
    config = _config(2, accumulation=accumulation, chameleon=chameleon)
    config["train_micro_batch_size_per_gpu"] = 64
    engine, *_ = initialize(model=RoutedRegressor(), config=config)
    losses, reports, counts = [], [], set()
    for step in range(windows * accumulation):
        generator = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(64, 48, generator=generator) * (1 + step % 3)  # the routing shifts with the scale
        loss = engine(x, x.sum(-1))
        counts.add(tuple(int((engine.module.gates[0](x).argmax(-1) == e).sum()) for e in range(4)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
        if engine.chameleon is not None and (step + 1) % accumulation == 0:
            reports.append(engine.chameleon.last_report)
    return engine, losses, [p.detach().clone() for p in engine.module.parameters()], reports, counts


def test_a_routed_model_that_is_not_a_gpt_trains_bit_identically_through_the_drop_in():
    _, off_losses, off_params, _, counts = _train_routed(None)
    engine, on_losses, on_params, reports, _ = _train_routed({**CHAMELEON, "min_swap_bytes": "8KiB"})
    assert len(counts) > 1, "the routing must change between micro-batches"
    assert all(torch.equal(a, b) for a, b in zip(off_losses, on_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(off_params, on_params, strict=True))
    assert [r.iteration for r in reports] == [1, 2, 3, 4, 5] and not any(r.failed for r in reports)
    assert sum(r.swap_out_bytes for r in reports) > 0
    engine.chameleon.close()


class CheckpointedBlocks(nn.Module):
    """Three residual MLP blocks, each through DeepSpeed's own activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                                  nn.Linear(4 * HIDDEN, HIDDEN)) for _ in range(3))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, labels):
        for block in self.blocks:
            x = x + deepspeed.checkpointing.checkpoint(block, x)
        return F.cross_entropy(self.head(x), labels)


def _train_checkpointed(chameleon: dict | None):
    torch.manual_seed(0)
    config = {**_config(1, chameleon=chameleon), "train_micro_batch_size_per_gpu": 32}
    engine, *_ = initialize(model=CheckpointedBlocks(), config=config)
    deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    losses, swapped = [], 0
    for step in range(4):
        generator = torch.Generator().manual_seed(step)
        x, labels = torch.randn(32, HIDDEN, generator=generator), torch.randint(0, VOCAB, (32,), generator=generator)
        loss = engine(x, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
        swapped += engine.chameleon.last_report.swap_out_bytes if engine.chameleon is not None else 0
    if engine.chameleon is not None:
        engine.chameleon.close()
    return losses, [p.detach().clone() for p in engine.module.parameters()], swapped


def test_deepspeed_activation_checkpointing_beside_chameleon_is_bit_identical():
    """DeepSpeed's checkpointing keeps each block's input and recomputes the block in backward: Chameleon
    swaps the kept inputs and never what the recomputation saves inside backward."""
    off_losses, off_params, _ = _train_checkpointed(None)
    on_losses, on_params, swapped = _train_checkpointed({**CHAMELEON, "min_swap_bytes": "1KiB"})
    assert swapped > 0
    assert all(torch.equal(a, b) for a, b in zip(off_losses, on_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(off_params, on_params, strict=True))


class WeightViews(nn.Module):
    """Saves a view of its weight for backward (``(x * scale) @ weight.t()``): under ZeRO-3 a view of the full
    copy ZeRO-3 gathered for the forward, not the parameter object. ``protected`` records whether the swap
    path would refuse that copy, seen from inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(256))
        self.weight = nn.Parameter(torch.randn(256, 256) / 16)
        self.head = nn.Linear(256, VOCAB)
        self.executor = None
        self.protected: list[bool] = []

    def forward(self, x, labels):
        if self.executor is not None:
            self.protected.append(self.weight.numel() > 0 and self.executor.is_protected(self.weight.data))
        return F.cross_entropy(self.head(torch.tanh((x * self.scale) @ self.weight.t())), labels)


def test_zero3_gathered_parameters_are_protected_while_gathered():
    # (The emulated device never swaps them anyway: ZeRO-3 gathers into buffers it allocated before any
    # iteration, which the device does not count. On a GPU they are device memory like any other.)
    torch.manual_seed(0)
    model = WeightViews()
    config = _config(3, chameleon={**CHAMELEON, "min_swap_bytes": "8KiB"})
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter is gathered per forward
    engine, *_ = initialize(model=model, config=config)
    model.executor = engine.chameleon.executor
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        x, labels = torch.randn(BATCH, 256, generator=generator), torch.randint(0, VOCAB, (BATCH,), generator=generator)
        engine.backward(engine(x, labels))
        engine.step()
        assert model.weight.data.numel() == 0, "ZeRO-3 released the gathered copy after the forward"
    assert model.protected == [True, True], "the gathered weight must be protected while its module runs"
    engine.chameleon.close()


def test_a_disabled_block_installs_nothing_and_trains_as_deepspeed_does():
    off_engine, off_losses, off_params, _ = _train(_config(2), steps=2)
    engine, losses, params, _ = _train(_config(2, chameleon={**CHAMELEON, "enabled": False}), steps=2)
    assert engine.chameleon is None
    assert "forward" not in vars(engine) and "step" not in vars(engine) and "backward" not in vars(engine)
    assert all(torch.equal(a, b) for a, b in zip(off_losses, losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(off_params, params, strict=True))
