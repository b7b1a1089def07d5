"""Tight budgets degrade gracefully (issue 13, item 3).

At a budget just under the unswapped peak, one policy that missed by a few KiB, or a generator that
predicts every policy a little short (a slow link), used to send the runtime to swapping every eligible
tensor for good (12-23x the unconstrained time to save a fraction of a percent of memory). Now:

- a trial that misses by a small margin (its peak over what is allowed, or passive swaps) makes the next
  policies aim lower by what it missed, and the trials go on;
- when no policy is predicted to fit, the closest ones are tried, and one that completed without an
  out-of-memory retry within what is allowed holds even with passive swaps (passive swap absorbs the
  remainder); the next trials of that stage aim lower by what passive swap moved, so that policies which
  plan those copies (overlapped, where passive swap copies synchronously) are measured too; in Stable,
  the chosen one's passive swaps do not restart WarmUp while they stay near what its trials measured;
- swapping everything is the last resort: kept only when its measured iteration time beats every policy
  that held.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Decision, Policy
from chameleon_dist.policy.selection import IterationOutcome, PolicyController
from chameleon_dist.policy.trials import policy_key
from chameleon_dist.trace.stages import Stage, Transition, TransitionCause
from chameleon_dist.trace.swap_figures import SwapFigures
from chameleon_dist.trace.step_trace import StepTrace
from launch.models.toy_gpt import GPT
from tests.scenario_models import bits_equal, one_thread

MIB = 2**20
DATA = Path(__file__).resolve().parent / "data"
BUDGET_BYTES = 80 * MIB  # the main job's trace peaks at 106.5 MiB without swapping
FAST_LINK_BYTES_PER_S = 1e9  # every generated policy is predicted to fit
SLOW_LINK_BYTES_PER_S = 1e8  # every generated policy is predicted ~18 MiB short: the link cannot move enough
# (swap-only policies throughout: recomputation reaches budgets that the link cannot, issue 13 item 2, and
# these tests are about a budget that no policy is predicted to meet)
TRIALS_DONE = Transition(Stage.GEN_POLICY, Stage.STABLE, TransitionCause.TRIALS_DONE, "trials done")


def _generated(link_bytes_per_s: float, warmup_s: float | None = None) -> tuple[PolicyController, StepTrace, Policy]:
    """A controller that profiled the main job's trace in a swap-everything WarmUp iteration (taking
    ``warmup_s``, the trace's own time by default) and generated policies for its first trial."""
    trace = StepTrace.load(DATA / "job_trace.json")
    settings = PolicySettings(budget_bytes=BUDGET_BYTES, d2h_bytes_per_s=link_bytes_per_s,
                              h2d_bytes_per_s=link_bytes_per_s, min_swap_bytes=MIB, allow_recompute=False)
    controller = PolicyController(settings, capacity_bytes=BUDGET_BYTES)
    warmup = IterationOutcome(iteration=trace.iteration, stage=Stage.WARMUP, policy=None,
                              peak_device_bytes=BUDGET_BYTES,
                              iteration_s=trace.iteration_s if warmup_s is None else warmup_s, stall_s=0.0,
                              attempt_stall_s=0.0, oom_retries=0, profiled=True,
                              saved_bytes=100 * MIB)
    controller.record(warmup)
    controller.follow(Transition(Stage.WARMUP, Stage.GEN_POLICY, TransitionCause.PROFILED, ""), warmup)
    first = controller.policy_for(Stage.GEN_POLICY, trace, MIB)
    assert first is not None
    return controller, trace, first


def _trial(policy: Policy, peak_bytes: int = BUDGET_BYTES, iteration_s: float = 0.1, passive_swap_bytes: int = 0,
           oom_retries: int = 0, stage: Stage = Stage.GEN_POLICY) -> IterationOutcome:
    passive_swaps = -(-passive_swap_bytes // MIB)  # one passive swap per MiB
    return IterationOutcome(iteration=10, stage=stage, policy=policy, peak_device_bytes=peak_bytes,
                            iteration_s=iteration_s, stall_s=0.0, attempt_stall_s=0.0,
                            swaps=SwapFigures(passive_swaps=passive_swaps), oom_retries=oom_retries,
                            profiled=False, saved_bytes=100 * MIB, passive_swap_bytes=passive_swap_bytes)


# ---- 1. a small miss makes the next policy stricter ---------------------------------------------------------
def test_a_trial_that_needed_passive_swaps_gives_a_stricter_policy_and_the_trials_go_on():
    controller, trace, first = _generated(FAST_LINK_BYTES_PER_S)
    assert first.feasible
    miss_bytes = 4 * MIB  # a small share of the 26.5 MiB the trace needs taken off, below what it aimed for
    assert BUDGET_BYTES - miss_bytes < first.predicted_peak_bytes
    verdict = controller.record(_trial(first, passive_swap_bytes=miss_bytes))
    assert not controller.results[-1].held, "a policy predicted to fit that needed passive swaps did not hold"
    assert verdict.absorbed_passive_swaps, "the trial's miss is feedback, not a reason to profile again"
    assert controller.reserve_bytes >= miss_bytes, "the passive-swap bytes are added to the reduction aimed for"
    stricter = controller.policy_for(Stage.GEN_POLICY, trace, MIB)
    assert stricter is not None and stricter is not first
    assert stricter.predicted_peak_bytes <= BUDGET_BYTES - miss_bytes, "it aims lower by what the trial missed"


def test_a_policy_predicted_short_that_ran_out_of_memory_does_not_end_the_policies():
    """Before: one infeasible policy that failed meant no policy was ever tried again (swap everything)."""
    controller, trace, closest = _generated(SLOW_LINK_BYTES_PER_S)
    assert not closest.feasible and closest is min(controller.candidates, key=lambda p: p.shortfall_bytes)
    controller.on_out_of_memory(closest, refused_bytes=0, min_swap_bytes=MIB)
    controller.record(_trial(closest, oom_retries=1))
    assert not controller.results[-1].held
    warmup = dataclasses.replace(_trial(None, stage=Stage.WARMUP), iteration=11, profiled=True)  # profiled again
    controller.record(warmup)
    controller.follow(Transition(Stage.WARMUP, Stage.GEN_POLICY, TransitionCause.PROFILED, ""), warmup)
    assert controller.policy_for(Stage.GEN_POLICY, trace, MIB) is not None


def _none_held(swap_all_passive_swaps: int) -> PolicyController:
    """None predicted to fit (a slow link), and every trial went over the budget with passive swaps (none
    held), after a WarmUp that swapped everything with ``swap_all_passive_swaps``; then the move to Stable."""
    controller, trace, closest = _generated(SLOW_LINK_BYTES_PER_S)
    warmup = dataclasses.replace(_trial(None, stage=Stage.WARMUP), iteration=9,
                                 peak_device_bytes=BUDGET_BYTES - MIB,
                                 swaps=SwapFigures(passive_swaps=swap_all_passive_swaps))
    controller.record(warmup)
    policy = closest
    for _ in range(3):
        controller.record(_trial(policy, peak_bytes=BUDGET_BYTES + MIB, passive_swap_bytes=4 * MIB))
        policy = controller.policy_for(Stage.GEN_POLICY, trace, MIB)
    assert not any(r.held for r in controller.results)
    controller.follow(TRIALS_DONE, warmup)
    return controller


def test_when_no_trial_held_and_none_is_predicted_to_fit_stable_swaps_everything_where_that_held():
    """(Issue 27: before, the policy predicted lowest was chosen untried, and went back to WarmUp on its
    first passive swap: WWGGGGGSWWGGGGGSWWGGGGGS on a grouped-experts Mixtral on a 1 GB/s link.)"""
    assert _none_held(swap_all_passive_swaps=0).chosen is None
    untried = _none_held(swap_all_passive_swaps=2).chosen
    assert untried is not None and not untried.feasible, "swapping everything did not hold either: the closest"


# ---- 2. none predicted to fit: the closest, with passive swap for the remainder ----------------------------
def _chose_the_closest(passive_swap_bytes: int = 2 * MIB) -> tuple[PolicyController, Policy]:
    controller, trace, closest = _generated(SLOW_LINK_BYTES_PER_S, warmup_s=1.0)
    assert not any(p.feasible for p in controller.candidates)
    verdict = controller.record(_trial(closest, iteration_s=0.4, passive_swap_bytes=passive_swap_bytes))
    assert controller.results[-1].held, "completed without a retry, within the budget: passive swap is the design"
    assert verdict.absorbed_passive_swaps
    for k in range(2):  # the others: further off, slower
        policy = controller.policy_for(Stage.GEN_POLICY, trace, MIB)
        assert policy is not None
        controller.record(_trial(policy, iteration_s=0.5 + k, passive_swap_bytes=6 * MIB))
    controller.follow(TRIALS_DONE, _trial(closest))
    return controller, closest


def test_when_no_policy_is_predicted_to_fit_the_closest_is_tried_first_and_kept_when_it_holds():
    controller, closest = _chose_the_closest()
    assert controller.chosen is closest
    assert controller.policy_for(Stage.STABLE, None, MIB) is closest


def test_a_policy_predicted_short_that_held_with_passive_swaps_makes_the_next_trials_plan_more():
    controller, trace, closest = _generated(SLOW_LINK_BYTES_PER_S, warmup_s=1.0)
    controller.record(_trial(closest, iteration_s=0.4, passive_swap_bytes=4 * MIB))
    planned_more = controller.policy_for(Stage.GEN_POLICY, trace, MIB)
    assert planned_more is not None and planned_more.settings["reserve_bytes"] >= 4 * MIB
    assert policy_key(planned_more) != policy_key(closest), "a plan already tried is not tried again"
    assert planned_more.saved_bytes(Decision.SWAP) > closest.saved_bytes(Decision.SWAP)
    controller.record(_trial(planned_more, iteration_s=0.2, passive_swap_bytes=MIB))
    controller.follow(TRIALS_DONE, _trial(planned_more))
    assert controller.chosen is planned_more, "the measured time decides"
    assert controller.reserve_bytes == 0, "exploring is no miss: the next GenPolicy stage starts where this one did"


def test_stable_on_a_policy_predicted_short_absorbs_the_passive_swaps_its_trials_measured():
    controller, closest = _chose_the_closest(passive_swap_bytes=2 * MIB)
    for passive_swap_bytes in (2 * MIB, 3 * MIB, 2 * MIB):
        verdict = controller.record(_trial(closest, stage=Stage.STABLE, passive_swap_bytes=passive_swap_bytes))
        assert verdict.restart is None
        assert verdict.absorbed_passive_swaps, "expected passive swaps: the runtime must not restart WarmUp"
        assert controller.chosen is closest
    # far more than its trials needed: the policy no longer describes the job, profile again
    verdict = controller.record(_trial(closest, stage=Stage.STABLE, passive_swap_bytes=20 * MIB))
    assert verdict.restart == TransitionCause.PASSIVE_SWAP  # (was: no over-budget reason; the stage machine restarted)
    assert not verdict.absorbed_passive_swaps


# ---- 3. swap-everything is compared on measured time, and is the last resort ----------------------------------
@pytest.mark.parametrize("swap_all_s, chosen", [(1.0, "fastest held"), (0.15, "swap everything")])
def test_swap_everything_is_kept_only_when_measured_faster_than_every_policy_that_held(swap_all_s, chosen):
    controller, trace, first = _generated(FAST_LINK_BYTES_PER_S, warmup_s=swap_all_s)
    second = controller.candidates[1]
    controller.record(_trial(first, peak_bytes=BUDGET_BYTES - MIB, iteration_s=0.2))
    controller.record(_trial(second, peak_bytes=BUDGET_BYTES - MIB, iteration_s=0.3))
    controller.record(_trial(first, peak_bytes=BUDGET_BYTES + MIB, iteration_s=0.01))  # fast, but it did not hold
    controller.follow(TRIALS_DONE, _trial(first))
    if chosen == "swap everything":
        assert controller.chosen is None, "swapping everything was measured faster than every policy that held"
    else:
        assert controller.chosen is first


# ---- end to end: a slow link, every policy predicted short ------------------------------------------------------
VOCAB, HIDDEN, HEADS, LAYERS, BATCH, SEQ = 128, 64, 4, 2, 4, 64
ITERATIONS = 13
SLOW_EMULATED_LINK_BYTES_PER_S = 5e6  # swapping all ~2.3 MiB each way takes ~1 s; the compute ~30 ms
CUT_BYTES = 256 * 1024  # capacity = unswapped peak - this: the link cannot hide it, so every policy is short


def _train(config: dict, capacity_bytes: int, link_bytes_per_s: float | None = None):
    torch.manual_seed(0)
    model = GPT(VOCAB, HIDDEN, HEADS, LAYERS)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    device = EmulatedDevice(capacity_bytes, h2d_bytes_per_s=link_bytes_per_s, d2h_bytes_per_s=link_bytes_per_s)
    chameleon = Chameleon(config, device=device)
    chameleon.attach(model)
    losses, reports = [], []
    for i in range(ITERATIONS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(i))

        def closure() -> torch.Tensor:
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            return loss.detach()

        optimizer.zero_grad(set_to_none=True)
        losses.append(chameleon.run_iteration(closure, optimizer=optimizer))
        reports.append(chameleon.last_report)
    return losses, reports, chameleon, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_a_link_too_slow_for_any_policy_ends_stable_on_the_closest_policy_bit_identically():
    with one_thread():
        plain_losses, plain_reports, _, plain_parameters = _train({"enabled": False}, 2**40)
        capacity_bytes = max(r.peak_device_bytes for r in plain_reports) - CUT_BYTES
        config = {"min_swap_bytes": 1024, "memory_budget": 1.0, "executor": {"allow_recompute": False}}
        losses, reports, chameleon, parameters = _train(config, capacity_bytes, SLOW_EMULATED_LINK_BYTES_PER_S)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert all(bits_equal(a, b) for a, b in zip(parameters, plain_parameters))
    assert max(r.peak_device_bytes for r in reports) <= capacity_bytes
    stages = "".join(r.stage[0].upper() for r in reports)
    chosen = chameleon.controller.chosen
    assert chosen is not None and not chosen.feasible, f"a policy predicted short is kept, not None: {stages}"
    first_stable = stages.index("S")
    assert set(stages[first_stable:]) == {"S"}, f"its passive swaps send nothing back to WarmUp: {stages}"
    swap_all_bytes = reports[0].swap_out_bytes  # WarmUp swapped every eligible tensor
    assert all(r.policy == chosen.name and r.swap_out_bytes < swap_all_bytes / 2 for r in reports[first_stable:])
