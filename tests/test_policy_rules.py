"""``policy.judgement``: each rule of the controller's judgement alone, fed a constructed outcome and state;
the table's order; and the rule that decided, as the controller's ``Verdict`` and the iteration's report
name it (issue 38 item 1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.policy import judgement
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.judgement import RULES, Judgement, judge
from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.outcome import IterationOutcome
from chameleon_dist.policy.selection import PolicyController
from chameleon_dist.trace.stages import Stage, Transition, TransitionCause
from chameleon_dist.trace.swap_figures import SwapFigures
from tests.models import lm_batch, lm_loss, make_lm

MIB = 2**20
BUDGET_BYTES = 100 * MIB


def _policy(name: str = "p") -> Policy:
    return Policy(name=name, budget_bytes=BUDGET_BYTES, feasible=True, predicted_peak_bytes=90 * MIB,
                  no_swap_peak_bytes=120 * MIB, predicted_stall_s=0.0, predicted_recompute_s=0.0,
                  predicted_iteration_s=0.1, compute_s=0.1, entries=[], layers=[], num_ops=10,
                  trace_iteration=1, settings={})


CHOSEN = _policy("chosen")


def _outcome(stage: Stage = Stage.STABLE, policy: Policy | None = CHOSEN, peak_mib: float = 90, passive_swaps: int = 0,
             passive_swap_mib: float = 0, oom_retries: int = 0, failed_attempt_passive_swaps: int = 0) -> IterationOutcome:
    return IterationOutcome(iteration=7, stage=stage, policy=policy, peak_device_bytes=int(peak_mib * MIB),
                            iteration_s=0.1, stall_s=0.0, attempt_stall_s=0.0, swaps=SwapFigures(passive_swaps=passive_swaps),
                            oom_retries=oom_retries,
                            profiled=False, passive_swap_bytes=int(passive_swap_mib * MIB),
                            failed_attempt_passive_swaps=failed_attempt_passive_swaps)


@dataclasses.dataclass
class FakeState:
    """A ``JudgedState`` with fixed answers; its actions answer as told and are logged in ``calls``."""

    chosen: Policy | None = dataclasses.field(default_factory=lambda: CHOSEN)
    allowed_peak_bytes: int = BUDGET_BYTES
    budget_bytes: int = BUDGET_BYTES
    capacity_bytes: int | None = None
    needed_bytes: int = 40 * MIB
    no_stricter_policy: bool = False
    fits: bool = False
    expected: bool = False
    scales: bool = False
    tightens: bool = False
    finds_no_stricter: bool = False  # a failed tightening sets ``no_stricter_policy``
    swaps_all: bool = False
    calls: list[str] = dataclasses.field(default_factory=list)

    def swap_all_fits(self) -> bool:
        return self.fits

    def expected_passive_swaps(self, policy: Policy, outcome: IterationOutcome) -> bool:
        return self.expected

    def scale_for(self, outcome: IterationOutcome) -> bool:
        self.calls.append("scale_for")
        return self.scales

    def tighten_in_place(self, policy: Policy, shortfall_bytes: int, reason: str,
                         peak_within_capacity: bool = False) -> bool:
        self.calls.append(f"tighten_in_place({shortfall_bytes // MIB} MiB, within={peak_within_capacity})")
        self.no_stricter_policy = self.finds_no_stricter and not self.tightens
        return self.tightens

    def swap_all_in_place(self, reason: str) -> bool:
        self.calls.append("swap_all_in_place")
        return self.swaps_all


def test_the_table_asks_the_rules_in_this_order():
    assert [rule.__name__ for rule in RULES] == [
        "trial", "not_stable_under_the_chosen", "scaled_for_a_grown_shape", "predicted_short",
        "slightly_short_near_floor", "over_budget_with_passive_swaps", "over_budget_tightened_in_place",
        "over_budget_within_capacity", "over_budget", "passive_swaps_not_absorbed", "held",
    ]
    assert isinstance(RULES, tuple)


def test_a_trial_absorbs_its_passive_swaps():
    assert judgement.trial(_outcome(Stage.GEN_POLICY, passive_swaps=3), FakeState()) == Judgement("trial", absorbed=True)
    assert judgement.trial(_outcome(Stage.GEN_POLICY), FakeState()) == Judgement("trial")
    assert judgement.trial(_outcome(Stage.GEN_POLICY, policy=None), FakeState()) is None, "swapping everything"
    assert judgement.trial(_outcome(Stage.STABLE), FakeState()) is None


@pytest.mark.parametrize("outcome", [_outcome(Stage.WARMUP, passive_swaps=2), _outcome(policy=None, peak_mib=130),
                                     _outcome(policy=_policy("other"), peak_mib=130)])
def test_only_stable_under_the_chosen_policy_is_judged_further(outcome):
    assert judgement.not_stable_under_the_chosen(outcome, FakeState()) == Judgement("not_stable_under_the_chosen")


def test_stable_under_the_chosen_policy_passes_on():
    assert judgement.not_stable_under_the_chosen(_outcome(peak_mib=130), FakeState()) is None


def test_a_grown_shape_is_scaled_for_when_the_policy_failed_without_a_retry():
    state = FakeState(scales=True)
    assert judgement.scaled_for_a_grown_shape(_outcome(peak_mib=130), state) == Judgement("scaled_for_a_grown_shape")
    got = judgement.scaled_for_a_grown_shape(_outcome(passive_swaps=2), state)
    assert got == Judgement("scaled_for_a_grown_shape", absorbed=True)
    held, retried = FakeState(scales=True), FakeState(scales=True)
    assert judgement.scaled_for_a_grown_shape(_outcome(), held) is None and held.calls == [], "it held: no scaling"
    assert judgement.scaled_for_a_grown_shape(_outcome(peak_mib=130, oom_retries=1), retried) is None
    assert retried.calls == []
    assert judgement.scaled_for_a_grown_shape(_outcome(peak_mib=130), FakeState(scales=False)) is None


def test_a_policy_predicted_short_keeps_the_passive_swaps_its_trials_measured():
    assert judgement.predicted_short(_outcome(passive_swaps=2), FakeState(expected=True)) == Judgement(
        "predicted_short", absorbed=True)
    assert judgement.predicted_short(_outcome(peak_mib=101, passive_swaps=2), FakeState(expected=True)) is None
    assert judgement.predicted_short(_outcome(passive_swaps=2), FakeState(expected=False)) is None


def test_slightly_short_near_the_floor_is_tightened_in_place_by_what_passive_swap_moved():
    state = FakeState(fits=True, tightens=True)
    short = _outcome(passive_swaps=2, passive_swap_mib=10)  # 10 MiB <= 0.5 * 40 MiB needed
    assert judgement.slightly_short_near_floor(short, state) == Judgement(
        "slightly_short_near_floor", absorbed=True, tightened=True)
    assert state.calls == ["tighten_in_place(10 MiB, within=True)"]
    swaps_all = FakeState(fits=True, swaps_all=True)
    assert judgement.slightly_short_near_floor(short, swaps_all).tightened
    assert swaps_all.calls == ["tighten_in_place(10 MiB, within=True)", "swap_all_in_place"]
    assert judgement.slightly_short_near_floor(short, FakeState(fits=True)) is None, "neither could be done"


@pytest.mark.parametrize("outcome, state", [
    (_outcome(passive_swaps=2, passive_swap_mib=30), FakeState(fits=True, tightens=True)),  # more than half
    (_outcome(passive_swaps=2, passive_swap_mib=10), FakeState(fits=False, tightens=True)),  # not near the floor
    (_outcome(passive_swaps=2, passive_swap_mib=10, oom_retries=1), FakeState(fits=True, tightens=True)),
    (_outcome(passive_swaps=2), FakeState(fits=True, tightens=True)),  # bytes not known
])
def test_not_slightly_short_passes_without_acting(outcome, state):
    assert judgement.slightly_short_near_floor(outcome, state) is None and state.calls == []


def test_over_budget_with_passive_swaps_restarts_with_its_reason():
    got = judgement.over_budget_with_passive_swaps(_outcome(peak_mib=130, passive_swaps=1), FakeState())
    assert got is not None and got.rule == "over_budget_with_passive_swaps"
    assert "above memory_budget" in got.over_budget_reason and "policy chosen" in got.over_budget_reason
    assert not got.absorbed and not got.tightened
    assert judgement.over_budget_with_passive_swaps(_outcome(peak_mib=130), FakeState()) is None
    assert judgement.over_budget_with_passive_swaps(_outcome(peak_mib=100, passive_swaps=1), FakeState()) is None


def test_over_budget_is_tightened_in_place_or_swaps_everything_when_no_stricter_policy():
    state = FakeState(tightens=True)
    assert judgement.over_budget_tightened_in_place(_outcome(peak_mib=130), state) == Judgement(
        "over_budget_tightened_in_place", tightened=True)
    assert state.calls == ["tighten_in_place(30 MiB, within=False)"]
    no_stricter = FakeState(finds_no_stricter=True, swaps_all=True)
    assert judgement.over_budget_tightened_in_place(_outcome(peak_mib=130), no_stricter).tightened
    assert no_stricter.calls[-1] == "swap_all_in_place"
    stricter_unknown = FakeState(swaps_all=True)  # the tightening failed for another reason: no swapping everything
    assert judgement.over_budget_tightened_in_place(_outcome(peak_mib=130), stricter_unknown) is None
    assert "swap_all_in_place" not in stricter_unknown.calls
    within = FakeState(tightens=True)
    assert judgement.over_budget_tightened_in_place(_outcome(), within) is None and within.calls == []


def test_over_budget_within_the_capacity_keeps_the_policy():
    assert judgement.over_budget_within_capacity(_outcome(peak_mib=130), FakeState(capacity_bytes=140 * MIB)) == Judgement(
        "over_budget_within_capacity")
    assert judgement.over_budget_within_capacity(_outcome(peak_mib=150), FakeState(capacity_bytes=140 * MIB)) is None
    assert judgement.over_budget_within_capacity(_outcome(peak_mib=130), FakeState(capacity_bytes=None)) is None


def test_over_budget_otherwise_restarts():
    got = judgement.over_budget(_outcome(peak_mib=130), FakeState())
    assert got is not None and got.rule == "over_budget" and got.over_budget_reason.startswith("peak 130")
    assert judgement.over_budget(_outcome(peak_mib=100), FakeState()) is None, "at the budget holds"


def test_passive_swaps_no_rule_absorbed_are_named():
    assert judgement.passive_swaps_not_absorbed(_outcome(passive_swaps=1), FakeState()) == Judgement(
        "passive_swaps_not_absorbed")
    assert judgement.passive_swaps_not_absorbed(_outcome(failed_attempt_passive_swaps=1), FakeState()) is not None
    assert judgement.passive_swaps_not_absorbed(_outcome(), FakeState()) is None
    assert judgement.held(_outcome(), FakeState()) == Judgement("held")


def test_the_first_rule_that_answers_wins():
    # over the budget, with passive swaps near the floor: the slightly-short rule comes first
    state = FakeState(fits=True, tightens=True)
    got = judge(_outcome(peak_mib=105, passive_swaps=2, passive_swap_mib=10), state)
    assert got.rule == "slightly_short_near_floor"
    assert state.calls == ["scale_for", "tighten_in_place(10 MiB, within=True)"], "no grown shape to scale for first"
    # nothing absorbs it, no capacity known: the over-budget rule, after the in-place one was tried
    state = FakeState()
    assert judge(_outcome(peak_mib=130), state).rule == "over_budget" and state.calls == [
        "scale_for", "tighten_in_place(30 MiB, within=False)"]
    assert judge(_outcome(), FakeState(), rules=(judgement.held, judgement.trial)).rule == "held"


def test_every_rule_names_itself():
    """Each rule, made to fire, answers with its own name (the name the table and the report carry)."""
    firing = {
        "trial": (_outcome(Stage.GEN_POLICY), FakeState()),
        "not_stable_under_the_chosen": (_outcome(Stage.WARMUP), FakeState()),
        "scaled_for_a_grown_shape": (_outcome(peak_mib=130), FakeState(scales=True)),
        "predicted_short": (_outcome(passive_swaps=1), FakeState(expected=True)),
        "slightly_short_near_floor": (_outcome(passive_swaps=1, passive_swap_mib=1), FakeState(fits=True, tightens=True)),
        "over_budget_with_passive_swaps": (_outcome(peak_mib=130, passive_swaps=1), FakeState()),
        "over_budget_tightened_in_place": (_outcome(peak_mib=130), FakeState(tightens=True)),
        "over_budget_within_capacity": (_outcome(peak_mib=130), FakeState(capacity_bytes=200 * MIB)),
        "over_budget": (_outcome(peak_mib=130), FakeState()),
        "passive_swaps_not_absorbed": (_outcome(passive_swaps=1), FakeState()),
        "held": (_outcome(), FakeState()),
    }
    assert set(firing) == {rule.__name__ for rule in RULES}
    for rule in RULES:
        got = rule(*firing[rule.__name__])
        assert got is not None and got.rule == rule.__name__


def test_the_controllers_verdict_names_the_rule():
    controller = PolicyController(PolicySettings(budget_bytes=BUDGET_BYTES, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9))
    policy = _policy()
    controller.candidates = [policy]
    assert controller.record(_outcome(Stage.GEN_POLICY, policy)).rule == "trial"
    controller.follow(Transition(Stage.GEN_POLICY, Stage.STABLE, TransitionCause.TRIALS_DONE, ""),
                      _outcome(Stage.GEN_POLICY, policy))
    assert controller.chosen is policy
    assert controller.record(_outcome(Stage.STABLE, policy)).rule == "held"
    verdict = controller.record(_outcome(Stage.STABLE, policy, peak_mib=130))  # no capacity, no trace: restart
    assert verdict.rule == "over_budget" and verdict.restart == TransitionCause.OVER_BUDGET
    verdict = controller.record(_outcome(Stage.STABLE, policy, passive_swaps=2))
    assert verdict.rule == "passive_swaps_not_absorbed" and verdict.restart == TransitionCause.PASSIVE_SWAP


def test_the_reports_name_the_rules_that_fired():
    """A short run on the emulated device: WarmUp, trials, Stable; each completed report names its rule."""
    torch.manual_seed(0)
    model = make_lm(0, vocab=128, hidden=64, heads=4, layers=2, dropout=0.0)
    chameleon = Chameleon({"min_swap_bytes": 0, "profiler": {"warmup_iterations": 2, "policy_trials": 2}},
                          device=EmulatedDevice(2_800_000, preset="h100-pcie", host_op_s=2e-5))
    chameleon.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = []
    for step in range(6):
        tokens, labels = lm_batch(step, batch=8, seq=32, vocab=128)

        def closure(tokens=tokens, labels=labels):
            loss = lm_loss(model, tokens, labels)
            loss.backward()
            return loss.detach()

        optimizer.zero_grad(set_to_none=True)
        chameleon.run_iteration(closure, optimizer=optimizer)
        reports.append(chameleon.last_report)
    assert [(r.stage, r.verdict_rule) for r in reports] == [
        ("warmup", "not_stable_under_the_chosen"), ("warmup", "not_stable_under_the_chosen"),
        ("gen_policy", "trial"), ("gen_policy", "trial"), ("stable", "held"), ("stable", "held")]
    assert list(reports[-1].to_dict())[-2:] == ["verdict_rule", "schema_version"]
