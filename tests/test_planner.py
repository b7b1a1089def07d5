"""The planner's cost model against hand-computed cases, its schedule, search and monotonicity properties."""

import dataclasses

import pytest

from chameleon_dist.config import ConfigError
from chameleon_dist.planner import (
    Layout,
    ModelProfile,
    SearchSpace,
    TrainingSetup,
    evaluate,
    in_flight_chunks,
    iteration_time,
    layer_activations,
    load_hardware,
    load_model,
    load_profile,
    schedule,
    search,
    shipped_names,
    stage_memory,
)
from chameleon_dist.planner.layout import BACKWARD_STEP, FORWARD_STEP
from chameleon_dist.planner.memory import head_activations, model_state, stage_params
from chameleon_dist.planner.profiles import HARDWARE_DIR, MODELS_DIR, make_setup
from chameleon_dist.planner.search import FEASIBLE, OUT_OF_MEMORY, PlanError

# A GPT-3-style layer: Korthikanti et al.'s setting (16-bit, dropout, GeLU 4h, unfused attention).
GPT3 = ModelProfile(name="gpt3-like", num_layers=8, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                    vocab_size=50304, seq_length=2048, activation="gelu", normalization="layernorm",
                    add_bias_linear=True, position_embedding="learned", dropout=0.1)
S, B, H, A = 2048, 2, 1024, 16


def gpt3_setup(**overrides):
    settings = dict(global_batch_size=8, seq_length=S, attention="unfused")
    settings.update(overrides)
    return TrainingSetup(**settings)


def stats_bytes(tp=1):
    """The planner also counts the two LayerNorms' fp32 mean and rstd per token (the paper omits them)."""
    return 2 * 8 * S * B // tp


# ---- activations, by hand -------------------------------------------------------------------------
def test_layer_activations_match_korthikanti_without_parallelism():
    acts = layer_activations(GPT3, gpt3_setup(), tp=1, micro_batch=B)
    assert acts.full_bytes == S * B * H * 34 + 5 * A * S * S * B + stats_bytes()
    assert acts.core_bytes == 5 * A * S * S * B
    selective = layer_activations(GPT3, gpt3_setup(), tp=1, micro_batch=B, recompute="selective")
    assert selective.stored_bytes == 34 * S * B * H + stats_bytes()
    assert acts.input_bytes == 2 * S * B * H  # what full recomputation keeps


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_divides_as_the_paper_says(tp):
    with_sp = layer_activations(GPT3, gpt3_setup(sequence_parallel=True), tp=tp, micro_batch=B)
    assert with_sp.full_bytes == S * B * H * 34 // tp + 5 * A * S * S * B // tp + stats_bytes(tp)
    without_sp = layer_activations(GPT3, gpt3_setup(sequence_parallel=False), tp=tp, micro_batch=B)
    # s b h (10 + 24 / t + 5 a s / (h t)): norms, column-parallel inputs and dropout masks stay replicated
    assert without_sp.full_bytes == S * B * H * 10 + S * B * H * 24 // tp + 5 * A * S * S * B // tp + stats_bytes()


def test_flash_attention_swiglu_and_gqa_accounting():
    llama = load_model("llama2-70b")
    setup = TrainingSetup(global_batch_size=8, seq_length=4096, fused_swiglu=True)
    acts = layer_activations(llama, setup, tp=1, micro_batch=1)
    h, kv, f, s = 8192, 1024, 28672, 4096
    # two norm inputs and the qkv, projection and fc1 inputs: 5h; q, k, v with 8 KV heads: h + 2 kv;
    # fused SwiGLU: its 2f input and the f-wide fc2 input; 2 bytes each; plus two fp32 rstd and the
    # fp32 log-sum-exp of 64 heads per token
    expected = 2 * s * (5 * h + h + 2 * kv + 3 * f) + 2 * 4 * s + 64 * 4 * s
    assert acts.full_bytes == expected
    unfused = layer_activations(llama, setup.model_copy(update={"fused_swiglu": False}), 1, 1)
    assert unfused.full_bytes - acts.full_bytes == 2 * s * f  # the silu output is kept as well


def test_head_keeps_fp32_logits_sharded_by_tp():
    llama = load_model("llama2-7b")
    setup = TrainingSetup(global_batch_size=8, seq_length=4096)
    logits = [t for t in head_activations(llama, setup, tp=4, micro_batch=2) if "logits" in t.name]
    assert logits[0].nbytes == 4 * 32000 * 4096 * 2 // 4


# ---- model state ------------------------------------------------------------------------------------
def test_shipped_models_have_their_published_parameter_counts():
    published = {"llama2-7b": 6.74e9, "llama2-13b": 13.0e9, "llama2-70b": 69.0e9, "mixtral-8x7b": 46.7e9}
    for name, count in published.items():
        assert load_model(name).parameter_count() == pytest.approx(count, rel=0.01), name


def test_model_state_bytes_for_mixed_precision_and_zero_stages():
    llama = load_model("llama2-7b")
    layout = Layout(dp=8)
    params = stage_params(llama, TrainingSetup(global_batch_size=8, seq_length=4096), layout, 0).total
    assert params == llama.parameter_count()
    expected = {0: 2 + 4 + 12, 1: 2 + 4 + 12 / 8, 2: 2 + (4 + 12) / 8, 3: (2 + 4 + 12) / 8}
    for zero, per_param in expected.items():
        state = model_state(stage_params(llama, TrainingSetup(global_batch_size=8, seq_length=4096), layout, 0),
                            TrainingSetup(global_batch_size=8, seq_length=4096, zero_stage=zero), layout)
        assert state.total_bytes == pytest.approx(params * per_param, rel=1e-6), zero


# ---- schedules and the bubble -----------------------------------------------------------------------
@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (4, 2, 8), (2, 4, 4), (1, 1, 3)])
def test_schedule_runs_every_chunk_once_and_holds_what_in_flight_says(pp, vpp, m):
    for stage in range(pp):
        steps = schedule(stage, pp, vpp, m)
        forwards = [(mb, c) for kind, mb, c in steps if kind == FORWARD_STEP]
        backwards = [(mb, c) for kind, mb, c in steps if kind == BACKWARD_STEP]
        assert sorted(forwards) == sorted(backwards) == sorted((mb, c) for mb in range(m) for c in range(vpp))
        live, most = set(), 0
        for kind, mb, c in steps:
            if kind == FORWARD_STEP:
                live.add((mb, c))
            else:
                assert (mb, c) in live, "a backward before its forward"
                live.remove((mb, c))
            most = max(most, len(live))
        assert most == in_flight_chunks(stage, pp, vpp, m)


def test_first_stage_holds_more_in_flight():
    assert [in_flight_chunks(s, 4, 1, 16) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight_chunks(0, 4, 2, 16) == 4 * 2 + 4 - 1  # Korthikanti: L (1 + (p - 1) / (p v)) layers


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (4, 2, 8), (8, 1, 16)])
def test_bubble_fraction(pp, vpp, m):
    llama = load_model("llama2-7b")
    hardware = load_hardware("ascend-910b")
    setup = TrainingSetup(global_batch_size=m, seq_length=4096)
    t = iteration_time(llama, hardware, setup, Layout(pp=pp, vpp=vpp))
    steady = t.compute + t.recompute + t.tp_comm + t.ep_comm
    assert t.bubble / steady == pytest.approx((pp - 1) / (vpp * m))


def test_recomputation_costs_one_forward_per_recomputed_layer():
    llama, hardware = load_model("llama2-7b"), load_hardware("ascend-910b")
    setup = TrainingSetup(global_batch_size=8, seq_length=4096)
    plain = iteration_time(llama, hardware, setup, Layout(dp=8))
    full = iteration_time(llama, hardware, setup, Layout(dp=8, recompute="full"))
    block = iteration_time(llama, hardware, setup, Layout(dp=8, recompute="block", recompute_layers=8))
    head_s = plain.compute - full.recompute * 3  # compute = 3 forwards of the layers + the head
    assert 0 < head_s < 0.1 * plain.compute
    assert block.recompute == pytest.approx(full.recompute * 8 / 32)


# ---- peak memory --------------------------------------------------------------------------------------
def test_recomputation_and_parallelism_lower_the_peak():
    llama = load_model("llama2-7b")
    setup = TrainingSetup(global_batch_size=64, seq_length=8192)
    peak = {name: stage_memory(llama, setup, layout, 0).peak_bytes for name, layout in {
        "none": Layout(dp=8), "block": Layout(dp=8, recompute="block", recompute_layers=16),
        "full": Layout(dp=8, recompute="full"), "tp2": Layout(tp=2, dp=4)}.items()}
    assert peak["full"] < peak["block"] < peak["none"]
    assert peak["tp2"] < peak["none"]
    first, last = stage_memory(llama, setup, Layout(pp=4, dp=2), 0), stage_memory(llama, setup, Layout(pp=4, dp=2), 3)
    assert first.layers_in_flight == 4 * 8 and last.layers_in_flight == 8


def test_block_recomputation_is_raised_only_as_far_as_needed():
    llama, hardware = load_model("llama2-7b"), load_hardware("ascend-910b")
    setup = TrainingSetup(global_batch_size=64, seq_length=8192)
    result = search(llama, hardware, setup, 8, SearchSpace(tp=(1,), pp=(1,), recompute=("block",), swap=(False,)))
    plan = result.best
    n = plan.layout.recompute_layers
    assert 0 < n < 32 and plan.peak_bytes <= hardware.usable_bytes
    fewer = evaluate(llama, hardware, setup, dataclasses.replace(plan.layout, recompute_layers=n - 1))
    assert fewer.status == OUT_OF_MEMORY


# ---- search ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paper_search():
    # the paper's runs use no context parallelism (with it, Llama2-7B at 8K fits on 8 x 910B without swap)
    return search(load_model("llama2-7b"), load_hardware("ascend-910b"),
                  TrainingSetup(global_batch_size=64, seq_length=8192), 8, SearchSpace(cp=(1,)))


def test_search_returns_the_fastest_feasible_plan_and_explains_the_rest(paper_search):
    best = paper_search.best
    feasible = [p for p in paper_search.plans if p.status == FEASIBLE]
    assert best is feasible[0] and best.iteration_s == min(p.iteration_s for p in feasible)
    assert best.peak_bytes <= paper_search.hardware.usable_bytes
    for plan in paper_search.plans[1:]:
        assert plan.reason and plan.reason != "best"
        if plan.status == OUT_OF_MEMORY:
            assert "out of memory" in plan.reason
        elif plan.status == FEASIBLE and plan.iteration_s > best.iteration_s * 1.001:
            assert "slower" in plan.reason
    assert all(p.layout.world_size == 8 for p in paper_search.plans)


def test_comparison_speedups_follow_from_the_plans(paper_search):
    c = paper_search.comparison()
    assert c["swap"].layout.recompute == "none" and c["recompute"].layout.recompute != "none"
    assert not c["parallel"].layout.swap and c["parallel"].layout.recompute == "none"
    assert c["speedup_vs_recompute"] == pytest.approx(c["recompute"].iteration_s / c["swap"].iteration_s - 1)
    assert c["speedup_vs_parallel"] >= 0  # the swap category includes the plans that need no swap


def test_swap_plan_time_is_the_cost_model_plus_the_policy_stall(paper_search):
    swapping = [p for p in paper_search.plans if p.status == FEASIBLE and p.layout.swap]
    assert swapping, "the paper's setting has feasible swap plans"
    for plan in swapping:
        plain = iteration_time(paper_search.model, paper_search.hardware, paper_search.setup, plan.layout)
        assert plan.iteration_s == pytest.approx(plain.total_s + plan.time.stall)
        assert plan.swap and all(s.feasible for s in plan.swap) and plan.swapped_bytes > 0
        no_swap = max(m.peak_bytes for m in plan.memory)
        assert no_swap > plan.usable_bytes >= plan.peak_bytes


def test_more_memory_never_yields_a_slower_best_plan():
    llama, base = load_model("llama2-7b"), load_hardware("ascend-910b")
    setup = TrainingSetup(global_batch_size=64, seq_length=8192)
    with_swap, without_swap = [], []
    for gb in (40, 56, 60, 64, 80, 96):
        hardware = base.model_copy(update={"memory_bytes": gb * 10**9})
        with_swap.append(search(llama, hardware, setup, 8).best.iteration_s)
        without_swap.append(search(llama, hardware, setup, 8, SearchSpace(swap=(False,))).best.iteration_s)
    assert without_swap == sorted(without_swap, reverse=True), without_swap  # exact: feasibility only grows
    # exact with swap too: the planner's swap estimate is monotone by construction (planner/swap_prefix.py)
    assert all(later <= earlier for earlier, later in zip(with_swap, with_swap[1:])), with_swap
    assert all(s <= n for s, n in zip(with_swap, without_swap))
    assert with_swap[0] > with_swap[-1] and without_swap[0] > without_swap[-1]


def test_a_faster_link_never_makes_swap_slower():
    llama, base = load_model("llama2-7b"), load_hardware("ascend-910b")
    setup = TrainingSetup(global_batch_size=64, seq_length=8192)
    layout = Layout(tp=1, pp=2, dp=4, vpp=4, swap=True)
    stalls, feasible, best = [], [], []
    for rate in (12e9, 23e9, 46e9, 92e9):
        hardware = base.model_copy(update={"h2d_bytes_per_s": rate, "d2h_bytes_per_s": rate})
        plan = evaluate(llama, hardware, setup, layout)
        stalls.append(plan.time.stall if plan.feasible else float("inf"))
        feasible.append(plan.feasible)
        best.append(search(llama, hardware, setup, 8, SearchSpace(recompute=("none",))).best.iteration_s)
    assert stalls == sorted(stalls, reverse=True), stalls
    assert feasible == sorted(feasible), feasible
    assert best == sorted(best, reverse=True), best


def test_infeasible_inputs_name_what_does_not_fit():
    result = search(load_model("llama2-70b"), load_hardware("ascend-910b"),
                    TrainingSetup(global_batch_size=8, seq_length=4096), 2)
    assert result.best is None
    message = result.infeasible_message()
    assert "the model state alone does not fit" in message and "GB usable" in message and "--devices" in message
    with pytest.raises(PlanError, match="--devices"):
        search(load_model("llama2-7b"), load_hardware("ascend-910b"), TrainingSetup(global_batch_size=4, seq_length=4096), 3)


def test_bad_settings_and_profiles_name_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="zero_stage"):
        make_setup(global_batch_size=8, seq_length=4096, zero_stage=5)
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: model\nname: x\nnum_layers: 2\nhidden_size: 30\nnum_attention_heads: 4\n"
                   "ffn_hidden_size: 8\nvocab_size: 8\nseq_length: 4\nhiden: 3\n")
    with pytest.raises(ConfigError) as info:
        load_profile(bad)
    assert "hiden" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'llama2-7b'"):
        load_model("llama2-7")
    with pytest.raises(ConfigError, match="expected a hardware profile"):
        load_hardware(str(MODELS_DIR / "llama2-7b.yaml"))


def test_every_shipped_profile_loads_and_says_where_its_numbers_come_from():
    names = shipped_names("model") + shipped_names("hardware")
    assert {"llama2-7b", "llama2-13b", "llama2-70b", "mixtral-8x7b"} <= set(shipped_names("model"))
    assert {"ascend-910b", "a100-80gb", "h100-80gb", "h200-141gb"} <= set(shipped_names("hardware"))
    for kind, loader, folder in (("model", load_model, MODELS_DIR), ("hardware", load_hardware, HARDWARE_DIR)):
        for name in shipped_names(kind):
            profile = loader(name)
            assert profile.name == name
            for line in (folder / f"{name}.yaml").read_text().splitlines():
                key = line.split(":")[0].strip()
                if line and not line.startswith("#") and key not in ("kind", "name", "description"):
                    assert "#" in line, f"{name}: {key} has no source comment"
    assert len(names) >= 8


def test_swap_model_trace_follows_the_stage_schedule():
    from chameleon_dist.planner.swap_model import build_stage_trace, storage_parts
    from chameleon_dist.planner.timing import stage_timing
    from chameleon_dist.trace.step_trace import BACKWARD, FORWARD

    llama, hardware = load_model("llama2-7b"), load_hardware("ascend-910b")
    setup = TrainingSetup(global_batch_size=16, seq_length=4096)
    layout = Layout(pp=4, dp=2)
    m, per_stage = 8, 8
    timing = stage_timing(llama, hardware, setup, layout)
    parts = storage_parts(layer_activations(llama, setup, 1, 1).tensors)
    for stage in (0, 3):
        memory = stage_memory(llama, setup, layout, stage)
        trace, times = build_stage_trace(memory, timing, layout, m, stage == 3, parts, (memory.head_bytes,))
        head = 1 if stage == 3 else 0
        assert len(trace.ops) == len(times) == 2 * m * (per_stage + head)
        first_backward = next(i for i, op in enumerate(trace.ops) if op.phase == BACKWARD)
        assert first_backward == (4 - stage) * (per_stage + head)  # 1F1B: p - i micro-batches before the first B
        assert sum(trace.storages[t].nbytes for t in trace.ops[0].outputs) == memory.layer_stored_bytes
        for op_index, op in enumerate(trace.ops):
            for tensor_id in op.inputs:  # a backward op reads its layer's tensors, which die right after
                storage = trace.storages[trace.tensors[tensor_id].storage_id]
                assert op.phase == BACKWARD and storage.freed_at == op_index + 1
                assert trace.ops[storage.created_at].phase == FORWARD
                assert trace.ops[storage.created_at].micro_batch == op.micro_batch
        peak = max(op.live_bytes for op in trace.ops)
        stored = memory.static_bytes + memory.layers_in_flight * memory.layer_stored_bytes + memory.head_bytes
        assert stored <= peak <= memory.peak_bytes
        assert sum(times) == pytest.approx(m * (per_stage * (timing.layer.forward_op_s + timing.layer.backward_op_s)
                                                 + head * (timing.head_forward_s + timing.head_backward_s)))
