"""Context parallelism, Megatron's communication-overlap switches and the sequence-parallel re-gather in the
planner's cost model, search and CLI (issue 29, item 4): each rule on the numbers the code computes."""

import dataclasses

import pytest

from chameleon_dist.cli import plan as plan_cli
from chameleon_dist.config import ConfigError
from chameleon_dist.planner import Layout, SearchSpace, TrainingSetup, iteration_time, load_hardware, load_model
from chameleon_dist.planner.memory import layer_activations, model_state, stage_memory, stage_params
from chameleon_dist.planner.profiles import HARDWARE_DIR, MEGATRON_OVERLAP_DEFAULTS, make_setup, overlap_settings
from chameleon_dist.planner.search import search
from chameleon_dist.planner.space import MIN_TOKENS_PER_CP_RANK, layouts
from chameleon_dist.planner.timing import (
    COMPONENTS,
    cp_comm_times,
    dp_comm_parts,
    layer_times,
    megatron_bucket_params,
    stage_timing,
    tp_collective_s,
    tp_comm_times,
)

LLAMA = load_model("llama2-7b")
# at a constant GEMM efficiency (planner/efficiency.py off): these tests redo the CP and TP arithmetic by hand
H100 = load_hardware("h100-80gb").model_copy(update={"gemm_half_efficiency_flops": 0.0, "attention_efficiency": None})
RATE = H100.effective_flops_per_s  # the tests' own GEMM rate of one TP rank


def setup_of(seq: int = 32768, batch: int = 64, **kw) -> TrainingSetup:
    return TrainingSetup(global_batch_size=batch, seq_length=seq, **kw)


def slow(bus_bytes_per_s: float):
    """H100 with every collective at ``bus_bytes_per_s`` (so that communication outgrows compute)."""
    return H100.model_copy(update={"intra_node_bus_bytes_per_s": bus_bytes_per_s,
                                   "inter_node_bus_bytes_per_s": bus_bytes_per_s})


# ---- the layout -------------------------------------------------------------------------------------------
def test_cp_is_a_keyword_field_at_the_end_and_describe_is_unchanged_without_it():
    assert Layout(2, 2, 2).describe() == "TP2 PP2 DP2 mb1 no-recompute"  # positional constructions keep meaning
    layout = Layout(tp=2, dp=2, cp=2)
    assert layout.world_size == 8 and layout.dp_cp == 4
    assert layout.describe() == "TP2 CP2 PP1 DP2 mb1 no-recompute"
    assert layout.to_dict()["cp"] == 2 and Layout().to_dict()["cp"] == 1
    with pytest.raises(ValueError, match="cp must be >= 1"):
        Layout(cp=0)


def test_the_space_tries_cp_where_megatron_allows_it():
    long = setup_of(seq=32768)
    cps = {l.cp for l in layouts(LLAMA, H100, long, 8, SearchSpace(micro_batch=(1,), swap=(False,)))}
    assert cps == {1, 2, 4, 8}  # 32768 / 8 = 4096 tokens per rank, the floor
    for l in layouts(LLAMA, H100, long, 8, SearchSpace(micro_batch=(1,), swap=(False,))):
        assert l.world_size == 8
    short = {l.cp for l in layouts(LLAMA, H100, setup_of(seq=4096), 8)}
    assert short == {1}  # below MIN_TOKENS_PER_CP_RANK per rank an unset cp is not tried
    assert {l.cp for l in layouts(LLAMA, H100, setup_of(seq=4096), 8, SearchSpace(cp=(1, 2)))} == {1, 2}
    # seq not divisible by 2 cp, unfused attention: no CP
    odd = setup_of(seq=2 * MIN_TOKENS_PER_CP_RANK + 4)
    assert {l.cp for l in layouts(LLAMA, H100, odd, 8, SearchSpace(cp=(1, 2, 8)))} == {1, 2}
    assert {l.cp for l in layouts(LLAMA, H100, setup_of(attention="unfused"), 8, SearchSpace(cp=(1, 2)))} == {1}


# ---- memory -----------------------------------------------------------------------------------------------
def test_cp_halves_the_activations_per_rank_and_leaves_the_state_to_zero():
    setup = setup_of(seq=16384)
    one, two = layer_activations(LLAMA, setup, 2, 1), layer_activations(LLAMA, setup, 2, 1, cp=2)
    assert two.full_bytes * 2 == pytest.approx(one.full_bytes, rel=1e-6)
    plain = stage_memory(LLAMA, setup, Layout(tp=2, dp=4), 0)
    halved = stage_memory(LLAMA, setup, Layout(tp=2, dp=2, cp=2), 0)
    assert halved.activation_bytes * 2 == pytest.approx(plain.activation_bytes, rel=1e-6)
    # parameters are replicated across CP; the distributed optimizer shards over dp x cp
    params = stage_params(LLAMA, setup, Layout(tp=2, dp=2, cp=2), 0)
    assert model_state(params, setup, Layout(tp=2, dp=2, cp=2)) == model_state(params, setup, Layout(tp=2, dp=4))
    no_zero = setup_of(seq=16384, zero_stage=0)
    assert (model_state(params, no_zero, Layout(tp=2, dp=1, cp=4)).total_bytes
            == model_state(params, no_zero, Layout(tp=2, dp=1)).total_bytes)


# ---- compute and the ring's communication -----------------------------------------------------------------
def test_cp_divides_a_ranks_compute():
    setup = setup_of(seq=32768)
    one, four = layer_times(LLAMA, H100, setup, Layout()), layer_times(LLAMA, H100, setup, Layout(cp=4))
    assert four.forward_s * 4 == pytest.approx(one.forward_s) and four.backward_s * 4 == pytest.approx(one.backward_s)
    plain, cp = iteration_time(LLAMA, H100, setup, Layout(dp=8)), iteration_time(LLAMA, H100, setup, Layout(dp=2, cp=4))
    assert cp.compute == pytest.approx(plain.compute)  # 4x the micro-batches per rank, each a quarter


def _ring_by_hand(setup: TrainingSetup, layout: Layout, bus_bytes_per_s: float) -> tuple[float, float]:
    kv_bytes = 2 * (setup.seq_length / layout.cp) * LLAMA.kv_hidden_size / layout.tp * 2  # K and V, bf16
    step_s = kv_bytes / bus_bytes_per_s
    attention_step_s = 4 * setup.seq_length ** 2 * LLAMA.hidden_size * 0.5 / (RATE * layout.tp * layout.cp) / layout.cp
    return step_s, attention_step_s


@pytest.mark.parametrize("bus", [460e9, 2e9])
def test_the_ring_is_exposed_only_beyond_each_steps_attention(bus):
    setup, layout = setup_of(seq=16384), Layout(tp=2, cp=4)
    step_s, attention_s = _ring_by_hand(setup, layout, bus)
    forward, backward = cp_comm_times(LLAMA, slow(bus), setup, layout, RATE * layout.tp * layout.cp)
    assert forward == pytest.approx(3 * max(0.0, step_s - attention_s))
    assert backward == pytest.approx(3 * max(0.0, 2 * step_s - 2 * attention_s))
    t = iteration_time(LLAMA, slow(bus), setup, layout)
    if step_s <= attention_s:  # NVLink at 16K tokens: the exchange hides under the attention
        assert forward == backward == 0 and t.cp_comm == 0
    else:
        assert forward > 0 and t.cp_comm == pytest.approx(64 * 32 * (forward + backward), rel=1e-9)  # m x layers


def test_cp_comm_is_a_component_of_the_breakdown():
    assert "cp_comm" in COMPONENTS and COMPONENTS[:3] == ("compute", "recompute", "tp_comm")
    t = iteration_time(LLAMA, slow(2e9), setup_of(seq=16384), Layout(tp=2, cp=4))
    assert t.to_dict()["cp_comm_s"] == t.cp_comm > 0
    assert t.total_s == pytest.approx(sum(t.to_dict()[f"{c}_s"] for c in COMPONENTS))


def test_recomputation_runs_the_ring_again():
    setup, hw = setup_of(seq=16384), slow(2e9)
    plain = layer_times(LLAMA, hw, setup, Layout(cp=4))
    full = layer_times(LLAMA, hw, setup, Layout(cp=4, recompute="full"))
    forward, _ = cp_comm_times(LLAMA, hw, setup, Layout(cp=4), RATE * 4)
    assert full.cp_comm_s == pytest.approx(plain.cp_comm_s + forward)


# ---- the sequence-parallel re-gather ----------------------------------------------------------------------
def test_sp_backward_has_one_and_a_half_times_the_forwards_tp_communication():
    setup = setup_of(seq=8192)
    layout = Layout(tp=4, dp=2)
    forward, backward = tp_comm_times(LLAMA, H100, setup, layout, RATE * 4)
    one = tp_collective_s(LLAMA, H100, setup, layout)
    assert forward == pytest.approx(4 * one) and backward == pytest.approx(6 * one)
    assert backward == pytest.approx(1.5 * forward)
    no_sp = setup_of(seq=8192, sequence_parallel=False)
    forward, backward = tp_comm_times(LLAMA, H100, no_sp, layout, RATE * 4)
    assert backward == pytest.approx(forward)  # 2 all-reduces each way
    times = layer_times(LLAMA, H100, setup, layout)
    assert times.tp_comm_s == pytest.approx(10 * one)
    assert times.forward_op_s == pytest.approx(times.forward_s + 4 * one)  # the swap model sees the split
    rebuilt = layer_times(LLAMA, H100, setup, dataclasses.replace(layout, recompute="full"))
    assert rebuilt.tp_comm_s == pytest.approx(14 * one)  # the rebuilt forward's 4 collectives again


# ---- Megatron's overlap switches --------------------------------------------------------------------------
def test_tp_comm_overlap_hides_each_collective_under_its_gemm():
    setup, layout = setup_of(seq=8192), Layout(tp=8)
    for bus in (460e9, 20e9):
        hw = slow(bus)
        off = tp_comm_times(LLAMA, hw, setup, layout, RATE * 8)
        on = tp_comm_times(LLAMA, hw, setup_of(seq=8192, tp_comm_overlap=True), layout, RATE * 8)
        one = tp_collective_s(LLAMA, hw, setup, layout)
        h, f, tokens = LLAMA.hidden_size, LLAMA.ffn_hidden_size, 8192
        qkv, proj = 2 * tokens * h * (h + 2 * LLAMA.kv_hidden_size), 2 * tokens * h * h
        fc1, fc2 = 2 * tokens * h * f * 2, 2 * tokens * h * f
        gemm = [x / (RATE * 8) for x in (qkv, proj, fc1, fc2)]
        assert on[0] == pytest.approx(sum(max(0.0, one - g) for g in gemm))
        paired = (gemm[0], gemm[0], gemm[1], gemm[2], gemm[2], gemm[3])  # dgrad, wgrad of QKV; dgrad of proj; ...
        assert on[1] == pytest.approx(sum(max(0.0, one - g) for g in paired))
        assert on[0] < off[0] and on[1] < off[1]
    # the old float field still hides a fraction of what is exposed
    half = tp_comm_times(LLAMA, H100, setup_of(seq=8192, tp_comm_overlap=0.5), layout, RATE * 8)
    off = tp_comm_times(LLAMA, H100, setup, layout, RATE * 8)
    assert half[0] == pytest.approx(off[0] / 2) and half[1] == pytest.approx(off[1] / 2)


def test_overlap_grad_reduce_hides_the_reduction_under_the_last_backward_but_one_bucket():
    layout = Layout(dp=8)
    for bus in (460e9, 1e9):  # the backward hides all but the last bucket; a slow link exceeds the backward
        hw = slow(bus)
        off_setup, on_setup = setup_of(seq=4096), setup_of(seq=4096, overlap_grad_reduce=True)
        off, on = iteration_time(LLAMA, hw, off_setup, layout), iteration_time(LLAMA, hw, on_setup, layout)
        parts = dp_comm_parts(LLAMA, hw, off_setup, layout, 0)
        backward_s = stage_timing(LLAMA, hw, on_setup, layout).micro_batch_backward_s(True)
        bucket = parts.reduce_s * megatron_bucket_params(layout) / parts.params
        assert off.dp_comm == pytest.approx(parts.reduce_s + parts.gather_s)
        hidden = min(parts.reduce_s - bucket, backward_s)
        assert off.dp_comm - on.dp_comm == pytest.approx(hidden)
        assert on.dp_comm >= parts.gather_s + bucket > 0
    gather = setup_of(seq=4096, overlap_grad_reduce=True, overlap_param_gather=True)
    assert iteration_time(LLAMA, H100, gather, layout).dp_comm < iteration_time(LLAMA, H100, setup_of(
        seq=4096, overlap_grad_reduce=True), layout).dp_comm


def test_overlap_p2p_comm_only_changes_the_interleaved_schedule():
    hw = slow(5e9)
    for vpp, changes in ((1, False), (2, True)):
        layout = Layout(pp=4, dp=2, vpp=vpp)
        on = iteration_time(LLAMA, hw, setup_of(seq=4096, overlap_p2p_comm=True), layout)
        off = iteration_time(LLAMA, hw, setup_of(seq=4096, overlap_p2p_comm=False), layout)
        assert (on.pp_comm < off.pp_comm) == changes and on.pp_comm <= off.pp_comm


SWITCHES = ({"overlap_grad_reduce": True}, {"overlap_grad_reduce": True, "overlap_param_gather": True},
            {"tp_comm_overlap": True}, {"overlap_p2p_comm": True})


@pytest.mark.parametrize("layout", [Layout(tp=8), Layout(tp=2, pp=2, dp=2, vpp=2), Layout(dp=8),
                                    Layout(tp=2, dp=2, cp=2), Layout(tp=4, pp=2, vpp=4, recompute="full"),
                                    Layout(pp=8, vpp=2)])
@pytest.mark.parametrize("bus", [460e9, 3e9])
def test_turning_a_switch_on_never_makes_a_layout_slower(layout, bus):
    hw = slow(bus)
    base = {"overlap_p2p_comm": False}
    for switch in SWITCHES:
        off = iteration_time(LLAMA, hw, setup_of(seq=8192, **base), layout).total_s
        on = iteration_time(LLAMA, hw, setup_of(seq=8192, **{**base, **switch}), layout).total_s
        assert on <= off + 1e-12, switch


def test_megatron_refuses_what_it_refuses():
    with pytest.raises(ConfigError, match="overlap_param_gather.*--overlap-grad-reduce"):
        make_setup(global_batch_size=8, seq_length=4096, overlap_param_gather=True)
    with pytest.raises(ConfigError, match="tp_comm_overlap.*sequence parallel"):
        make_setup(global_batch_size=8, seq_length=4096, tp_comm_overlap=True, sequence_parallel=False)
    with pytest.raises(ConfigError, match="tp_comm_overlap"):
        make_setup(global_batch_size=8, seq_length=4096, tp_comm_overlap=1.5)


def test_switches_resolve_cli_then_profile_then_megatrons_default():
    profiled = H100.model_copy(update={"overlap_grad_reduce": True, "overlap_p2p_comm": False})
    assert overlap_settings(H100) == dict(MEGATRON_OVERLAP_DEFAULTS)
    assert MEGATRON_OVERLAP_DEFAULTS == {"overlap_grad_reduce": False, "overlap_param_gather": False,
                                         "tp_comm_overlap": False, "overlap_p2p_comm": True}
    resolved = overlap_settings(profiled, overlap_grad_reduce=None, tp_comm_overlap=True)
    assert resolved == {"overlap_grad_reduce": True, "overlap_param_gather": False, "tp_comm_overlap": True,
                        "overlap_p2p_comm": False}
    assert overlap_settings(profiled, overlap_grad_reduce=False)["overlap_grad_reduce"] is False


def _captured_setup(monkeypatch, argv):
    seen = {}

    def fake_search(model, hardware, setup, world_size, space, **_):
        seen.update(setup=setup, space=space)
        raise SystemExit(0)

    monkeypatch.setattr(plan_cli, "search", fake_search)
    with pytest.raises(SystemExit):
        plan_cli.main(argv)
    return seen["setup"], seen["space"]


def test_cli_flags_and_the_hardware_profile_reach_the_setup(monkeypatch, tmp_path):
    setup, space = _captured_setup(monkeypatch, ["--hardware", "h100-80gb", "--cp", "1,2"])
    assert (setup.overlap_grad_reduce, setup.overlap_param_gather, setup.tp_comm_overlap, setup.overlap_p2p_comm) == (
        False, False, False, True) and space.cp == (1, 2)
    setup, _ = _captured_setup(monkeypatch, ["--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
                                             "--no-overlap-p2p-comm"])
    assert (setup.overlap_grad_reduce, setup.overlap_param_gather, setup.tp_comm_overlap, setup.overlap_p2p_comm) == (
        True, True, True, False)
    profile = tmp_path / "h100-overlap.yaml"
    profile.write_text((HARDWARE_DIR / "h100-80gb.yaml").read_text()
                       + "\noverlap_grad_reduce: true  # test\noverlap_p2p_comm: false  # test\n")
    setup, _ = _captured_setup(monkeypatch, ["--hardware", str(profile)])
    assert setup.overlap_grad_reduce is True and setup.overlap_p2p_comm is False
    setup, _ = _captured_setup(monkeypatch, ["--hardware", str(profile), "--no-overlap-grad-reduce"])
    assert setup.overlap_grad_reduce is False and setup.overlap_p2p_comm is False


@pytest.mark.parametrize("argv, words", [
    (["--devices", "8", "--cp", "3"], "does not divide the world (8)"),
    (["--devices", "8", "--seq", "4100", "--cp", "8"], "not divisible by 2 x cp (16)"),
    (["--devices", "8", "--cp", "2", "--attention", "unfused"], "flash"),
])
def test_an_invalid_cp_is_refused_by_name(argv, words, capsys):
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--cp" in err and words in err and "Traceback" not in err


# ---- the search -------------------------------------------------------------------------------------------
def test_the_search_picks_cp_at_64k_tokens_on_8_h100s_and_it_beats_the_best_without():
    setup = setup_of(seq=65536, batch=64)
    space = SearchSpace(micro_batch=(1,), vpp=(1,))
    best = search(LLAMA, H100, setup, 8, space).best
    without = search(LLAMA, H100, setup, 8, dataclasses.replace(space, cp=(1,))).best
    assert best.layout.cp > 1 and best.iteration_s < without.iteration_s
    assert best.time.tp_comm < without.time.tp_comm  # what CP saves: the TP collectives of a wide TP group


def test_spans_follow_megatrons_tp_cp_dp_pp_order():
    """A CP group spans tp x cp ranks and a DP group tp x cp x dp: past 8 per node they take the inter-node bus."""
    setup = setup_of(seq=65536)
    fast_inside = H100.model_copy(update={"inter_node_bus_bytes_per_s": 1e9})  # NVLink inside, 1 GB/s across
    inside, across = Layout(tp=2, cp=4), Layout(tp=2, cp=8)
    for layout, bus in ((inside, fast_inside.intra_node_bus_bytes_per_s), (across, 1e9)):
        step_s, attention_s = _ring_by_hand(setup, layout, bus)
        forward, _ = cp_comm_times(LLAMA, fast_inside, setup, layout, RATE * layout.tp * layout.cp)
        assert forward == pytest.approx((layout.cp - 1) * max(0.0, step_s - attention_s))
    assert cp_comm_times(LLAMA, fast_inside, setup, across, RATE * 16)[0] > 0
    # gradients reduce over dp x cp ranks spaced tp apart: 2 x 4 inside a node, 2 x 8 across
    within = dp_comm_parts(LLAMA, fast_inside, setup, Layout(dp=2, cp=4), 0)
    beyond = dp_comm_parts(LLAMA, fast_inside, setup, Layout(dp=2, cp=8), 0)
    assert beyond.reduce_s > 50 * within.reduce_s
