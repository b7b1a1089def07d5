"""``PolicyController``: the one place that decides which swap policy an iteration applies.

The runtime asks it, at the start of every iteration, which policy to apply (``policy_for``), tells it
what the iteration did (``record``), and passes on the stage machine's transitions (``follow``) and
out-of-memory retries (``on_out_of_memory``). Everything about choosing, trying, keeping and tightening
policies lives here; the runtime only sequences device, profiler, executor and this controller.

Per stage (the paper's Algorithm 1, ``trace.stages``):

- **WarmUp** applies the last chosen policy to what it matches confidently, or swaps every eligible tensor
  when there is none yet or the last WarmUp iteration under it needed passive swaps or a retry.
- **GenPolicy** generates candidates from the latest detailed trace (the paper generates n=5) and tries
  one per iteration; trial outcomes feed back into the next generation (a peak over the budget or passive
  swaps under a policy predicted to fit make the next policies aim lower by what it missed, and the
  trials go on; a mispredicted compute time rescales the trace's op times). When no policy is predicted
  to fit, the closest ones are tried, passive swap taking the remainder (``policy.trials``).
- **GenPolicy's end** waits for a close pair: when the trials' ranking is contested (``policy.ranking``: within
  ``profiler.trial_margin`` of the fastest, a policy that swaps less than the fastest, or swapping everything a
  little faster), the verdict asks for another trial (``Verdict.more_trials``) and the pair is tried again, up to
  ``profiler.trial_repeats`` extra iterations. Each rank ranks its own trials: its policy is its own (its layers,
  its shard) and no collective depends on it, so the ranks need not agree on it.
- **Stable** applies the fastest policy that held with headroom (within the margin, the one that swaps less): its measured peak at least the largest move
  of one policy's peak between its trials (timing jitter, routing, shapes) under what a policy must stay
  under; or swaps everything, when that was measured faster than every policy that held (the last resort; also
  when no trial held, none is predicted to fit, and swapping everything held in WarmUp without passive swap).
  A policy predicted short passive-swaps in Stable by design: as long as about what its trials measured, that
  restarts nothing (``Verdict.absorbed_passive_swaps``). A Stable peak over the budget but within the device's
  capacity tightens the policy in place (the shortfall added to the reduction the policy aims for, a new
  policy generated from the same trace, no trials) up to ``MAX_IN_PLACE_TIGHTENINGS`` times per choice; after
  those, an overshoot within the capacity with nothing passively swapped is variance (routing, lengths: issue
  27) and the policy is kept; one above the capacity, or with no capacity known, sends the runtime back to
  WarmUp. Near the floor (the capacity at most ``NEAR_FLOOR_FACTOR`` times the peak of swapping everything,
  which fitted), a Stable policy slightly short (its passive swaps moved at most ``SLIGHTLY_SHORT_SHARE`` of
  the needed reduction) is tightened in place by what passive swap moved, or, when no stricter policy is
  predicted, replaced in place by swapping everything (issue 27): profiling again would only find the same
  policies. A peak over the budget near the floor for which no stricter policy is predicted swaps everything
  in place too.
- **Shapes never seen before** (a longer sequence, a bigger batch: more bytes saved for backward than in
  the traced iteration) are handled by scaling first: when the chosen policy needs passive swaps or goes
  over the budget on such an iteration, a policy is generated from the same trace grown to the new size
  (``policy.scaling.grown``) and applied at once; only when that fails too does the runtime profile
  again.
"""

from __future__ import annotations

import logging
import time
import types
from typing import Mapping

from chameleon_dist.policy.controller_state import (
    NEAR_FLOOR_FACTOR,
    ChosenPolicy,
    GenerationBasis,
    Learned,
    ProfiledIteration,
    SwapAllBaseline,
    TrialRound,
)
from chameleon_dist.policy.generator import generate_policies
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.judgement import SLIGHTLY_SHORT_SHARE, Judgement, judge
from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.outcome import IterationOutcome, RetryAction
from chameleon_dist.policy.ranking import TrialRanking
from chameleon_dist.policy.scaling import grown
from chameleon_dist.policy.stable import StableDecisions
from chameleon_dist.policy.tightening import GROWTH_TOLERANCE, MAX_IN_PLACE_TIGHTENINGS
from chameleon_dist.policy.trials import (
    TrialResult,
    choose,
    compute_only,
    next_trial,
    trial_feedback,
    trial_held,
    trial_order,
)
from chameleon_dist.policy.variance import SavedBytesSpread
from chameleon_dist.trace.stages import RetryCause, Stage, Transition, TransitionCause, Verdict
from chameleon_dist.trace.step_trace import StepTrace
from chameleon_dist.units import format_bytes

__all__ = ["IterationOutcome", "MAX_IN_PLACE_TIGHTENINGS", "MIN_SWAP_DIVISOR", "NEAR_FLOOR_FACTOR", "PolicyController",
           "RetryAction", "RetryCause", "SLIGHTLY_SHORT_SHARE", "TrialResult", "Verdict"]

logger = logging.getLogger(__name__)

STRICTER_SHARE = 0.1
"""A policy that stopped holding makes the next policies aim further under the budget by what it missed
(the bytes passive swap moved, the peak over what it had to stay under), and by at least this share of
the needed reduction (no-swap peak - budget) when it fails outside a trial (out of memory, Stable) or by an
amount not known. A trial's known miss is added as measured: the trials go on, each narrower."""

MIN_SWAP_DIVISOR = 16
"""An out-of-memory retry with every eligible tensor swapped but smaller ones kept swaps smaller tensors
too: ``min_swap_bytes`` divided by this (and 0 below ``MIN_SWAP_FLOOR_BYTES``)."""

MIN_SWAP_FLOOR_BYTES = 1024


class PolicyController:
    """Chooses, tries, keeps and tightens swap policies for one runtime.

    Args:
        settings: what the generator works with: the memory budget, the host-link rates in each
            direction, the host budget and the number of trials (``profiler.policy_trials``).
            ``min_swap_bytes`` is taken per generation from ``policy_for`` (the executor lowers it after
            out-of-memory errors); ``reserve_bytes`` is the controller's own (it grows when policies miss).
        capacity_bytes: the device's memory. A Stable peak over the budget but not over this is
            tightened in place; None: every Stable peak over the budget sends the runtime to WarmUp.
        ranking: the trials' noise margin and how many extra trials a close pair may take
            (``profiler.trial_margin``, ``profiler.trial_repeats``; ``policy.ranking``).

    Read API (for reports and benchmarks): ``chosen`` (the policy Stable applies, or None),
    ``version`` (how many times one was chosen), ``candidates``, ``results`` (the trials of the current
    GenPolicy stage), ``reserve_bytes``, ``headroom_bytes`` (the choice's), ``time_scale``,
    ``generation_s``, ``trace_stall_s`` and ``version_of(policy)``. What one iteration's record decided
    (restart or not, its cause and reason, the passive swaps absorbed, a tightening in place) is the
    ``Verdict`` ``record`` returns (``Verdict.rule`` names the rule of ``policy.judgement`` that decided);
    what an out-of-memory retry changes is the ``RetryAction`` ``on_out_of_memory`` returns.

    State, by what it is about (``policy.controller_state``): ``round`` (the GenPolicy stage's trials),
    ``stable`` (the chosen policy), ``baseline`` (what swapping everything measured), ``basis`` (what the
    latest generation worked from), ``profiled`` (the iteration it was built from) and ``learned`` (the
    reserve aimed for, the compute-time scale); ``decisions`` (``policy.stable``) sees them together: it
    chooses after the trials, changes the choice in place, and is what the judgement reads.

    Example::

        controller = PolicyController(PolicySettings(budget_bytes=..., d2h_bytes_per_s=..., h2d_bytes_per_s=...))
        policy = controller.policy_for(stage, profiler.last_trace, executor.min_swap_bytes)
        ...  # run the iteration with ``policy``
        verdict = controller.record(outcome)  # an IterationOutcome -> a Verdict
        transition = stage_machine.advance(..., verdict=verdict)
        controller.follow(transition, outcome)
    """

    def __init__(self, settings: PolicySettings, capacity_bytes: int | None = None,
                 ranking: TrialRanking = TrialRanking()) -> None:
        self.settings = settings
        self.capacity_bytes = capacity_bytes
        self.ranking = ranking  # how trials are ranked: the noise margin and the repeats of a close pair
        self.spread = SavedBytesSpread()  # what the recent iterations saved per layer (``policy.variance``)
        self.round = TrialRound()
        self.stable = ChosenPolicy()
        self.baseline = SwapAllBaseline()
        self.basis = GenerationBasis(min_swap_bytes=settings.min_swap_bytes)
        self.profiled = ProfiledIteration()
        self.learned = Learned()
        self.decisions = StableDecisions(settings, capacity_bytes, self.stable, self.baseline, self.basis, self.round,
                                         self.profiled, self.learned)

    # ---- read API ---------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.settings.budget_bytes

    @property
    def allowed_peak_bytes(self) -> int:
        """What a policy must stay under (``StableDecisions.allowed_peak_bytes``)."""
        return self.decisions.allowed_peak_bytes

    @property
    def chosen(self) -> Policy | None:
        """The policy Stable applies (None: swap every eligible tensor); settable for benchmarks that
        impose one."""
        return self.stable.chosen

    @chosen.setter
    def chosen(self, policy: Policy | None) -> None:
        self.stable.chosen = policy

    @property
    def version(self) -> int:
        return self.stable.version

    @property
    def headroom_bytes(self) -> int:
        return self.stable.headroom_bytes

    @property
    def candidates(self) -> list[Policy]:
        """The policies the current GenPolicy stage tries (settable, for tests that impose them)."""
        return self.round.candidates

    @candidates.setter
    def candidates(self, policies: list[Policy]) -> None:
        self.round.candidates = policies

    @property
    def results(self) -> list[TrialResult]:
        """The trials of the current GenPolicy stage (settable, for tests that start them afresh)."""
        return self.round.results

    @results.setter
    def results(self, results: list[TrialResult]) -> None:
        self.round.results = results

    @property
    def reserve_bytes(self) -> int:
        """How far under the budget the next policies aim."""
        return self.learned.reserve_bytes

    @property
    def time_scale(self) -> float:
        """Measured compute time / the trace's, learned from the trials."""
        return self.learned.time_scale

    @property
    def generation_s(self) -> float:
        return self.basis.generation_s

    @property
    def trace_stall_s(self) -> Mapping[int, float]:
        """The measured stall of the latest profiled iteration, keyed by its iteration number (the
        executor waited for copies then; those seconds are not compute)."""
        return types.MappingProxyType(self.profiled.stall_s)

    def version_of(self, policy: Policy | None) -> int:
        """``version`` when ``policy`` is what the latest choice gave (the chosen policy, or None when that
        choice found none), else 0 (a trial, or swap-everything while a policy is chosen)."""
        return self.stable.version if policy is self.stable.chosen else 0

    # ---- per iteration ----------------------------------------------------------------------
    def policy_for(self, stage: Stage, trace: StepTrace | None, min_swap_bytes: int) -> Policy | None:
        """The policy an iteration in ``stage`` applies (None: swap every eligible tensor). ``trace`` is the
        latest detailed trace; GenPolicy generates from it when a new stage began or trials asked."""
        if stage == Stage.WARMUP:
            return self.stable.chosen if not self.stable.warmup_unsafe else None
        if stage == Stage.GEN_POLICY:
            trials = self.round
            if trials.need_policies or trials.regenerate:
                if trials.need_policies:
                    trials.begin()
                trials.need_policies = False
                if trace is None:
                    return None
                stall_s = self.profiled.stall_s.get(trace.iteration, 0.0)
                self._generate(compute_only(trace, stall_s, self.learned.time_scale), min_swap_bytes)
            return trials.repeat if trials.repeat is not None else next_trial(trials.candidates, trials.results)
        if stage == Stage.STABLE:
            return self.stable.chosen
        return None

    def record(self, outcome: IterationOutcome) -> Verdict:
        """Account one completed iteration and judge it: the stage machine goes back to WarmUp
        (``Verdict.restart``) when, outside WarmUp, passive swaps were needed that no rule absorbs (those of
        a failed attempt only under a GenPolicy trial, whose failure is fed back to the next trials), or a
        Stable iteration went over what its policy must stay under and could not be absorbed in place.
        ``Verdict.rule`` names the rule of ``policy.judgement.RULES`` that decided."""
        judgement = self._judge(outcome)
        # a trial that failed is fed back and the trials go on (``_judge``): the trace is still this program's
        trial = outcome.stage == Stage.GEN_POLICY and outcome.policy is not None
        self.round.repeat = self._next_repeat() if trial else None
        more = self.round.repeat is not None
        absorbed, tightened = judgement.absorbed, judgement.tightened
        counted = (0 if absorbed else outcome.passive_swaps) + (0 if trial else outcome.failed_attempt_passive_swaps)
        absorbed_swaps = outcome.passive_swaps if absorbed else 0
        if counted and outcome.stage != Stage.WARMUP:
            return Verdict(TransitionCause.PASSIVE_SWAP, f"{counted} passive swap(s): the device ran out of memory",
                           absorbed_swaps, tightened, more, rule=judgement.rule)
        if judgement.over_budget_reason:
            return Verdict(TransitionCause.OVER_BUDGET, judgement.over_budget_reason, absorbed_swaps, tightened, more,
                           rule=judgement.rule)
        return Verdict(None, "", absorbed_swaps, tightened, more, rule=judgement.rule)

    def _next_repeat(self) -> Policy | None:
        """After the GenPolicy stage's ``settings.trials`` trials: the policy of a contested ranking to try
        again (``policy.ranking.to_repeat``), while fewer than ``ranking.max_repeats`` extra trials ran; else
        None (the trials are done)."""
        results = self.round.results
        extra = len(results) - self.settings.trials
        if extra < 0 or extra >= self.ranking.max_repeats:
            return None
        choice = choose(results, self.allowed_peak_bytes, self.baseline.iteration_s, self.ranking.margin)
        if choice.repeat is not None:
            logger.info("trials within %.1f%% of each other (the fastest swaps more, or swapping everything was as "
                        "fast): policy %s tried again (extra trial %d of at most %d)", 100 * self.ranking.margin,
                        choice.repeat.name, extra + 1, self.ranking.max_repeats)
        return choice.repeat

    def _judge(self, outcome: IterationOutcome) -> Judgement:
        """``record``'s accounting, then the judgement (``policy.judgement.judge``): what every iteration
        notes comes first, in this order, so that the rules read it."""
        self._note_trial(outcome)
        self.baseline.note(outcome)
        self._note_warmup(outcome)
        self.spread.note(outcome.saved_bytes_by_layer)
        self.profiled.note(outcome)  # the stall and saved bytes of the iteration the next policies are built from
        return judge(outcome, self.decisions)

    def _note_trial(self, outcome: IterationOutcome) -> None:
        """A GenPolicy trial: whether it held, recorded and fed back to the next generation."""
        policy = outcome.policy
        if outcome.stage != Stage.GEN_POLICY or policy is None:
            return
        held = trial_held(policy, outcome.peak_device_bytes, self.allowed_peak_bytes, outcome.passive_swaps,
                          outcome.oom_retries)
        # a trial on a shape larger than the traced one that failed, failed for the shape: no feedback
        grew = self.decisions.growth(outcome) > 1 + GROWTH_TOLERANCE
        self._record_trial(outcome, held, grew)

    def _note_warmup(self, outcome: IterationOutcome) -> None:
        """A WarmUp iteration: the chosen policy is kept in WarmUp only while it holds as expected."""
        if outcome.stage != Stage.WARMUP:
            return
        policy = outcome.policy
        self.stable.warmup_unsafe = bool(policy is not None and (outcome.oom_retries or (
            outcome.passive_swaps and not self.decisions.expected_passive_swaps(policy, outcome))))

    def follow(self, transition: Transition | None, outcome: IterationOutcome) -> None:
        """React to the stage machine's transition after ``outcome``'s iteration: a new GenPolicy stage
        generates afresh, Stable keeps the fastest trial that held, and a policy that stopped holding
        (a passive swap in the completed attempt, a Stable peak over the budget) makes the next ones
        stricter."""
        if transition is None:
            return
        if transition.after == Stage.WARMUP and transition.before != Stage.WARMUP:
            self.baseline.forget_timing()  # measured on another sequence: WarmUp measures it again
        if transition.cause == TransitionCause.SEQUENCE_CHANGED:
            self.spread.clear()  # a new program: what its predecessor saved is no expectation
        if transition.after == Stage.GEN_POLICY:
            self.round.need_policies = True
        elif transition.after == Stage.STABLE:
            self.round.repeat = None
            self.decisions.choose_after_trials(self.ranking)
        elif transition.after == Stage.WARMUP and transition.before != Stage.WARMUP and (
            transition.cause == TransitionCause.OVER_BUDGET
            or (transition.cause == TransitionCause.PASSIVE_SWAP and outcome.passive_swaps)
        ):
            over_bytes = outcome.peak_device_bytes - self.allowed_peak_bytes
            self._tighten(outcome.policy, max(outcome.passive_swap_bytes, over_bytes))

    def on_out_of_memory(self, policy_applied: Policy | None, refused_bytes: int, min_swap_bytes: int) -> RetryAction:
        """An attempt ran out of memory; what the retry changes (the executor applies it). ``policy_applied``
        is the policy the failed attempt ran under (None: it swapped every eligible tensor),
        ``refused_bytes`` what the host budget kept on the device in it, ``min_swap_bytes`` the executor's."""
        if policy_applied is not None:
            self._tighten(policy_applied)
            return RetryAction(RetryCause.POLICY_FAILED, min_swap_bytes, swap_everything=True)
        if refused_bytes:
            return RetryAction(RetryCause.HOST_BUDGET_FULL, min_swap_bytes, wait_for_host=True)
        if min_swap_bytes == 0:
            return RetryAction(RetryCause.EVERYTHING_SWAPPED, 0)
        lowered_bytes = min_swap_bytes // MIN_SWAP_DIVISOR
        return RetryAction(RetryCause.SMALL_TENSORS_KEPT, lowered_bytes if lowered_bytes >= MIN_SWAP_FLOOR_BYTES else 0)

    # ---- generation and trials --------------------------------------------------------------
    def _generate(self, trace: StepTrace, min_swap_bytes: int) -> None:
        basis = self.basis
        basis.min_swap_bytes = min_swap_bytes
        settings = self.decisions.settings_now()
        start = time.perf_counter()
        trace = self._expecting_variance(trace)
        result = generate_policies(trace, settings)
        basis.trace = trace
        basis.needed_bytes = max(0, result.no_swap_peak_bytes - settings.budget_bytes)
        basis.generation_s = time.perf_counter() - start
        self.round.regenerate = False
        feasible = [p for p in result.policies if p.feasible]
        if not feasible and any(r.held and r.policy.feasible for r in self.round.results):
            # feedback made the model stricter than reality: keep trying what already held
            logger.info("regenerated policies are predicted not to fit; keeping the ones that held")
            return
        # none predicted to fit: every policy, the closest first; passive swap absorbs the remainder and
        # the trials measure whether that beats swapping every eligible tensor (``policy.trials``)
        self.round.candidates = trial_order(result.policies)
        best = result.best
        logger.info(
            "generated %d policies (%d predicted to fit) from iteration %d in %.3f s, aiming %s under the "
            "budget; best: %s", len(result.policies), len(feasible), trace.iteration, basis.generation_s,
            format_bytes(settings.reserve_bytes), best.summary().splitlines()[0] if best else "none",
        )
        if best is not None and not best.feasible:
            logger.warning("no policy is predicted to fit the memory budget (%s); trying the closest ones, passive "
                           "swap taking the remainder", best.reason)

    def _expecting_variance(self, trace: StepTrace) -> StepTrace:
        """``trace`` grown to what each layer saved at most in the recent iterations (``policy.variance``):
        the policies expect the routing and the shapes seen, not only the traced one's."""
        by_layer, total = self.spread.worst_case(self.profiled.saved_by_layer.get(trace.iteration, {}))
        self.basis.generated_for = total
        if not by_layer:
            return trace
        logger.info("policies made for what the layers saved at most in the last %d iterations: up to %.2fx the "
                    "traced iteration %d's bytes in a layer, %.2fx in all", len(self.spread),
                    max(by_layer.values()), trace.iteration, total)
        return grown(trace, total, by_layer)

    def _record_trial(self, outcome: IterationOutcome, held: bool, grew: bool) -> None:
        """One trial's outcome, fed back into the next generation (``policy.trials.trial_feedback``): op
        times rescaled when they were off, the next policies aiming lower by what the trial missed."""
        policy, learned, trials = outcome.policy, self.learned, self.round
        assert policy is not None
        trials.results.append(TrialResult(policy, outcome.iteration_s, outcome.peak_device_bytes, held, outcome.passive_swap_bytes))
        feedback = trial_feedback(outcome, self.settings.budget_bytes, self._stricter_step_bytes(), grew)
        if feedback.time_ratio is not None:
            learned.time_scale *= feedback.time_ratio
            trials.regenerate = True
            logger.info("policy %s stalled %.1f ms (predicted %.1f): op times rescaled by %.2f", policy.name,
                        outcome.stall_s * 1e3, policy.predicted_stall_s * 1e3, feedback.time_ratio)
        if feedback.miss_bytes or feedback.explore_bytes:
            learned.reserve_bytes = min(self.settings.budget_bytes, learned.reserve_bytes + feedback.miss_bytes)
            trials.explore_bytes += feedback.explore_bytes
            trials.regenerate = True
            moved_bytes = feedback.miss_bytes + feedback.explore_bytes
            aim_bytes = self.decisions.settings_now().reserve_bytes
            logger.info("policy %s %s %s: the next trials aim %s under the budget", policy.name, feedback.miss,
                        format_bytes(moved_bytes), format_bytes(aim_bytes))

    def _stricter_step_bytes(self) -> int:
        """``STRICTER_SHARE`` of the needed reduction of the latest trace (at least one byte)."""
        return max(1, int(STRICTER_SHARE * self.basis.needed_bytes))

    def _tighten(self, failed: Policy | None, missed_bytes: int = 0) -> None:
        """A policy stopped holding (out of memory, a passive swap, a Stable peak over the budget): the next
        policies aim lower by what it missed, at least ``STRICTER_SHARE`` of the needed reduction, and any
        GenPolicy generates again. A policy predicted short that failed does not stop the next trials (rather
        than swapping everything from then on): the closest is still tried."""
        step_bytes = max(missed_bytes, self._stricter_step_bytes())
        self.learned.reserve_bytes = min(self.settings.budget_bytes, self.learned.reserve_bytes + step_bytes)
        self.round.regenerate = True
        logger.info("policy %s did not hold: the next policies aim %s under the budget",
                    failed.name if failed is not None else "(none)", format_bytes(self.learned.reserve_bytes))
