"""``PolicyController``: its decisions follow typed causes, never the words of a message."""

import dataclasses
from pathlib import Path

import pytest

from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Decision, Policy
from chameleon_dist.policy.scaling import grown
from chameleon_dist.policy.selection import (
    MAX_IN_PLACE_TIGHTENINGS,
    IterationOutcome,
    PolicyController,
    RetryAction,
)
from chameleon_dist.trace.stages import RetryCause, Stage, Transition, TransitionCause
from chameleon_dist.trace.swap_figures import SwapFigures
from chameleon_dist.trace.step_trace import StepTrace

MIB = 2**20


def _controller() -> PolicyController:
    return PolicyController(PolicySettings(budget_bytes=100 * MIB, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9))


def _policy(name: str = "p", feasible: bool = True) -> Policy:
    return Policy(name=name, budget_bytes=100 * MIB, feasible=feasible, predicted_peak_bytes=90 * MIB,
                  no_swap_peak_bytes=120 * MIB, predicted_stall_s=0.0, predicted_recompute_s=0.0,
                  predicted_iteration_s=0.1, compute_s=0.1, entries=[], layers=[], num_ops=10,
                  trace_iteration=1, settings={})


def _outcome(stage: Stage, policy: Policy | None, peak_mib: float, passive_swaps: int = 0, oom_retries: int = 0,
             iteration: int = 1) -> IterationOutcome:
    return IterationOutcome(iteration=iteration, stage=stage, policy=policy, peak_device_bytes=int(peak_mib * MIB),
                            iteration_s=0.1, stall_s=0.0, attempt_stall_s=0.0,
                            swaps=SwapFigures(passive_swaps=passive_swaps),
                            oom_retries=oom_retries, profiled=stage == Stage.WARMUP)


def _chosen(controller: PolicyController, policy: Policy) -> None:
    """Run ``policy`` through one held trial and the move to Stable."""
    controller.candidates = [policy]
    controller.record(_outcome(Stage.GEN_POLICY, policy, 90))
    controller.follow(Transition(Stage.GEN_POLICY, Stage.STABLE, TransitionCause.TRIALS_DONE, "trials done"), _outcome(Stage.GEN_POLICY, policy, 90))
    assert controller.chosen is policy and controller.version == 1


@pytest.mark.parametrize("reason", ["", "anything at all", "peak above memory_budget"])
def test_the_cause_not_the_reason_decides_whether_policies_tighten(reason):
    controller = _controller()
    policy = _policy()
    _chosen(controller, policy)
    stable = _outcome(Stage.STABLE, policy, 90)
    controller.follow(Transition(Stage.STABLE, Stage.WARMUP, TransitionCause.SEQUENCE_CHANGED, reason), stable)
    assert controller.reserve_bytes == 0, "a sequence change is not a policy that failed, whatever its text says"
    controller.follow(Transition(Stage.STABLE, Stage.WARMUP, TransitionCause.OVER_BUDGET, reason), stable)
    assert controller.reserve_bytes > 0


def test_a_passive_swap_tightens_only_when_the_completed_attempt_needed_it():
    controller = _controller()
    policy = _policy()
    passive = Transition(Stage.STABLE, Stage.WARMUP, TransitionCause.PASSIVE_SWAP, "1 passive swap(s)")
    controller.follow(passive, _outcome(Stage.STABLE, policy, 90, passive_swaps=0, oom_retries=1))
    assert controller.reserve_bytes == 0, "the failed attempt's retry already tightened"
    controller.follow(passive, _outcome(Stage.STABLE, policy, 90, passive_swaps=2))
    assert controller.reserve_bytes > 0


def test_a_stable_peak_over_budget_is_reported_and_a_held_one_is_not():
    controller = _controller()
    policy = _policy()
    _chosen(controller, policy)
    assert controller.record(_outcome(Stage.STABLE, policy, 99)).restart is None
    verdict = controller.record(_outcome(Stage.STABLE, policy, 101))
    assert verdict.restart == TransitionCause.OVER_BUDGET
    reason = verdict.reason
    assert "above memory_budget" in reason and policy.name in reason


def test_warmup_keeps_the_chosen_policy_only_while_it_holds_without_help():
    controller = _controller()
    policy = _policy()
    _chosen(controller, policy)
    assert controller.policy_for(Stage.WARMUP, None, 0) is policy
    controller.record(_outcome(Stage.WARMUP, policy, 95, passive_swaps=1))
    assert controller.policy_for(Stage.WARMUP, None, 0) is None
    controller.record(_outcome(Stage.WARMUP, None, 80))
    assert controller.policy_for(Stage.WARMUP, None, 0) is policy
    assert controller.policy_for(Stage.STABLE, None, 0) is policy


def test_what_a_policy_must_stay_under_is_the_budget_or_the_swap_everything_peak():
    controller = _controller()
    assert controller.allowed_peak_bytes == 100 * MIB
    controller.record(_outcome(Stage.WARMUP, None, 110, oom_retries=1))
    assert controller.allowed_peak_bytes == 100 * MIB, "a retried iteration's peak is not the executor's"
    controller.record(_outcome(Stage.WARMUP, None, 110))
    assert controller.allowed_peak_bytes == 110 * MIB


def test_out_of_memory_retry_actions():
    controller = _controller()
    failed = _policy(feasible=False)
    assert controller.on_out_of_memory(failed, refused_bytes=5, min_swap_bytes=MIB) == RetryAction(
        RetryCause.POLICY_FAILED, MIB, swap_everything=True)
    assert controller.reserve_bytes > 0
    assert controller.on_out_of_memory(None, refused_bytes=5, min_swap_bytes=MIB) == RetryAction(
        RetryCause.HOST_BUDGET_FULL, MIB, wait_for_host=True)
    assert controller.on_out_of_memory(None, refused_bytes=0, min_swap_bytes=0) == RetryAction(
        RetryCause.EVERYTHING_SWAPPED, 0)
    assert controller.on_out_of_memory(None, refused_bytes=0, min_swap_bytes=MIB) == RetryAction(
        RetryCause.SMALL_TENSORS_KEPT, MIB // 16)
    # divided by MIN_SWAP_DIVISOR (16), and 0 below 1 KiB
    assert controller.on_out_of_memory(None, refused_bytes=0, min_swap_bytes=16 * 1023).min_swap_bytes == 0


def test_trials_that_all_failed_leave_no_policy_chosen():
    controller = _controller()
    policy = _policy()
    controller.candidates = [policy]
    outcome = _outcome(Stage.GEN_POLICY, policy, 90, passive_swaps=1)
    controller.record(outcome)
    assert [r.held for r in controller.results] == [False]
    controller.follow(Transition(Stage.GEN_POLICY, Stage.STABLE, TransitionCause.TRIALS_DONE, ""), outcome)
    assert controller.chosen is None and controller.version == 0
    assert controller.policy_for(Stage.STABLE, None, 0) is None


def test_the_profiled_iterations_stall_is_kept_for_the_next_generation():
    controller = _controller()
    controller.record(IterationOutcome(iteration=4, stage=Stage.WARMUP, policy=None, peak_device_bytes=0,
                                       iteration_s=1.0, stall_s=0.5, attempt_stall_s=0.25, oom_retries=1,
                                       profiled=True))
    assert dict(controller.trace_stall_s) == {4: 0.25}
    with pytest.raises(TypeError):
        controller.trace_stall_s[5] = 1.0  # read-only


# ---- Stable survives jitter; new shapes are scaled for first (issue 12) ----------------------------------
DATA = Path(__file__).resolve().parent / "data"
JOB_BUDGET = 80 * MIB


def _stable_on_the_job_trace(capacity_bytes: int | None, trial_peaks_mib=(70, 76, 78)) -> tuple[PolicyController, Policy]:
    """A controller that generated policies from the main job's trace, tried some and chose one."""
    trace = StepTrace.load(DATA / "job_trace.json")
    settings = PolicySettings(budget_bytes=JOB_BUDGET, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, min_swap_bytes=MIB)
    controller = PolicyController(settings, capacity_bytes=capacity_bytes)
    warmup = IterationOutcome(iteration=trace.iteration, stage=Stage.WARMUP, policy=None,
                              peak_device_bytes=JOB_BUDGET, iteration_s=trace.iteration_s, stall_s=0.0,
                              attempt_stall_s=0.0, oom_retries=0, profiled=True, saved_bytes=100 * MIB)
    controller.record(warmup)
    controller.follow(Transition(Stage.WARMUP, Stage.GEN_POLICY, TransitionCause.PROFILED, ""), warmup)
    assert controller.policy_for(Stage.GEN_POLICY, trace, MIB) is not None  # generates
    controller.results = []
    for peak_mib in trial_peaks_mib:
        policy = controller.policy_for(Stage.GEN_POLICY, trace, MIB)
        assert policy is not None and policy.feasible
        controller.record(dataclasses.replace(_outcome(Stage.GEN_POLICY, policy, peak_mib), saved_bytes=100 * MIB))
    if trial_peaks_mib:
        controller.follow(Transition(Stage.GEN_POLICY, Stage.STABLE, TransitionCause.TRIALS_DONE, ""), warmup)
        assert controller.chosen is not None
    return controller, controller.chosen


def _stable(policy: Policy, peak_bytes: int, passive_swaps: int = 0, saved_mib: int = 100) -> IterationOutcome:
    return IterationOutcome(iteration=20, stage=Stage.STABLE, policy=policy, peak_device_bytes=peak_bytes,
                            iteration_s=0.1, stall_s=0.0, attempt_stall_s=0.0,
                            swaps=SwapFigures(passive_swaps=passive_swaps), oom_retries=0,
                            profiled=False, saved_bytes=saved_mib * MIB)


def test_the_chosen_policy_keeps_headroom_for_the_trials_peak_variation():
    """The slow policy's peak moved by 2 MiB between its two trials (jitter): the fast one, which peaked
    1 MiB under the budget, has less room than that, so the slow one is chosen."""
    controller, _ = _stable_on_the_job_trace(capacity_bytes=None, trial_peaks_mib=())
    fast, slow = controller.candidates[:2]
    controller.results = []
    trials = ((fast, JOB_BUDGET - MIB, 0.1), (slow, JOB_BUDGET - 6 * MIB, 0.2), (slow, JOB_BUDGET - 4 * MIB, 0.2))
    for policy, peak_bytes, seconds in trials:
        outcome = dataclasses.replace(_outcome(Stage.GEN_POLICY, policy, 0), peak_device_bytes=peak_bytes,
                                      iteration_s=seconds)
        controller.record(outcome)
    assert all(r.held for r in controller.results)
    controller.follow(Transition(Stage.GEN_POLICY, Stage.STABLE, TransitionCause.TRIALS_DONE, ""), outcome)
    assert controller.headroom_bytes == 2 * MIB
    assert controller.chosen is slow, "the faster trial had no headroom"


def test_prediction_errors_across_policies_are_not_headroom():
    """A policy predicted far off (swap everything on a slow link: predicted over the budget, measured well
    under it) says nothing about jitter: each policy tried once leaves no headroom, the fastest that held wins."""
    controller, _ = _stable_on_the_job_trace(capacity_bytes=None, trial_peaks_mib=())
    fast, slow = controller.candidates[:2]
    controller.results = []
    for policy, peak_bytes, seconds in ((fast, JOB_BUDGET - MIB // 4, 0.1),
                                        (slow, slow.predicted_peak_bytes - 8 * MIB, 0.9)):
        outcome = dataclasses.replace(_outcome(Stage.GEN_POLICY, policy, 0), peak_device_bytes=peak_bytes,
                                      iteration_s=seconds)
        controller.record(outcome)
    controller.follow(Transition(Stage.GEN_POLICY, Stage.STABLE, TransitionCause.TRIALS_DONE, ""), outcome)
    assert controller.headroom_bytes == 0 and controller.chosen is fast


def test_a_stable_overshoot_within_the_capacity_tightens_in_place_then_is_kept():
    """(Until issue 27: the overshoot after the last in-place tightening profiled again. A peak within the
    capacity with nothing passively swapped is variance, and profiling again finds the same policies.)"""
    controller, chosen = _stable_on_the_job_trace(capacity_bytes=JOB_BUDGET + 8 * MIB)
    version, reserve = controller.version, controller.reserve_bytes
    policy = chosen
    for k in range(MAX_IN_PLACE_TIGHTENINGS):
        verdict = controller.record(_stable(policy, JOB_BUDGET + MIB))
        assert verdict.restart is None, "absorbed: Stable goes on"
        assert verdict.tightened_in_place and controller.version == version + k + 1
        assert controller.chosen is not policy and controller.chosen.feasible
        assert controller.reserve_bytes >= reserve + (2**k) * MIB, "the shortfall is added to the reduction"
        policy, reserve = controller.chosen, controller.reserve_bytes
    verdict = controller.record(_stable(policy, JOB_BUDGET + MIB))
    assert verdict.restart is None and not verdict.tightened_in_place, "within the capacity, no passive swap: kept"
    assert controller.chosen is policy
    verdict = controller.record(_stable(policy, JOB_BUDGET + MIB, passive_swaps=1))
    assert verdict.restart == TransitionCause.PASSIVE_SWAP, "a passive swap still profiles again"


def test_with_no_capacity_known_a_repeated_stable_overshoot_profiles_again():
    controller, chosen = _stable_on_the_job_trace(capacity_bytes=None)
    policy = chosen
    for _ in range(MAX_IN_PLACE_TIGHTENINGS):
        assert controller.record(_stable(policy, JOB_BUDGET + MIB)).tightened_in_place
        policy = controller.chosen
    verdict = controller.record(_stable(policy, JOB_BUDGET + MIB))
    assert verdict.restart == TransitionCause.OVER_BUDGET and "above memory_budget" in verdict.reason


def test_a_stable_overshoot_above_the_capacity_or_with_a_passive_swap_is_not_absorbed():
    controller, chosen = _stable_on_the_job_trace(capacity_bytes=JOB_BUDGET + MIB // 2)
    assert "above memory_budget" in controller.record(_stable(chosen, JOB_BUDGET + MIB)).reason
    controller, chosen = _stable_on_the_job_trace(capacity_bytes=JOB_BUDGET + 8 * MIB)
    verdict = controller.record(_stable(chosen, JOB_BUDGET + MIB, passive_swaps=1))
    # (was: the over-budget reason, then the stage machine took the passive swap first; now one verdict)
    assert verdict.restart == TransitionCause.PASSIVE_SWAP and not verdict.tightened_in_place
    assert controller.chosen is chosen and not verdict.absorbed_passive_swaps


def test_a_new_larger_shape_is_scaled_for_before_profiling_again():
    controller, chosen = _stable_on_the_job_trace(capacity_bytes=JOB_BUDGET + 8 * MIB)
    # the same saved bytes: a passive swap is the policy's failure, and the runtime profiles again
    verdict = controller.record(_stable(chosen, JOB_BUDGET, passive_swaps=2))
    assert verdict.restart == TransitionCause.PASSIVE_SWAP
    assert not verdict.absorbed_passive_swaps and controller.chosen is chosen
    # 30% more saved bytes (a longer sequence): a policy from the trace grown alike, at once
    verdict = controller.record(_stable(chosen, JOB_BUDGET, passive_swaps=2, saved_mib=130))
    assert verdict.restart is None
    assert verdict.absorbed_passive_swaps == 2 and controller.chosen is not chosen
    scaled = controller.chosen
    assert scaled.saved_bytes(Decision.SWAP) > chosen.saved_bytes(Decision.SWAP), "more leaves the device"
    # it failed on that shape too: now the runtime profiles again
    verdict = controller.record(_stable(scaled, JOB_BUDGET, passive_swaps=1, saved_mib=130))
    assert verdict.restart == TransitionCause.PASSIVE_SWAP
    assert not verdict.absorbed_passive_swaps


def test_a_grown_trace_grows_what_the_iteration_allocated_and_nothing_else():
    trace = StepTrace.load(DATA / "job_trace.json")
    bigger = grown(trace, 1.5)
    assert bigger.start_live_bytes == trace.start_live_bytes
    for before, after in zip(trace.storages, bigger.storages):
        if before.is_parameter or before.created_at < 0 or before.freed_at < 0:
            assert after.nbytes == before.nbytes
        else:
            assert after.nbytes == round(before.nbytes * 1.5)
    base, more = trace.no_swap_memory_curve(), bigger.no_swap_memory_curve()
    assert max(more) > max(base) and all(m >= b for m, b in zip(more, base))
    assert max(more) - trace.start_live_bytes <= 1.5 * (max(base) - trace.start_live_bytes) + 1
    assert grown(trace, 1.0) is trace


def test_a_trial_that_ran_out_of_memory_is_fed_back_and_the_trials_go_on():
    """(Issue 27, item 3: before, its failed attempt's passive swaps sent the runtime back to WarmUp, which
    profiled the same program again: a transformers Llama at 1.15x its swap floor cycled WWGGWWGGGWWGG...
    with 6 out-of-memory retries; now WWGGGGG and Stable, 1 retry.)"""
    controller, _ = _stable_on_the_job_trace(capacity_bytes=JOB_BUDGET + 8 * MIB, trial_peaks_mib=())
    policy = controller.candidates[0]
    controller.results = []
    reserve = controller.reserve_bytes
    controller.on_out_of_memory(policy, refused_bytes=0, min_swap_bytes=MIB)  # the retry swaps everything
    trial = dataclasses.replace(_outcome(Stage.GEN_POLICY, policy, 0), peak_device_bytes=JOB_BUDGET - MIB,
                                swaps=SwapFigures(passive_swaps=2), oom_retries=1, failed_attempt_passive_swaps=5,
                                passive_swap_bytes=2 * MIB)
    verdict = controller.record(trial)
    assert verdict.restart is None, verdict.reason
    assert not controller.results[-1].held and controller.reserve_bytes > reserve, "stricter next trials"
    stable = dataclasses.replace(trial, stage=Stage.STABLE)
    assert controller.record(stable).restart == TransitionCause.PASSIVE_SWAP, "outside GenPolicy it still restarts"
