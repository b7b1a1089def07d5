"""Megatron-core GPT models on meta tensors (``integrations/megatron/meta_models.py``): tiny dense and MoE models
run Megatron's own schedule forward and backward on meta (with Megatron's recompute settings), the MoE routing is
real top-k routing over random logits that changes every iteration and replays under recomputation, and the
shipped profiles build at their real shapes (Llama2-7B whole, stages of Llama2-70B and Mixtral-8x7B)."""

from __future__ import annotations

import pytest
import torch

from chameleon_dist.models import TransformerShape
from chameleon_dist.patching import apply_patches
from chameleon_dist.planner.profiles import ModelProfile, load_model

meta_models = pytest.importorskip("chameleon_dist.integrations.megatron.meta_models")
from chameleon_dist.integrations.megatron import gpt  # noqa: E402  (only after the skip above)
from chameleon_dist.integrations.megatron.cuda_on_cpu import shimmed_current_device  # noqa: E402
from chameleon_dist.integrations.megatron.meta_routing import MetaRouting, meta_routing_patches  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")

SEQ = 32
TINY = ModelProfile(name="tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=128, vocab_size=128, seq_length=SEQ)
TINY_MOE = TINY.model_copy(update={"name": "tiny-moe", "num_experts": 4, "moe_router_topk": 2})


@pytest.fixture
def session():
    with meta_models.megatron_meta_session():
        yield


def _grads_are_meta_with_parameter_shapes(model) -> bool:
    return all(p.grad is not None and p.grad.is_meta and p.grad.shape == p.shape and p.grad.dtype == p.dtype
               for p in model.parameters())


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
@pytest.mark.parametrize("profile", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_schedule_step_runs_forward_and_backward_on_meta(session, profile, recompute):
    model = meta_models.build_meta_gpt(profile, seq_length=SEQ, recompute=recompute)
    parameters = list(model.parameters())
    assert parameters and all(p.is_meta and p.dtype == torch.bfloat16 for p in parameters)
    assert meta_models.parameter_count(model) == profile.parameter_count(SEQ)  # the planner's formula
    assert model.config.recompute_granularity == recompute
    reports = meta_models.meta_schedule_step(model, micro_batches=2)
    assert len(reports) == 2 and all(r["lm loss"].is_meta and r["lm loss"].shape == () for r in reports)
    assert _grads_are_meta_with_parameter_shapes(model)


@pytest.mark.parametrize("pre_process, post_process", [(False, True), (True, False), (False, False)])
def test_a_pipeline_stage_runs_on_meta(session, pre_process, post_process):
    """A stage without the embedding gets the previous stage's hidden states (a meta leaf that receives a gradient);
    one without the head sums its output."""
    model = meta_models.build_meta_gpt(TINY_MOE, num_layers=1, pre_process=pre_process, post_process=post_process,
                                       seq_length=SEQ, recompute="full")
    expected = (TINY_MOE.layer_dense_params() + TINY_MOE.layer_expert_params()
                + (TINY_MOE.embedding_params(SEQ) if pre_process else 0)
                + (TINY_MOE.output_params() if post_process else 0))
    assert meta_models.parameter_count(model) == expected
    assert len(meta_models.meta_schedule_step(model, micro_batches=2)) == 2
    assert _grads_are_meta_with_parameter_shapes(model)
    batch = meta_models.meta_batch(model, seq_length=SEQ, micro_batch_size=1)
    assert ("input_hidden_states" in batch) == (not pre_process)


def test_moe_routing_changes_every_iteration_and_repeats_for_the_same_seed(session):
    model = meta_models.build_meta_gpt(TINY_MOE, seq_length=SEQ, moe_routing_seed=3)
    routing = meta_models.meta_build_of(model).routing
    counts = []
    for _ in range(2):
        meta_models.meta_schedule_step(model, micro_batches=2)
        counts.append(routing.forward_counts())
    assert routing.iteration == 1
    # 2 micro-batches x 2 layers, each dispatch routes every token to top-2 of 4 experts
    assert all(len(c) == 4 and all(sum(d) == SEQ * 2 and len(d) == 4 for d in c) for c in counts)
    assert [r.layer_number for r in routing.records] == [1, 2, 1, 2]
    assert counts[0] != counts[1]
    assert len(set(counts[0])) > 1  # layers and micro-batches route differently too

    again = meta_models.build_meta_gpt(TINY_MOE, seq_length=SEQ, moe_routing_seed=3)
    meta_models.meta_schedule_step(again, micro_batches=2, iteration=1)
    assert meta_models.meta_build_of(again).routing.forward_counts() == counts[1]
    other = meta_models.build_meta_gpt(TINY_MOE, seq_length=SEQ, moe_routing_seed=4)
    meta_models.meta_schedule_step(other, micro_batches=2, iteration=1)
    assert meta_models.meta_build_of(other).routing.forward_counts() != counts[1]


def test_full_recompute_replays_the_routing_of_the_forward(session):
    model = meta_models.build_meta_gpt(TINY_MOE, seq_length=SEQ, recompute="full")
    routing = meta_models.meta_build_of(model).routing
    meta_models.meta_schedule_step(model, micro_batches=2)
    # no pipelining: per micro-batch, forward layers 1, 2, then backward recomputes layer 2, then layer 1
    order = [(r.layer_number, r.recomputed) for r in routing.records]
    assert order == [(1, False), (2, False), (2, True), (1, True)] * 2
    for micro_batch in range(2):
        records = routing.records[4 * micro_batch: 4 * micro_batch + 4]
        forward = {r.layer_number: r.tokens_per_expert for r in records if not r.recomputed}
        assert {r.layer_number: r.tokens_per_expert for r in records if r.recomputed} == forward
        assert forward[1] != forward[2]


def test_the_meta_session_keeps_megatron_moe_state_apart_from_cpu_runs():
    """Megatron keeps the auxiliary-loss tracker and loss scale per process: a CPU MoE run before and after a meta
    one (and with the meta routing patch applied, which leaves CPU inputs to the original) trains as before."""
    shape = TransformerShape(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                             micro_batch_size=2)

    def cpu_losses(patches=()):
        with gpt.megatron_cpu_session(seed=1), apply_patches(patches):
            model = gpt.build_gpt(shape, seed=1, num_experts=4)
            losses = []
            for step in range(2):
                loss = gpt.gpt_loss(model, gpt.synthetic_batch(shape, step, seed=1))
                loss.backward()
                losses.append(loss.item())
            return losses

    before = cpu_losses()
    tracker_before = dict(moe_utils.get_moe_layer_wise_logging_tracker())
    with meta_models.megatron_meta_session():
        meta_models.meta_schedule_step(meta_models.build_meta_gpt(TINY_MOE, seq_length=SEQ), micro_batches=1)
        assert all(v["values"].is_meta for v in moe_utils.get_moe_layer_wise_logging_tracker().values())
    assert moe_utils.get_moe_layer_wise_logging_tracker() == tracker_before
    routing = MetaRouting()
    assert cpu_losses(meta_routing_patches(routing)) == before and routing.records == []


def test_llama2_7b_builds_whole_on_meta(session):
    profile = load_model("llama2-7b")
    model = meta_models.build_meta_gpt(profile, seq_length=4096)
    count = meta_models.parameter_count(model)
    assert count == profile.parameter_count() and count == pytest.approx(6.74e9, rel=1e-3)
    assert len(model.decoder.layers) == 32 and all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config.num_query_groups == 32 and model.config.gated_linear_unit and not model.config.add_bias_linear
    assert model.embedding.word_embeddings.weight is not model.output_layer.weight  # untied


def test_stages_of_llama2_70b_and_mixtral_build_on_meta(session):
    llama = load_model("llama2-70b")
    first = meta_models.build_meta_gpt(llama, num_layers=10, post_process=False, seq_length=4096)
    last = meta_models.build_meta_gpt(llama, num_layers=10, pre_process=False, seq_length=4096)
    layers = 10 * llama.layer_dense_params()
    assert meta_models.parameter_count(first) == layers + llama.embedding_params(4096)
    assert meta_models.parameter_count(last) == layers + llama.output_params()
    assert first.config.num_query_groups == 8 and first.decoder.layers[0].self_attention.linear_qkv.weight.shape == (
        8192 + 2 * 1024, 8192)

    mixtral = load_model("mixtral-8x7b")
    stage = meta_models.build_meta_gpt(mixtral, num_layers=4, post_process=False, seq_length=4096)
    assert meta_models.parameter_count(stage) == (4 * (mixtral.layer_dense_params() + mixtral.layer_expert_params())
                                                   + mixtral.embedding_params(4096))
    mlp = stage.decoder.layers[0].mlp
    assert (mlp.config.num_moe_experts, mlp.config.moe_router_topk, len(mlp.experts.local_experts)) == (8, 2, 8)


def test_unsupported_settings_are_refused_by_name(session):
    with pytest.raises(ValueError, match="recompute='block'"):
        meta_models.build_meta_gpt(TINY, seq_length=SEQ, recompute="block")
    with pytest.raises(ValueError, match="moe_token_dispatcher_type"):
        meta_models.build_meta_gpt(TINY_MOE, seq_length=SEQ, moe_token_dispatcher_type="alltoall")
    with pytest.raises(ValueError, match="num_layers=3"):
        meta_models.build_meta_gpt(TINY, num_layers=3, seq_length=SEQ)


def test_building_outside_a_meta_session_is_refused():
    with gpt.megatron_cpu_session(seed=1), pytest.raises(RuntimeError, match="megatron_meta_session"):
        meta_models.build_meta_gpt(TINY, seq_length=SEQ)


def test_the_session_answers_the_meta_device_and_undoes_it():
    with meta_models.megatron_meta_session():
        assert shimmed_current_device() == torch.device("meta")
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
        assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    assert shimmed_current_device() is None and not parallel_state.model_parallel_is_initialized()
    with gpt.megatron_cpu_session(seed=1):
        assert shimmed_current_device() == torch.device("cpu")


class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_fused_attention_saves_no_score_matrix_also_when_megatron_recomputes_it(session, recompute):
    """The default ``attention="fused"`` runs the fused kernel in forward and again where Megatron's recomputation
    replays the attention in backward (no function mode is active there): no ``s x s`` softmax anywhere. Megatron's
    own ``attention="local"`` materialises it (the reason the fused default exists)."""
    from chameleon_dist.device.emulated import EmulatedDevice

    device = EmulatedDevice(2**30, preset="h100-pcie", host_op_s=1e-5, meta_tensors=True)
    seen = {}
    for attention in ("fused", "local"):
        model = meta_models.build_meta_gpt(TINY, seq_length=SEQ, recompute=recompute, attention=attention)
        with device.active(), _OpNames() as names:
            meta_models.meta_schedule_step(model, micro_batches=1)
        seen[attention] = names.names
    fused = [n for n in seen["fused"] if "flash_attention" in n]
    assert len(fused) == TINY.num_layers * (3 if recompute else 2), fused  # forward, backward (and the replay)
    assert not [n for n in seen["fused"] if "softmax" in n], "a softmax (score matrix) with fused attention"
    assert [n for n in seen["local"] if "softmax" in n] and not [n for n in seen["local"] if "flash_attention" in n]
