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

import dataclasses
import logging
import time
import types
from typing import Mapping

from chameleon_dist.policy.generator import generate_policies
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.outcome import IterationOutcome, RetryAction
from chameleon_dist.policy.ranking import TrialRanking
from chameleon_dist.policy.scaling import grown
from chameleon_dist.policy.tightening import (
    GROWTH_TOLERANCE,
    MAX_IN_PLACE_TIGHTENINGS,
    policies_for,
    stricter_than,
)
from chameleon_dist.policy.trials import (
    TrialResult,
    choose,
    compute_only,
    fastest_fitting_else_lowest,
    next_trial,
    passive_swaps_expected,
    trial_feedback,
    trial_held,
    trial_order,
)
from chameleon_dist.policy.variance import SavedBytesSpread
from chameleon_dist.trace.stages import RetryCause, Stage, Transition, TransitionCause, Verdict
from chameleon_dist.trace.step_trace import StepTrace
from chameleon_dist.units import format_bytes

__all__ = ["IterationOutcome", "MAX_IN_PLACE_TIGHTENINGS", "MIN_SWAP_DIVISOR", "PolicyController", "RetryAction",
           "RetryCause", "TrialResult", "Verdict"]

logger = logging.getLogger(__name__)

STRICTER_SHARE = 0.1
"""A policy that stopped holding makes the next policies aim further under the budget by what it missed
(the bytes passive swap moved, the peak over what it had to stay under), and by at least this share of
the needed reduction (no-swap peak - budget) when it fails outside a trial (out of memory, Stable) or by an
amount not known. A trial's known miss is added as measured: the trials go on, each narrower."""

SLIGHTLY_SHORT_SHARE = 0.5
"""Near the floor (issue 27, ``NEAR_FLOOR_FACTOR``): a Stable policy whose passive swaps moved at most this share of the needed
reduction (no-swap peak - budget), where swapping everything fitted the capacity, is slightly short: it is
tightened in place (or swaps everything in place when no stricter policy is predicted) rather than profiled
again. More than that, the policy no longer describes the job."""

NEAR_FLOOR_FACTOR = 1.5
"""The capacity is near the floor when it is at most this many times the peak of swapping everything (there,
policies predicted to fit are often slightly short, and swapping everything is the next stricter choice)."""

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
    ``Verdict`` ``record`` returns; what an out-of-memory retry changes is the ``RetryAction``
    ``on_out_of_memory`` returns.

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
        self._repeat: Policy | None = None  # the close pair's policy the next GenPolicy iteration tries again
        self.candidates: list[Policy] = []
        self.results: list[TrialResult] = []
        self.chosen: Policy | None = None
        self.version = 0
        self.reserve_bytes = 0  # how far under the budget the next policies aim
        self._explore_bytes = 0  # ... and further, until the next GenPolicy stage (``TrialFeedback.explore_bytes``)
        self.time_scale = 1.0  # measured compute time / the trace's, learned from the trials
        self.generation_s = 0.0
        self.headroom_bytes = 0  # how much one policy's peak moved between its trials, when one was chosen
        self._scaled_for = 1.0  # the chosen policy is made for this many times the trace's saved bytes
        self._trace_saved_bytes: dict[int, int] = {}  # saved bytes of the profiled iteration, by iteration
        self._trace_saved_by_layer: dict[int, Mapping[int, int]] = {}  # ... per layer
        self.spread = SavedBytesSpread()  # what the recent iterations saved per layer (``policy.variance``)
        self._generated_for = 1.0  # the latest generation's trace was grown to this many times its saved bytes
        self._in_place_left = 0  # in-place tightenings the chosen policy may still take
        self._no_stricter_policy = False  # the last in-place tightening found no policy predicted lower
        self._trace: StepTrace | None = None  # what the latest generation worked from (compute-only times)
        self._min_swap_bytes = settings.min_swap_bytes  # ... and with
        self._regenerate = False  # trial feedback asks for new policies before the next trial
        self._need_policies = False  # a GenPolicy stage began: generate before its first trial
        self._needed_bytes = 0  # no-swap peak - budget of the latest trace
        self._warmup_unsafe = False  # the chosen policy needed passive swaps or a retry in WarmUp
        self._swap_all_peak_bytes = 0  # peak of the latest WarmUp iteration that swapped everything
        self._swap_all_iteration_s: float | None = None  # ... its time (any stage), since the latest WarmUp began
        self._swap_all_held = False  # ... and it needed no passive swap
        self._trace_stall_s: dict[int, float] = {}  # stall of the profiled iteration, by iteration

    # ---- read API ---------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.settings.budget_bytes

    @property
    def allowed_peak_bytes(self) -> int:
        """What a policy must stay under: the budget, or, where no swap can meet it (a peak in the
        optimizer step, a link too slow), the peak of the swap-everything executor it replaces."""
        return max(self.settings.budget_bytes, self._swap_all_peak_bytes)

    @property
    def trace_stall_s(self) -> Mapping[int, float]:
        """The measured stall of the latest profiled iteration, keyed by its iteration number (the
        executor waited for copies then; those seconds are not compute)."""
        return types.MappingProxyType(self._trace_stall_s)

    def version_of(self, policy: Policy | None) -> int:
        """``version`` when ``policy`` is what the latest choice gave (the chosen policy, or None when that
        choice found none), else 0 (a trial, or swap-everything while a policy is chosen)."""
        return self.version if policy is self.chosen else 0

    # ---- per iteration ----------------------------------------------------------------------
    def policy_for(self, stage: Stage, trace: StepTrace | None, min_swap_bytes: int) -> Policy | None:
        """The policy an iteration in ``stage`` applies (None: swap every eligible tensor). ``trace`` is the
        latest detailed trace; GenPolicy generates from it when a new stage began or trials asked."""
        if stage == Stage.WARMUP:
            return self.chosen if not self._warmup_unsafe else None
        if stage == Stage.GEN_POLICY:
            if self._need_policies or self._regenerate:
                if self._need_policies:
                    self.results, self._explore_bytes, self._repeat = [], 0, None
                self._need_policies = False
                if trace is None:
                    return None
                stall_s = self._trace_stall_s.get(trace.iteration, 0.0)
                self._generate(compute_only(trace, stall_s, self.time_scale), min_swap_bytes)
            return self._repeat if self._repeat is not None else next_trial(self.candidates, self.results)
        if stage == Stage.STABLE:
            return self.chosen
        return None

    def record(self, outcome: IterationOutcome) -> Verdict:
        """Account one completed iteration and judge it: the stage machine goes back to WarmUp
        (``Verdict.restart``) when, outside WarmUp, passive swaps were needed that no rule absorbs (those of
        a failed attempt only under a GenPolicy trial, whose failure is fed back to the next trials), or a
        Stable iteration went over what its policy must stay under and could not be absorbed in place."""
        over_budget, absorbed, tightened = self._judge(outcome)
        # a trial that failed is fed back and the trials go on (``_judge``): the trace is still this program's
        trial = outcome.stage == Stage.GEN_POLICY and outcome.policy is not None
        self._repeat = self._next_repeat() if trial else None
        more = self._repeat is not None
        counted = (0 if absorbed else outcome.passive_swaps) + (0 if trial else outcome.failed_attempt_passive_swaps)
        absorbed_swaps = outcome.passive_swaps if absorbed else 0
        if counted and outcome.stage != Stage.WARMUP:
            return Verdict(TransitionCause.PASSIVE_SWAP, f"{counted} passive swap(s): the device ran out of memory",
                           absorbed_swaps, tightened, more)
        if over_budget:
            return Verdict(TransitionCause.OVER_BUDGET, over_budget, absorbed_swaps, tightened, more)
        return Verdict(None, "", absorbed_swaps, tightened, more)

    def _next_repeat(self) -> Policy | None:
        """After the GenPolicy stage's ``settings.trials`` trials: the policy of a contested ranking to try
        again (``policy.ranking.to_repeat``), while fewer than ``ranking.max_repeats`` extra trials ran; else
        None (the trials are done)."""
        extra = len(self.results) - self.settings.trials
        if extra < 0 or extra >= self.ranking.max_repeats:
            return None
        choice = choose(self.results, self.allowed_peak_bytes, self._swap_all_iteration_s, self.ranking.margin)
        if choice.repeat is not None:
            logger.info("trials within %.1f%% of each other (the fastest swaps more, or swapping everything was as "
                        "fast): policy %s tried again (extra trial %d of at most %d)", 100 * self.ranking.margin,
                        choice.repeat.name, extra + 1, self.ranking.max_repeats)
        return choice.repeat

    def _judge(self, outcome: IterationOutcome) -> tuple[str, bool, bool]:
        """``record``'s accounting: the reason when a Stable iteration went over what its policy must stay
        under and could not be absorbed in place (else ""), whether the completed attempt's passive swaps
        are absorbed, and whether the chosen policy was tightened in place."""
        policy, allowed = outcome.policy, self.allowed_peak_bytes
        absorbed = False
        if outcome.stage == Stage.GEN_POLICY and policy is not None:
            held = trial_held(policy, outcome.peak_device_bytes, allowed, outcome.passive_swaps, outcome.oom_retries)
            # a trial on a shape larger than the traced one that failed, failed for the shape: no feedback
            grew = self._growth(outcome) > 1 + GROWTH_TOLERANCE
            self._record_trial(outcome, held, grew)
            # a trial's passive swaps are fed back (``_record_trial``), and so is its running out of memory (the
            # retry made the next policies stricter): profiling the same program again would find the same ones
            absorbed = bool(outcome.passive_swaps)
        if policy is None and not outcome.oom_retries:  # what the last resort measured, to compare trials with
            self._swap_all_iteration_s = outcome.iteration_s
            if outcome.stage == Stage.WARMUP:
                self._swap_all_peak_bytes = outcome.peak_device_bytes
        if policy is None and outcome.stage == Stage.WARMUP:
            self._swap_all_held = not (outcome.oom_retries or outcome.passive_swaps)
        if outcome.stage == Stage.WARMUP:  # the chosen policy is kept in WarmUp only while it holds as expected
            self._warmup_unsafe = bool(policy is not None and (outcome.oom_retries or (
                outcome.passive_swaps and not self._expected_passive_swaps(policy, outcome))))
        self.spread.note(outcome.saved_bytes_by_layer)
        if outcome.profiled:  # the stall and saved bytes of the iteration the next policies are built from
            self._trace_stall_s = {outcome.iteration: outcome.attempt_stall_s}
            self._trace_saved_bytes = {outcome.iteration: outcome.saved_bytes}
            self._trace_saved_by_layer = {outcome.iteration: outcome.saved_bytes_by_layer}
        if outcome.stage != Stage.STABLE or policy is None or policy is not self.chosen:
            return "", absorbed, False
        failed = outcome.passive_swaps or outcome.peak_device_bytes > allowed
        if failed and not outcome.oom_retries and self._scale_for(outcome):
            return "", bool(outcome.passive_swaps), False
        if outcome.peak_device_bytes <= allowed and self._expected_passive_swaps(policy, outcome):
            return "", True, False  # the remainder of a policy predicted short, as its trials had
        if (outcome.passive_swaps and not outcome.oom_retries and self._swap_all_fits()
                and 0 < outcome.passive_swap_bytes <= SLIGHTLY_SHORT_SHARE * self._needed_bytes):
            # near the floor: a policy slightly short where swapping everything fits is tightened in place by
            # what passive swap moved (and the peak over what it must stay under), not profiled again
            shortfall_bytes = max(outcome.passive_swap_bytes, outcome.peak_device_bytes - allowed, 1)
            reason = (f"{outcome.passive_swaps} passive swap(s) ({format_bytes(outcome.passive_swap_bytes)}) under "
                      f"policy {policy.name}")
            if (self._tighten_in_place(policy, shortfall_bytes, reason, peak_within_capacity=True)
                    or self._swap_all_in_place(reason)):
                return "", True, True
        if outcome.peak_device_bytes > allowed:
            reason = (f"peak {format_bytes(outcome.peak_device_bytes)} above memory_budget "
                      f"{format_bytes(self.settings.budget_bytes)} under policy {policy.name}")
            if outcome.passive_swaps:
                return reason, absorbed, False
            if (self._tighten_in_place(policy, outcome.peak_device_bytes - allowed, reason)
                    or (self._no_stricter_policy and self._swap_all_in_place(reason))):
                return "", absorbed, True
            if self.capacity_bytes is not None and outcome.peak_device_bytes <= self.capacity_bytes:
                # variance (routing, lengths) the in-place tightenings did not remove, with nothing passively
                # swapped and the capacity held: not a new program, so profiling again would find the same
                logger.info("%s, within the capacity %s and with no passive swap: policy %s kept", reason,
                            format_bytes(self.capacity_bytes), policy.name)
                return "", absorbed, False
            return reason, absorbed, False
        return "", absorbed, False

    def _expected_passive_swaps(self, policy: Policy, outcome: IterationOutcome) -> bool:
        """``outcome``'s passive swaps (without an out-of-memory retry) under the chosen ``policy`` are what
        its trials measured (``policy.trials.passive_swaps_expected``): a policy predicted short, kept with
        passive swap for the remainder."""
        return (policy is self.chosen and bool(outcome.passive_swaps) and not outcome.oom_retries
                and passive_swaps_expected(self.results, policy, outcome.passive_swap_bytes))

    def _scale_for(self, outcome: IterationOutcome) -> bool:
        """The chosen policy failed on an iteration that saved more than the traced one: a policy from the
        trace grown to the new size (``policy.scaling.grown``), applied without trials (the fastest
        predicted to fit, else the one predicted lowest). False when the iteration did not grow beyond what
        the policy is made for (then the runtime profiles again)."""
        growth = self._growth(outcome)
        if growth <= self._scaled_for * (1 + GROWTH_TOLERANCE):
            return False
        policies = policies_for(self._trace, growth, self._settings_now())
        if not policies:
            return False
        best = fastest_fitting_else_lowest(policies)  # (the grown trace is a model: the closest is worth a try)
        self.chosen = best
        self.version += 1
        self._scaled_for = growth
        logger.info("iteration %d saved %.2fx the traced bytes (a new shape) and its policy did not hold: policy "
                    "%s made for the trace grown alike chosen (v%d)", outcome.iteration, growth, self.chosen.name,
                    self.version)
        return True

    def _growth(self, outcome: IterationOutcome) -> float:
        """The bytes ``outcome``'s iteration saved for backward over those of the latest generation's
        trace (1.0 when either is unknown)."""
        traced = self._trace_saved_bytes.get(self._trace.iteration, 0) * self._generated_for if self._trace else 0
        return outcome.saved_bytes / traced if traced and outcome.saved_bytes else 1.0

    def _settings_now(self) -> PolicySettings:
        """What the latest generation worked with (the settings, its ``min_swap_bytes``), aiming the reserve
        now under the budget, plus what this GenPolicy stage explores (or the chosen policy explored)."""
        reserve_bytes = min(self.settings.budget_bytes, self.reserve_bytes + self._explore_bytes)
        return dataclasses.replace(self.settings, min_swap_bytes=self._min_swap_bytes, reserve_bytes=reserve_bytes)

    def _swap_all_fits(self) -> bool:
        """Near the floor: the latest WarmUp iteration that swapped everything completed within the capacity
        (the floor fits), and the capacity is at most ``NEAR_FLOOR_FACTOR`` times its peak."""
        floor = self._swap_all_peak_bytes
        return bool(floor) and self.capacity_bytes is not None and floor <= self.capacity_bytes <= NEAR_FLOOR_FACTOR * floor

    def _swap_all_in_place(self, reason: str) -> bool:
        """No stricter policy is predicted for a chosen policy slightly short, but swapping every eligible
        tensor fitted the capacity in WarmUp (the floor fits): swap everything in Stable, in place, rather
        than profile again (the next stricter choice; the trace is the same). False when the floor does not
        fit or there is no policy to leave."""
        if self.chosen is None or not self._swap_all_fits():
            return False
        logger.info("%s; no stricter policy is predicted, and swapping every eligible tensor peaked at %s within "
                    "the capacity: swapping everything in place (v%d)", reason,
                    format_bytes(self._swap_all_peak_bytes), self.version + 1)
        self.chosen = None
        self.version += 1
        self._in_place_left = 0
        return True

    def _tighten_in_place(self, policy: Policy, shortfall_bytes: int, reason: str,
                          peak_within_capacity: bool = False) -> bool:
        """A Stable overshoot within the capacity: a stricter policy from the same trace, without trials.
        False when it cannot be absorbed (over the capacity, out of tightenings, no policy predicted to
        fit or at least lower than ``policy``). ``peak_within_capacity``: the shortfall is what passive swap
        moved in an iteration that completed within the capacity (not a peak over it)."""
        within_capacity = (peak_within_capacity or self.capacity_bytes is None
                           or self.allowed_peak_bytes + shortfall_bytes <= self.capacity_bytes)
        self._no_stricter_policy = False
        if not within_capacity or self._in_place_left <= 0 or self._trace is None or policy is not self.chosen:
            return False
        step_bytes = max(1, 2 ** (MAX_IN_PLACE_TIGHTENINGS - self._in_place_left) * shortfall_bytes)
        stricter, reserve_bytes = stricter_than(policy, self._trace, self._scaled_for, self._settings_now(), step_bytes)
        self.reserve_bytes = reserve_bytes - self._explore_bytes
        if not stricter:
            self._no_stricter_policy = True
            logger.info("%s; no stricter policy is predicted", reason)
            return False
        best = fastest_fitting_else_lowest(stricter)
        self._in_place_left -= 1
        self.chosen = best
        self.version += 1
        logger.info("%s (within the capacity): policy %s chosen in place (v%d), aiming %s under the budget",
                    reason, self.chosen.name, self.version, format_bytes(self.reserve_bytes))
        return True

    def follow(self, transition: Transition | None, outcome: IterationOutcome) -> None:
        """React to the stage machine's transition after ``outcome``'s iteration: a new GenPolicy stage
        generates afresh, Stable keeps the fastest trial that held, and a policy that stopped holding
        (a passive swap in the completed attempt, a Stable peak over the budget) makes the next ones
        stricter."""
        if transition is None:
            return
        if transition.after == Stage.WARMUP and transition.before != Stage.WARMUP:
            self._swap_all_iteration_s = None  # measured on another sequence: WarmUp measures it again
            self._swap_all_held = False
        if transition.cause == TransitionCause.SEQUENCE_CHANGED:
            self.spread.clear()  # a new program: what its predecessor saved is no expectation
        if transition.after == Stage.GEN_POLICY:
            self._need_policies = True
        elif transition.after == Stage.STABLE:
            self._repeat = None
            self._choose()
        elif transition.after == Stage.WARMUP and transition.before != Stage.WARMUP and (
            transition.cause == TransitionCause.OVER_BUDGET
            or (transition.cause == TransitionCause.PASSIVE_SWAP and outcome.passive_swaps)
        ):
            self._tighten(outcome.policy,
                          max(outcome.passive_swap_bytes, outcome.peak_device_bytes - self.allowed_peak_bytes))

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
        self._min_swap_bytes = min_swap_bytes
        settings = self._settings_now()
        start = time.perf_counter()
        trace = self._expecting_variance(trace)
        result = generate_policies(trace, settings)
        self._trace = trace
        self._needed_bytes = max(0, result.no_swap_peak_bytes - settings.budget_bytes)
        self.generation_s = time.perf_counter() - start
        self._regenerate = False
        feasible = [p for p in result.policies if p.feasible]
        if not feasible and any(r.held and r.policy.feasible for r in self.results):
            # feedback made the model stricter than reality: keep trying what already held
            logger.info("regenerated policies are predicted not to fit; keeping the ones that held")
            return
        # none predicted to fit: every policy, the closest first; passive swap absorbs the remainder and
        # the trials measure whether that beats swapping every eligible tensor (``policy.trials``)
        self.candidates = trial_order(result.policies)
        best = result.best
        logger.info(
            "generated %d policies (%d predicted to fit) from iteration %d in %.3f s, aiming %s under the "
            "budget; best: %s", len(result.policies), len(feasible), trace.iteration, self.generation_s,
            format_bytes(settings.reserve_bytes), best.summary().splitlines()[0] if best else "none",
        )
        if best is not None and not best.feasible:
            logger.warning("no policy is predicted to fit the memory budget (%s); trying the closest ones, passive "
                           "swap taking the remainder", best.reason)

    def _expecting_variance(self, trace: StepTrace) -> StepTrace:
        """``trace`` grown to what each layer saved at most in the recent iterations (``policy.variance``):
        the policies expect the routing and the shapes seen, not only the traced one's."""
        by_layer, total = self.spread.worst_case(self._trace_saved_by_layer.get(trace.iteration, {}))
        self._generated_for = total
        if not by_layer:
            return trace
        logger.info("policies made for what the layers saved at most in the last %d iterations: up to %.2fx the "
                    "traced iteration %d's bytes in a layer, %.2fx in all", len(self.spread),
                    max(by_layer.values()), trace.iteration, total)
        return grown(trace, total, by_layer)

    def _record_trial(self, outcome: IterationOutcome, held: bool, grew: bool) -> None:
        """One trial's outcome, fed back into the next generation (``policy.trials.trial_feedback``): op
        times rescaled when they were off, the next policies aiming lower by what the trial missed."""
        policy = outcome.policy
        assert policy is not None
        self.results.append(
            TrialResult(policy, outcome.iteration_s, outcome.peak_device_bytes, held, outcome.passive_swap_bytes))
        feedback = trial_feedback(outcome, self.settings.budget_bytes, self._stricter_step_bytes(), grew)
        if feedback.time_ratio is not None:
            self.time_scale *= feedback.time_ratio
            self._regenerate = True
            logger.info("policy %s stalled %.1f ms (predicted %.1f): op times rescaled by %.2f", policy.name,
                        outcome.stall_s * 1e3, policy.predicted_stall_s * 1e3, feedback.time_ratio)
        if feedback.miss_bytes or feedback.explore_bytes:
            self.reserve_bytes = min(self.settings.budget_bytes, self.reserve_bytes + feedback.miss_bytes)
            self._explore_bytes += feedback.explore_bytes
            self._regenerate = True
            moved_bytes, aim_bytes = feedback.miss_bytes + feedback.explore_bytes, self._settings_now().reserve_bytes
            logger.info("policy %s %s %s: the next trials aim %s under the budget", policy.name, feedback.miss,
                        format_bytes(moved_bytes), format_bytes(aim_bytes))

    def _stricter_step_bytes(self) -> int:
        """``STRICTER_SHARE`` of the needed reduction of the latest trace (at least one byte)."""
        return max(1, int(STRICTER_SHARE * self._needed_bytes))

    def _choose(self) -> None:
        """Keep what ``policy.trials.choose`` says: the fastest policy that held with headroom (how much one
        policy's peak moved between its trials), the fastest that held when none has it, none (swap every
        eligible tensor) when none held or when swapping everything was measured faster than every policy
        that held."""
        self.chosen = None
        if not self.results:
            return
        choice = choose(self.results, self.allowed_peak_bytes, self._swap_all_iteration_s, self.ranking.margin)
        if choice.best is None and not choice.swap_all_faster and self._choose_untried():
            return
        if choice.best is None:
            logger.warning("%s; swapping every eligible tensor until the next policy", (
                f"swapping everything was measured faster ({self._swap_all_iteration_s * 1e3:.1f} ms/iteration) than "
                f"every policy that held" if choice.swap_all_faster else f"none of {len(self.results)} policy trials "
                "held the memory budget" + (", none is predicted to fit, and swapping everything held in WarmUp without "
                                            "passive swap" if self._swap_all_held else "")
                + " (lower memory_budget or min_swap_bytes if this repeats)"))
            return
        best = choice.best
        # policies without trials (in place, grown shapes) start from what the chosen one aimed for
        self._explore_bytes = max(0, int(best.policy.settings.get("reserve_bytes", 0)) - self.reserve_bytes)
        self.headroom_bytes = choice.headroom_bytes
        self.chosen = best.policy
        self.version += 1
        self._in_place_left = MAX_IN_PLACE_TIGHTENINGS
        self._scaled_for = 1.0
        logger.info(
            "policy %s chosen (v%d): %.1f ms/iteration, peak %s (headroom %s%s)%s", best.policy.name, self.version,
            best.iteration_s * 1e3, format_bytes(best.peak_bytes), format_bytes(self.headroom_bytes),
            "" if choice.roomy else "; no trial had it",
            f"; predicted short, passive swap takes {format_bytes(best.passive_swap_bytes)}"
            if best.passive_swap_bytes else "",
        )

    def _choose_untried(self) -> bool:
        """None of the trials held: rather than swap everything, apply (untried) the policy the trials'
        feedback made stricter: the fastest predicted to fit, else the one predicted lowest. If it does not
        hold either, Stable's own checks send the runtime back to WarmUp. False when there is no trace, or
        when none is predicted to fit and swapping everything held in WarmUp without passive swap (issue 27:
        a policy predicted short that no trial confirmed would lean on passive swap every iteration)."""
        if self._trace is None:
            return False
        policies = policies_for(self._trace, 1.0, self._settings_now())
        if not policies or (self._swap_all_held and not any(p.feasible for p in policies)):
            return False  # (none predicted to fit, where swapping everything held: that is kept instead)
        self.chosen = fastest_fitting_else_lowest(policies)
        self.version += 1
        self._in_place_left = MAX_IN_PLACE_TIGHTENINGS
        self._scaled_for = 1.0
        logger.warning("none of %d policy trials held the memory budget; policy %s, stricter by their feedback "
                       "(aiming %s under the budget), chosen untried (v%d)", len(self.results), self.chosen.name,
                       format_bytes(self.reserve_bytes), self.version)
        return True

    def _tighten(self, failed: Policy | None, missed_bytes: int = 0) -> None:
        """A policy stopped holding (out of memory, a passive swap, a Stable peak over the budget): the next
        policies aim lower by what it missed, at least ``STRICTER_SHARE`` of the needed reduction, and any
        GenPolicy generates again. A policy predicted short that failed does not stop the next trials (rather
        than swapping everything from then on): the closest is still tried."""
        step_bytes = max(missed_bytes, self._stricter_step_bytes())
        self.reserve_bytes = min(self.settings.budget_bytes, self.reserve_bytes + step_bytes)
        self._regenerate = True
        logger.info("policy %s did not hold: the next policies aim %s under the budget",
                    failed.name if failed is not None else "(none)", format_bytes(self.reserve_bytes))
