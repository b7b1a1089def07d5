"""Ranking GenPolicy trials with a noise margin (issue 37 item 6, ``policy.ranking``): within
``profiler.trial_margin`` of the fastest the policy that swaps less wins, a close pair is tried again (up to
``profiler.trial_repeats`` extra GenPolicy iterations), a clearly faster policy wins however much it swaps, and
swapping everything is kept only when clearly faster. Synthetic trial times, no timing of this machine."""

from __future__ import annotations

import pytest

from chameleon_dist.config import ConfigError, load_config
from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Decision, Policy, PolicyEntry
from chameleon_dist.policy.ranking import Standing, TrialRanking, rank, standings
from chameleon_dist.policy.selection import IterationOutcome, PolicyController
from chameleon_dist.policy.trials import TrialResult
from chameleon_dist.profiler.stages import StageMachine
from chameleon_dist.trace.stages import Stage, Transition, TransitionCause, Verdict

MIB = 2**20
BUDGET = 100 * MIB


def _entry(nbytes: int, ordinal: int) -> PolicyEntry:
    return PolicyEntry(decision=Decision.SWAP, nbytes=nbytes, micro_batch=0, layer=0, group=0, save_ordinal=ordinal,
                       layer_save_ordinal=ordinal, save_op_index=ordinal, calling_op="aten::mm", arg_position=0,
                       dtype="float32", shape=(nbytes // 4,), tensor_nbytes=nbytes, swap_out_at=ordinal,
                       last_forward_use=ordinal, release_at=ordinal, swap_in_at=ordinal + 10,
                       first_backward_use=ordinal + 10)


def _policy(name: str, swap_mib: int) -> Policy:
    """A policy predicted to fit that swaps ``swap_mib`` MiB (in 1 MiB tensors)."""
    return Policy(name=name, budget_bytes=BUDGET, feasible=True, predicted_peak_bytes=90 * MIB,
                  no_swap_peak_bytes=120 * MIB, predicted_stall_s=0.0, predicted_recompute_s=0.0,
                  predicted_iteration_s=0.1, compute_s=0.1, entries=[_entry(MIB, i) for i in range(swap_mib)],
                  layers=[], num_ops=40, trace_iteration=1, settings={})


def _controller(trials: int, ranking: TrialRanking | None = None) -> PolicyController:
    settings = PolicySettings(budget_bytes=BUDGET, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, trials=trials)
    return PolicyController(settings, ranking=ranking) if ranking is not None else PolicyController(settings)


def _outcome(stage: Stage, policy: Policy | None, iteration_s: float, iteration: int) -> IterationOutcome:
    return IterationOutcome(iteration=iteration, stage=stage, policy=policy, peak_device_bytes=90 * MIB,
                            iteration_s=iteration_s, stall_s=0.0, attempt_stall_s=0.0,
                            oom_retries=0, profiled=False)


def _gen_policy(controller: PolicyController, candidates: list[Policy], times_s, trials: int,
                swap_all_s: float | None = None) -> list[str]:
    """Drive ``controller`` as the runtime does, through a real ``StageMachine``, from GenPolicy to Stable:
    ``times_s(policy name, its trial number)`` is each trial's measured time. The names tried, in order."""
    if swap_all_s is not None:  # the last resort's time, measured in a WarmUp iteration that swapped everything
        controller.record(_outcome(Stage.WARMUP, None, swap_all_s, 0))
    controller.candidates = list(candidates)
    machine = StageMachine(warmup_iterations=0, policy_trials=trials)
    tried: list[str] = []
    for iteration in range(1, 20):
        assert machine.stage == Stage.GEN_POLICY
        policy = controller.policy_for(Stage.GEN_POLICY, None, 0)
        assert policy is not None
        tried.append(policy.name)
        outcome = _outcome(Stage.GEN_POLICY, policy, times_s(policy.name, tried.count(policy.name)), iteration)
        verdict = controller.record(outcome)
        transition = machine.advance(False, verdict)
        controller.follow(transition, outcome)
        if transition is not None:
            assert transition.after == Stage.STABLE and transition.cause == TransitionCause.TRIALS_DONE
            return tried
    raise AssertionError(f"GenPolicy never ended: {tried}")


def test_two_trials_within_the_margin_the_one_that_swaps_less_wins():
    """1% apart (noise, under the default 3% margin): the policy that swaps half as much is kept, not the one
    that happened to be measured faster."""
    many, few = _policy("many", 20), _policy("few", 10)
    controller = _controller(trials=2)
    _gen_policy(controller, [many, few], lambda name, n: {"many": 0.100, "few": 0.101}[name], trials=2)
    assert controller.chosen is few


def test_a_close_pair_is_tried_again_up_to_the_bound():
    """Within the margin, the fastest swaps more: the kept one is tried again first (it also measures its peak's
    variation), then the fastest, and no more than ``trial_repeats`` extra iterations; 0 repeats: none."""
    many, few = _policy("many", 20), _policy("few", 10)
    times = lambda name, n: {"many": 0.100, "few": 0.101}[name]  # noqa: E731 - the same time on every repeat
    assert _gen_policy(_controller(2), [many, few], times, trials=2) == ["many", "few", "few", "many"]
    assert _gen_policy(_controller(2, TrialRanking(0.03, 1)), [many, few], times, trials=2) == ["many", "few", "few"]
    assert _gen_policy(_controller(2, TrialRanking(0.03, 0)), [many, few], times, trials=2) == ["many", "few"]
    settled = lambda name, n: {"many": 0.100, "few": 0.099}[name]  # noqa: E731 - the fastest also swaps least
    assert _gen_policy(_controller(2), [many, few], settled, trials=2) == ["many", "few"]


def test_a_clearly_faster_trial_wins_however_much_it_swaps():
    """The pair was close (the faster one swaps more), and its repeat shows it clearly faster (its first trial
    was the noisy one): it wins, though the other swaps half as much."""
    many, few = _policy("many", 20), _policy("few", 10)
    times = lambda name, n: {("many", 1): 0.100, ("many", 2): 0.090}.get((name, n), 0.1025)  # noqa: E731
    controller = _controller(trials=2)
    assert _gen_policy(controller, [many, few], times, trials=2) == ["many", "few", "few", "many"]
    assert controller.chosen is many


def test_swapping_everything_a_little_faster_does_not_beat_a_policy():
    """Swapping everything (WarmUp) measured 1% faster than the only policy: within the margin the policy swaps
    less and is kept (tried again first); clearly faster (20%), swapping everything stays."""
    policy = _policy("p", 10)
    controller = _controller(trials=1)
    assert _gen_policy(controller, [policy], lambda name, n: 0.101, trials=1, swap_all_s=0.100) == ["p", "p", "p"]
    assert controller.chosen is policy
    controller = _controller(trials=1)
    _gen_policy(controller, [policy], lambda name, n: 0.120, trials=1, swap_all_s=0.100)
    assert controller.chosen is None


def _result(policy: Policy, iteration_s: float, held: bool = True, peak_mib: int = 90) -> TrialResult:
    return TrialResult(policy, iteration_s, peak_mib * MIB, held)


def test_rank_rules_on_standings():
    many, mid, few = _policy("many", 30), _policy("mid", 20), _policy("few", 10)
    results = [_result(many, 0.100), _result(mid, 0.102), _result(few, 0.110), _result(mid, 0.101)]
    table = standings(results)
    assert [(s.policy.name, s.iteration_s, s.trials) for s in table] == [
        ("many", 0.100, 1), ("mid", 0.101, 2), ("few", 0.110, 1)]
    ranked = rank(table, BUDGET, 0, None, margin=0.03)
    assert ranked.best.policy is mid and ranked.fastest.policy is many and ranked.contested
    assert [s.policy.name for s in ranked.close] == ["mid", "many"]  # "few" is 10% slower: out of the margin
    assert rank(table, BUDGET, 0, None, margin=0.0).best.policy is many  # no margin: the fastest
    # a trial that did not hold counts for nothing: "many"'s time is its held trial's
    failed_once = standings([_result(many, 0.100), _result(many, 0.050, held=False), _result(few, 0.102)])
    assert [(s.iteration_s, s.held) for s in failed_once] == [(0.100, True), (0.102, True)]
    assert rank(failed_once, BUDGET, 0, None, 0.03).best.policy is few
    # headroom: "many" peaked 5 MiB under the budget, less than the 10 MiB its peak may move; "few" has room
    peaks = standings([_result(many, 0.100, peak_mib=95), _result(few, 0.2, peak_mib=80)])
    ranked = rank(peaks, BUDGET, 10 * MIB, None, 0.03)
    assert ranked.best.policy is few and ranked.roomy and not ranked.contested


def test_rank_without_held_trials_keeps_nothing():
    ranked = rank([Standing(_policy("p", 1), 0.1, 90 * MIB, 1, False, 0)], BUDGET, 0, 0.05, 0.03)
    assert ranked.best is None and not ranked.swap_all_faster and not ranked.contested


def test_a_verdict_asking_for_more_trials_keeps_gen_policy():
    machine = StageMachine(warmup_iterations=0, policy_trials=1)
    assert machine.advance(False, Verdict(more_trials=True)) is None and machine.stage == Stage.GEN_POLICY
    transition = machine.advance(False, Verdict())
    assert transition == Transition(Stage.GEN_POLICY, Stage.STABLE, TransitionCause.TRIALS_DONE, transition.reason)


@pytest.mark.parametrize("field, value, expected", [
    ("trial_margin", 1.0, "profiler.trial_margin: 1.0 is not valid: input should be less than 1"),
    ("trial_margin", -0.1, "profiler.trial_margin: -0.1 is not valid"),
    ("trial_repeats", -1, "profiler.trial_repeats: -1 is not valid"),
    ("trial_repeats", 1.5, "profiler.trial_repeats: 1.5 is not valid"),
])
def test_the_ranking_settings_are_validated(field, value, expected):
    with pytest.raises(ConfigError) as caught:
        load_config({"profiler": {field: value}})
    assert str(caught.value.problems[0]).startswith(expected), caught.value.problems


def test_the_runtime_ranks_with_the_configured_margin_and_repeats():
    """The config's margin and repeats reach the controller; with a fixed host cost per op the emulated device's
    times repeat exactly: no noise to allow for, and a close pair tried again would measure the same."""
    measured = lambda: EmulatedDevice(2**30, preset="h100-pcie")  # noqa: E731 - the host's own time
    default = Chameleon({}, device=measured())
    assert (default.controller.ranking.margin, default.controller.ranking.max_repeats) == (0.03, 2)
    config = {"profiler": {"trial_margin": 0.1, "trial_repeats": 1}}
    runtime = Chameleon(config, device=measured())
    assert (runtime.controller.ranking.margin, runtime.controller.ranking.max_repeats) == (0.1, 1)
    fixed = Chameleon(config, device=EmulatedDevice(2**30, preset="h100-pcie", host_op_s=2e-5))
    assert (fixed.controller.ranking.margin, fixed.controller.ranking.max_repeats) == (0.0, 0)
    with pytest.raises(ValueError, match="profiler.trial_margin must be in"):
        TrialRanking(margin=1.5)
