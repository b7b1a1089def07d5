"""``PolicyController``: its decisions follow typed causes, never the words of a message."""

import pytest

from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.selection import IterationOutcome, PolicyController, RetryAction
from chameleon_dist.trace.stages import Stage, Transition, TransitionCause

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
    return IterationOutcome(iteration=iteration, stage=stage, policy=policy, peak_bytes=int(peak_mib * MIB),
                            iteration_s=0.1, stall_s=0.0, attempt_stall_s=0.0, passive_swaps=passive_swaps,
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
    assert controller.record(_outcome(Stage.STABLE, policy, 99)) == ""
    reason = controller.record(_outcome(Stage.STABLE, policy, 101))
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
    assert controller.on_out_of_memory(failed, refused_bytes=5, min_swap_bytes=MIB) == RetryAction.SWAP_EVERYTHING
    assert controller.reserve_bytes > 0
    assert controller.on_out_of_memory(None, refused_bytes=5, min_swap_bytes=MIB) == RetryAction.WAIT_FOR_HOST
    assert controller.on_out_of_memory(None, refused_bytes=0, min_swap_bytes=0) == RetryAction.RETRY_AS_IS
    assert controller.on_out_of_memory(None, refused_bytes=0, min_swap_bytes=MIB) == RetryAction.LOWER_MIN_SWAP


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
    controller.record(IterationOutcome(iteration=4, stage=Stage.WARMUP, policy=None, peak_bytes=0, iteration_s=1.0,
                                       stall_s=0.5, attempt_stall_s=0.25, passive_swaps=0, oom_retries=1,
                                       profiled=True))
    assert dict(controller.trace_stall_s) == {4: 0.25}
    with pytest.raises(TypeError):
        controller.trace_stall_s[5] = 1.0  # read-only
