"""Policy generator and simulator: hand-checked cases, properties over generated traces, JSON, golden."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chameleon_dist.policy import (
    Decision,
    Infeasibility,
    Planned,
    Policy,
    PolicySettings,
    calibrated_group_times_s,
    find_candidates,
    generate_policies,
    logical_layers,
    simulate,
)
from chameleon_dist.trace.step_trace import StepTrace

from tests.policy_traces import layered_trace

DATA = Path(__file__).resolve().parent / "data"


def _settings(budget, bw=1e6, **kw):
    return PolicySettings(budget_bytes=budget, d2h_bytes_per_s=bw, h2d_bytes_per_s=bw, **kw)


# ---- simulator, by hand ---------------------------------------------------------------------------
def test_simulator_releases_only_after_the_copy_and_charges_late_prefetch_as_stall():
    # 6 ops of 1 s; a 2-byte tensor leaves after op 0 over a 1 B/s link (2 s), last forward use op 1,
    # first backward use op 5, swap-in issued at the start of op 4 (2 s copy, 1 s of compute to hide it)
    base = [10, 10, 10, 10, 10, 10]
    p = Planned(2, Decision.SWAP, last_forward_use=1, first_backward_use=5, swap_out_at=0, swap_in_at=4)
    sim = simulate(base, [1.0] * 6, [p], d2h_bytes_per_s=1.0, h2d_bytes_per_s=1.0)
    out = sim.outcomes[0]
    assert out.out_done_s == 3.0  # issued at t=1 (end of op 0), 2 s
    assert out.release_at == 2  # op 1 ends at t=2 < 3; op 2 ends at t=3
    assert sim.curve == [10, 10, 10, 8, 10, 10]  # off after op 2, back at the start of op 4
    assert out.in_done_s == 6.0 and sim.stall_s == 1.0  # op 5 could start at t=5
    assert sim.iteration_s == 7.0 and sim.peak_bytes == 10


def test_swap_in_before_release_copies_nothing():
    p = Planned(4, Decision.SWAP, last_forward_use=0, first_backward_use=3, swap_out_at=0, swap_in_at=1)
    sim = simulate([5, 5, 5, 5], [1.0] * 4, [p], d2h_bytes_per_s=1.0, h2d_bytes_per_s=1.0)
    assert sim.outcomes[0].kept and not sim.outcomes[0].released
    assert sim.curve == [5, 5, 5, 5] and sim.stall_s == 0.0


def test_recompute_frees_after_last_forward_use_and_costs_the_producer():
    p = Planned(3, Decision.RECOMPUTE, last_forward_use=0, first_backward_use=3, recompute_s=0.5)
    sim = simulate([9, 9, 9, 9], [1.0] * 4, [p], 1.0, 1.0)
    assert sim.curve == [9, 6, 6, 9]
    assert sim.iteration_s == 4.5 and sim.recompute_s == 0.5


# ---- layers and timing ----------------------------------------------------------------------------
def test_logical_layers_follow_transformer_layers_forward_and_backward():
    trace = layered_trace([[4, 4], [4, 4], [4, 4]], micro_batches=2)
    groups, rule = logical_layers(trace)
    assert rule == "module"
    assert [g.start for g in groups] == sorted(g.start for g in groups)
    assert sum(g.num_ops for g in groups) == len(trace.ops)
    fwd = [(g.micro_batch, g.layer) for g in groups if g.phase == "forward"]
    bwd = [(g.micro_batch, g.layer) for g in groups if g.phase == "backward"]
    assert fwd == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert bwd == [(0, 2), (0, 1), (0, 0), (1, 2), (1, 1), (1, 0)]


def test_calibration_uses_measured_layer_times_and_keeps_the_total():
    trace = layered_trace([[4, 4], [4, 4]], iteration_s=10.0)
    groups, _ = logical_layers(trace)
    trace.layer_times_s = {0: 3.0, 1: 1.0}
    times = calibrated_group_times_s(trace, groups)
    assert sum(times) == pytest.approx(10.0)
    fwd = {g.layer: t for g, t in zip(groups, times) if g.phase == "forward"}
    assert fwd == {0: pytest.approx(3.0), 1: pytest.approx(1.0)}
    bwd = {g.layer: t for g, t in zip(groups, times) if g.phase == "backward"}
    assert bwd[0] == pytest.approx(3 * bwd[1])  # a heavy layer's backward is heavy too


# ---- generator ------------------------------------------------------------------------------------
def test_no_policy_needed_when_the_trace_fits():
    trace = layered_trace([[100, 100]] * 3)
    result = generate_policies(trace, _settings(10**9))
    assert result.feasible and result.best.entries == []


def test_infeasible_budget_names_the_shortfall_and_the_setting():
    trace = layered_trace([[100, 100]] * 3, static_bytes=1000)
    result = generate_policies(trace, _settings(900))  # below the static bytes: nothing can fit
    best = result.best
    assert not result.feasible and best.shortfall_bytes > 0
    assert "memory_budget" in best.reason and "short by" in best.reason
    assert "DOES NOT FIT" in best.summary()
    assert best.infeasibility == Infeasibility.NO_SWAPPABLE_AT_PEAK  # only static bytes are live at the peak


@pytest.mark.parametrize("budget, bw, min_swap_bytes, host_budget_bytes, cause, words", [
    (9000, 1e9, 2000, None, Infeasibility.SWAP_FLOOR_ABOVE_BUDGET, "even with every candidate off the device"),
    (12000, 1.0, 0, None, Infeasibility.LINK_TOO_SLOW, "cannot move enough in time"),
    (12000, 1.0, 0, 1000, Infeasibility.HOST_BUDGET, "host_memory_budget kept"),
])
def test_infeasibility_is_typed_beside_the_reason(budget, bw, min_swap_bytes, host_budget_bytes, cause, words):
    trace = layered_trace([[1000, 3000, 500]] * 4, micro_batches=2, static_bytes=500)
    # (swap only: with recomputation the slow link is no longer a reason, see test_recompute.py)
    config = _settings(budget, bw=bw, min_swap_bytes=min_swap_bytes, host_budget_bytes=host_budget_bytes,
                       allow_recompute=False)
    best = generate_policies(trace, config).best
    assert not best.feasible and best.infeasibility == cause and words in best.reason
    assert Policy.from_dict(json.loads(best.to_json())).infeasibility == cause


def test_slow_link_turns_unhideable_swaps_into_exact_recomputes_only():
    sizes = [[400, 400, 400]] * 4
    # the first op of each layer reads only a parameter (exact to recompute); name 4 (dropout) draws random
    # numbers and must never be recomputed
    names = [[0, 1, 4]] * 4
    trace = layered_trace(sizes, producer_names=names, static_bytes=100, iteration_s=1.0)
    result = generate_policies(trace, _settings(3000, bw=1.0, min_swap_bytes=1))
    kinds = {e.decision for p in result.policies for e in p.entries}
    assert Decision.RECOMPUTE in kinds
    for policy in result.policies:
        for e in policy.entries:
            if e.decision == Decision.RECOMPUTE:
                assert trace.op_names[trace.ops[e.save_op_index - 1].name_id] != "aten.native_dropout.default"


def test_policy_json_round_trip_and_summary(tmp_path):
    trace = layered_trace([[1000, 3000, 500]] * 4, micro_batches=2, static_bytes=500)
    policy = generate_policies(trace, _settings(12000, bw=1e5)).best
    assert policy.entries
    again = Policy.load(policy.save(tmp_path / "p.json"))
    assert again == policy
    assert all(isinstance(e.decision, Decision) for e in again.entries)
    assert {row[0] for row in json.loads(policy.to_json())["entries"]} <= {"swap", "recompute"}  # strings on disk
    data = json.loads(policy.to_json())
    data["schema_version"] = 99
    with pytest.raises(ValueError, match="schema version"):
        Policy.from_dict(data)
    text = policy.summary()
    assert "predicted peak" in text and "stall" in text and "layer" in text


def test_policy_files_written_before_the_renames_still_load():
    # older files name the first backward use "first_use_at" and have no "infeasibility"
    trace = layered_trace([[1000, 3000, 500]] * 4, micro_batches=2, static_bytes=500)
    policies = generate_policies(trace, _settings(12000, bw=1.0, allow_recompute=False)).policies
    policy = next(p for p in policies if p.entries)
    assert policy.infeasibility is not None
    data = json.loads(policy.to_json())
    del data["infeasibility"]
    data["entry_fields"] = ["first_use_at" if f == "first_backward_use" else f for f in data["entry_fields"]]
    old = Policy.from_dict(data)
    assert old.infeasibility is None and old.reason == policy.reason
    assert old.entries == policy.entries
    assert [e.first_backward_use for e in old.entries] == [e.first_backward_use for e in policy.entries]
    golden = Policy.from_dict(json.loads((DATA / "job_policies_60mib.json").read_text())[0])
    assert golden.entries and all(e.first_backward_use > e.last_forward_use for e in golden.entries)


def test_trials_give_distinct_policies_fastest_feasible_first():
    trace = layered_trace([[1000, 3000, 500, 2000]] * 6, micro_batches=2, static_bytes=500)
    result = generate_policies(trace, _settings(16000, bw=2e5, trials=5))
    assert 1 <= len(result.policies) <= 5
    keys = {tuple((e.save_ordinal, e.decision, e.swap_out_at, e.swap_in_at) for e in p.entries) for p in result.policies}
    assert len(keys) == len(result.policies)
    feasible = [p for p in result.policies if p.feasible]
    assert feasible and result.best is feasible[0]
    assert [p.predicted_iteration_s for p in feasible] == sorted(p.predicted_iteration_s for p in feasible)


def test_parameters_and_preexisting_storages_are_never_candidates():
    trace = layered_trace([[100, 100]] * 2)
    trace.storages[trace.tensors[1].storage_id].created_at = -1  # existed before the iteration
    ids = {c.storage_id for c in find_candidates(trace)}
    assert 0 not in ids and trace.tensors[1].storage_id not in ids and ids


# ---- properties -------------------------------------------------------------------------------------
def _curve_from_entries(base_curve: list[int], entries) -> list[int]:
    """Live bytes per op as a policy's entries say: an entry released at the end of op ``release_at`` is
    off the device from the next op until its swap-in is issued (swap) or its first backward use
    (recompute); an entry never released (``release_at == -1``) never leaves."""
    off = [0] * (len(base_curve) + 1)
    for e in entries:
        if e.release_at < 0:
            continue
        swap_in = e.decision == Decision.SWAP and 0 <= e.swap_in_at <= e.first_backward_use
        off[e.release_at + 1] += e.nbytes
        off[e.swap_in_at if swap_in else e.first_backward_use] -= e.nbytes
    curve, running = [], 0
    for live, change in zip(base_curve, off):
        running += change
        curve.append(live - running)
    return curve


layer_sizes = st.lists(st.integers(min_value=0, max_value=5000), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(layer_sizes, min_size=1, max_size=6),
    micro_batches=st.integers(1, 3),
    budget_fraction=st.floats(0.2, 1.2),
    bw=st.sampled_from([1e3, 1e4, 1e5, 1e7]),
    recompute=st.booleans(),
)
# found by Hypothesis in a full run: a swap-in placed after the entry's first backward use
@example(sizes=[[1, 1, 1, 2270, 3409], [0, 0], [2273, 2273], [0], [0]], micro_batches=2, budget_fraction=0.25,
         bw=1e5, recompute=True)
def test_policy_properties(sizes, micro_batches, budget_fraction, bw, recompute):
    trace = layered_trace(sizes, micro_batches=micro_batches, static_bytes=300, iteration_s=0.5)
    no_swap_peak = max(trace.no_swap_memory_curve())
    budget = max(1, int(no_swap_peak * budget_fraction))
    config = _settings(budget, bw=bw, allow_recompute=recompute)
    result = generate_policies(trace, config)
    again = generate_policies(trace, config)
    assert [p.to_json() for p in result.policies] == [p.to_json() for p in again.policies]  # deterministic
    groups, _ = logical_layers(trace)
    op_times = [t / g.num_ops for g, t in zip(groups, calibrated_group_times_s(trace, groups)) for _ in range(g.num_ops)]
    for policy in result.policies:
        if not policy.feasible:
            assert policy.shortfall_bytes == policy.predicted_peak_bytes - budget > 0 and policy.reason
        assert (policy.infeasibility is None) == policy.feasible
        # the entries as written (release points included), read without the simulator, give the predicted
        # peak; where a policy says it fits, what it takes off the device covers every op's excess
        curve = _curve_from_entries(trace.no_swap_memory_curve(), policy.entries)
        assert max(curve) == policy.predicted_peak_bytes
        if policy.feasible:
            assert all(live <= budget for live in curve)
        planned = [Planned(e.nbytes, e.decision, e.last_forward_use, e.first_backward_use, e.swap_out_at, e.swap_in_at,
                           e.recompute_s) for e in policy.entries]
        sim = simulate(trace.no_swap_memory_curve(), op_times, planned, bw, bw)
        assert sim.peak_bytes == policy.predicted_peak_bytes  # the policy says what its replay does
        assert sim.peak_bytes <= no_swap_peak
        for e, o in zip(policy.entries, sim.outcomes):
            assert e.release_at == (o.release_at if o.released else -1)
            assert e.last_forward_use < e.first_backward_use
            if e.decision == Decision.SWAP:
                assert e.last_forward_use < e.swap_in_at <= e.first_backward_use  # prefetch before use, after release
                if o.released:
                    assert sim.op_end_s[o.release_at] >= o.out_done_s  # never freed before its copy is done
                    assert o.release_at >= e.last_forward_use and o.release_at < e.swap_in_at
                    assert o.in_done_s <= sim.op_end_s[e.first_backward_use]
            else:
                assert recompute


# ---- golden: the main job's model ------------------------------------------------------------------
GOLDEN_BUDGETS_MIB = (100, 80, 60)


@pytest.mark.parametrize("budget_mib", GOLDEN_BUDGETS_MIB)
def test_golden_policies_for_the_main_job_model(budget_mib):
    trace = StepTrace.load(DATA / "job_trace.json")
    result = generate_policies(trace, golden_settings(budget_mib))
    golden = json.loads((DATA / f"job_policies_{budget_mib}mib.json").read_text())
    assert [json.loads(p.to_json()) for p in result.policies] == golden, (
        "policy generation changed; if intended, regenerate with `python -m tests.test_policy`"
    )


def golden_settings(budget_mib: int) -> PolicySettings:
    # the job's emulated link (configs/jobs/train_gpt_cpu.yaml) and swap floor
    return PolicySettings(budget_bytes=budget_mib * 2**20, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9,
                          min_swap_bytes=2**20)


if __name__ == "__main__":  # python -m tests.test_policy: regenerate the golden files from tests/data/job_trace.json
    trace = StepTrace.load(DATA / "job_trace.json")
    for mib in GOLDEN_BUDGETS_MIB:
        policies = generate_policies(trace, golden_settings(mib)).policies
        (DATA / f"job_policies_{mib}mib.json").write_text(json.dumps([json.loads(p.to_json()) for p in policies], indent=1))
        print(policies[0].summary())
