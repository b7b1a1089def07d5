"""``PolicyController``: the one place that decides which swap policy an iteration applies.

The runtime asks it, at the start of every iteration, which policy to apply (``policy_for``), tells it
what the iteration did (``record``), and passes on the stage machine's transitions (``follow``) and
out-of-memory retries (``on_out_of_memory``). Everything about choosing, trying, keeping and tightening
policies lives here; the runtime only sequences device, profiler, executor and this controller.

Per stage (the paper's Algorithm 1, ``trace.stages``):

- **WarmUp** applies the last chosen policy to what it matches confidently, or swaps every eligible tensor
  when there is none yet or the last WarmUp iteration under it needed passive swaps or a retry.
- **GenPolicy** generates candidates from the latest detailed trace (the paper generates n=5) and tries
  one per iteration; trial outcomes feed back into the next generation (a missed budget makes the next
  policies aim lower, a mispredicted compute time rescales the trace's op times).
- **Stable** applies the fastest policy that held with headroom: its measured peak at least the largest
  move of one policy's peak between its trials (timing jitter, routing, shapes) under what a policy must
  stay under. A Stable peak over the budget but within the device's capacity tightens the policy in place
  (the shortfall added to the reduction the policy aims for, a new policy generated from the same trace,
  no trials) up to ``MAX_IN_PLACE_TIGHTENINGS`` times per choice; only the next overshoot, or one above
  the capacity, sends the runtime back to WarmUp.
- **Shapes never seen before** (a longer sequence, a bigger batch: more bytes saved for backward than in
  the traced iteration) are handled by scaling first: when the chosen policy needs passive swaps or goes
  over the budget on such an iteration, a policy is generated from the same trace grown to the new size
  (``policy.scaling.grown``) and applied at once; only when that fails too does the runtime profile
  again.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import types
from typing import Mapping

from chameleon_dist.policy.generator import generate_policies
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.scaling import grown
from chameleon_dist.trace.stages import Stage, Transition, TransitionCause
from chameleon_dist.trace.step_trace import StepTrace
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

STALL_TOLERANCE = 0.02  # of the iteration: more unpredicted stall than this triggers a timing rescale
TIME_TOLERANCE = 0.25  # ... when the measured compute time is this far from the trace's

STRICTER_SHARE = 0.1
"""After a passive swap under a policy, the next policies aim this share of the needed reduction (no-swap
peak - budget) further under the budget."""

MAX_IN_PLACE_TIGHTENINGS = 3
"""Stable peaks over the budget (within the capacity) absorbed by tightening the chosen policy in place;
the next one sends the runtime back to WarmUp. The k-th adds 2**(k-1) times its shortfall to the reduction
the policy aims for (a policy that missed again needs more than its last miss), and doubles that step up
to ``STRICTER_SEARCH_STEPS`` times until a policy predicted lower than the one that went over comes out."""

STRICTER_SEARCH_STEPS = 6

GROWTH_TOLERANCE = 0.05
"""Saved bytes this much (relative) above what the chosen policy was made for make an iteration a new,
larger shape, which is scaled for before the runtime profiles again."""

MIN_COMPUTE_SHARE = 1 / 20
"""The profiled iteration's compute time is taken as at least this share of its measured time, however
much of it the swap-everything executor stalled."""


@dataclasses.dataclass(frozen=True)
class IterationOutcome:
    """What one completed iteration did, as the controller needs it. ``passive_swaps`` are those of the
    attempt that completed; ``oom_retries`` counts the attempts that did not."""

    iteration: int
    stage: Stage
    policy: Policy | None  # the policy the iteration started with (None: every eligible tensor swapped)
    peak_bytes: int
    iteration_s: float
    stall_s: float  # the whole iteration's, failed attempts included
    attempt_stall_s: float  # the completed attempt's
    passive_swaps: int
    oom_retries: int
    profiled: bool  # a detailed trace of this iteration was recorded (WarmUp)
    saved_bytes: int = 0  # bytes autograd saved for backward in the completed attempt


@dataclasses.dataclass(frozen=True)
class TrialResult:
    """One GenPolicy trial: a policy, what it measured, and whether it held (peak within what a policy
    must stay under, no passive swap, no out-of-memory retry)."""

    policy: Policy
    iteration_s: float
    peak_bytes: int
    held: bool


class RetryAction(enum.StrEnum):
    """What the next attempt of an iteration that ran out of memory does differently."""

    SWAP_EVERYTHING = "swap_everything"  # the applied policy did not hold: drop it for this iteration
    WAIT_FOR_HOST = "wait_for_host"  # the host budget refused swaps: swapping more cannot help
    RETRY_AS_IS = "retry_as_is"  # already everything is swapped: a transient shortage may pass
    LOWER_MIN_SWAP = "lower_min_swap"  # swap smaller tensors too (``min_swap_bytes`` goes down)


def _fastest_fitting_else_lowest(policies: list[Policy]) -> Policy:
    """The policy applied without trials: the fastest predicted to fit, else the one predicted lowest."""
    feasible = [p for p in policies if p.feasible]
    if feasible:
        return min(feasible, key=lambda p: p.predicted_iteration_s)
    return min(policies, key=lambda p: p.predicted_peak_bytes)


class PolicyController:
    """Chooses, tries, keeps and tightens swap policies for one runtime.

    Args:
        settings: what the generator works with: the memory budget, the host-link rates in each
            direction, the host budget and the number of trials (``profiler.policy_trials``).
            ``min_swap_bytes`` is taken per generation from ``policy_for`` (the executor lowers it after
            out-of-memory errors); ``reserve_bytes`` is the controller's own (it grows when policies miss).
        capacity_bytes: the device's memory. A Stable peak over the budget but not over this is
            tightened in place; None: every Stable peak over the budget sends the runtime to WarmUp.

    Read API (for reports and benchmarks): ``chosen`` (the policy Stable applies, or None),
    ``version`` (how many times one was chosen), ``candidates``, ``results`` (the trials of the current
    GenPolicy stage), ``reserve_bytes``, ``headroom_bytes`` (the choice's), ``time_scale``,
    ``generation_s``, ``trace_stall_s``, ``tightened_in_place`` and ``absorbed_passive_swaps`` (by the
    latest ``record``: the stage machine must not restart for that iteration's passive swaps) and
    ``version_of(policy)``.

    Example::

        controller = PolicyController(PolicySettings(budget_bytes=..., d2h_bytes_per_s=..., h2d_bytes_per_s=...))
        policy = controller.policy_for(stage, profiler.last_trace, executor.min_swap_bytes)
        ...  # run the iteration with ``policy``
        over_budget = controller.record(outcome)  # an IterationOutcome
        transition = stage_machine.advance(..., over_budget=over_budget)
        controller.follow(transition, outcome)
    """

    def __init__(self, settings: PolicySettings, capacity_bytes: int | None = None) -> None:
        self.settings = settings
        self.capacity_bytes = capacity_bytes
        self.candidates: list[Policy] = []
        self.results: list[TrialResult] = []
        self.chosen: Policy | None = None
        self.version = 0
        self.reserve_bytes = 0  # how far under the budget the next policies aim
        self.time_scale = 1.0  # measured compute time / the trace's, learned from the trials
        self.generation_s = 0.0
        self.headroom_bytes = 0  # how much one policy's peak moved between its trials, when one was chosen
        self.tightened_in_place = False  # the latest recorded iteration tightened the chosen policy in place
        self.absorbed_passive_swaps = False  # ... and its passive swaps were absorbed by scaling the policy
        self._scaled_for = 1.0  # the chosen policy is made for this many times the trace's saved bytes
        self._trace_saved_bytes: dict[int, int] = {}  # saved bytes of the profiled iteration, by iteration
        self._in_place_left = 0  # in-place tightenings the chosen policy may still take
        self._trace: StepTrace | None = None  # what the latest generation worked from (compute-only times)
        self._min_swap_bytes = settings.min_swap_bytes  # ... and with
        self._regenerate = False  # trial feedback asks for new policies before the next trial
        self._need_policies = False  # a GenPolicy stage began: generate before its first trial
        self._infeasible_failed = False  # a policy predicted not to fit was tried and did not hold
        self._needed_bytes = 0  # no-swap peak - budget of the latest trace
        self._warmup_unsafe = False  # the chosen policy needed passive swaps or a retry in WarmUp
        self._swap_all_peak_bytes = 0  # peak of the latest WarmUp iteration that swapped everything
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
                    self.results = []
                self._need_policies = False
                if trace is None:
                    return None
                self._generate(self._compute_only(trace), min_swap_bytes)
            return self._next_trial()
        if stage == Stage.STABLE:
            return self.chosen
        return None

    def record(self, outcome: IterationOutcome) -> str:
        """Account one completed iteration. Returns a reason when a Stable iteration went over what its
        policy must stay under and could not be absorbed in place (the stage machine then goes back to
        WarmUp), else ""."""
        policy, allowed = outcome.policy, self.allowed_peak_bytes
        self.tightened_in_place = self.absorbed_passive_swaps = False
        if outcome.stage == Stage.GEN_POLICY and policy is not None:
            held = outcome.peak_bytes <= allowed and not outcome.passive_swaps and not outcome.oom_retries
            # a trial on a shape larger than the traced one that failed, failed for the shape: it counts as
            # not held, but neither aims the next policies lower nor stops the other trials (scaling comes
            # first once a policy is chosen)
            grew = self._growth(outcome) > 1 + GROWTH_TOLERANCE
            self._record_trial(policy, outcome.iteration_s, outcome.peak_bytes, held, outcome.stall_s, grew)
            self.absorbed_passive_swaps = bool(outcome.passive_swaps and not outcome.oom_retries and grew)
        if outcome.stage == Stage.WARMUP and policy is None and not outcome.oom_retries:
            self._swap_all_peak_bytes = outcome.peak_bytes
        if outcome.stage == Stage.WARMUP:  # the chosen policy is kept in WarmUp only while it holds without help
            self._warmup_unsafe = bool(policy is not None and (outcome.passive_swaps or outcome.oom_retries))
        if outcome.profiled:  # the stall and saved bytes of the iteration the next policies are built from
            self._trace_stall_s = {outcome.iteration: outcome.attempt_stall_s}
            self._trace_saved_bytes = {outcome.iteration: outcome.saved_bytes}
        if outcome.stage != Stage.STABLE or policy is None or policy is not self.chosen:
            return ""
        failed = outcome.passive_swaps or outcome.peak_bytes > allowed
        if failed and not outcome.oom_retries and self._scale_for(outcome):
            self.absorbed_passive_swaps = bool(outcome.passive_swaps)
            return ""
        if outcome.peak_bytes > allowed:
            reason = (f"peak {format_bytes(outcome.peak_bytes)} above memory_budget "
                      f"{format_bytes(self.settings.budget_bytes)} under policy {policy.name}")
            if outcome.passive_swaps or not self._tighten_in_place(policy, outcome.peak_bytes - allowed, reason):
                return reason
        return ""

    def _scale_for(self, outcome: IterationOutcome) -> bool:
        """The chosen policy failed on an iteration that saved more than the traced one: a policy from the
        trace grown to the new size (``policy.scaling.grown``), applied without trials (the fastest
        predicted to fit, else the one predicted lowest). False when the iteration did not grow beyond what
        the policy is made for (then the runtime profiles again)."""
        growth = self._growth(outcome)
        if growth <= self._scaled_for * (1 + GROWTH_TOLERANCE):
            return False
        policies = self._policies_for(growth)
        if not policies:
            return False
        best = _fastest_fitting_else_lowest(policies)  # (the grown trace is a model: the closest is worth a try)
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
        traced = self._trace_saved_bytes.get(self._trace.iteration, 0) if self._trace is not None else 0
        return outcome.saved_bytes / traced if traced and outcome.saved_bytes else 1.0

    def _policies_for(self, growth: float) -> list[Policy]:
        """Policies, without trials, from the latest trace grown ``growth`` times (``policy.scaling``)."""
        settings = dataclasses.replace(self.settings, min_swap_bytes=self._min_swap_bytes, reserve_bytes=self.reserve_bytes)
        return generate_policies(grown(self._trace, growth), settings).policies

    def _tighten_in_place(self, policy: Policy, shortfall_bytes: int, reason: str) -> bool:
        """A Stable overshoot within the capacity: a stricter policy from the same trace, without trials.
        False when it cannot be absorbed (over the capacity, out of tightenings, no policy predicted to
        fit or at least lower than ``policy``)."""
        within_capacity = self.capacity_bytes is None or self.allowed_peak_bytes + shortfall_bytes <= self.capacity_bytes
        if not within_capacity or self._in_place_left <= 0 or self._trace is None or policy is not self.chosen:
            return False
        step_bytes = max(1, 2 ** (MAX_IN_PLACE_TIGHTENINGS - self._in_place_left) * shortfall_bytes)
        stricter: list[Policy] = []
        for _ in range(STRICTER_SEARCH_STEPS):  # a policy predicted lower than the one that went over
            self.reserve_bytes = min(self.settings.budget_bytes, self.reserve_bytes + step_bytes)
            policies = self._policies_for(self._scaled_for)
            stricter = [p for p in policies if p.predicted_peak_bytes < policy.predicted_peak_bytes]
            if stricter or self.reserve_bytes >= self.settings.budget_bytes:
                break
            step_bytes *= 2
        if not stricter:
            logger.info("%s; no stricter policy is predicted: profiling again", reason)
            return False
        best = _fastest_fitting_else_lowest(stricter)
        self._in_place_left -= 1
        self.chosen = best
        self.version += 1
        self.tightened_in_place = True
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
        if transition.after == Stage.GEN_POLICY:
            self._need_policies = True
        elif transition.after == Stage.STABLE:
            self._choose()
        elif transition.after == Stage.WARMUP and transition.before != Stage.WARMUP and (
            transition.cause == TransitionCause.OVER_BUDGET
            or (transition.cause == TransitionCause.PASSIVE_SWAP and outcome.passive_swaps)
        ):
            self._tighten(outcome.policy)

    def on_out_of_memory(self, policy_applied: Policy | None, refused_bytes: int, min_swap_bytes: int) -> RetryAction:
        """An attempt ran out of memory; what the retry changes. ``policy_applied`` is the policy the failed
        attempt ran under (None: it swapped every eligible tensor), ``refused_bytes`` what the host
        budget kept on the device in it."""
        if policy_applied is not None:
            self._tighten(policy_applied)
            return RetryAction.SWAP_EVERYTHING
        if refused_bytes:
            return RetryAction.WAIT_FOR_HOST
        if min_swap_bytes == 0:
            return RetryAction.RETRY_AS_IS
        return RetryAction.LOWER_MIN_SWAP

    # ---- generation and trials --------------------------------------------------------------
    def _compute_only(self, trace: StepTrace) -> StepTrace:
        """The trace with every time scaled to compute only: the profiled iteration's stalls were the
        swap-everything executor's waits. Measured layer times shrink alike (they carry the detailed
        recorder's cost and the forward pass's share of the stalls too)."""
        stall_s = self._trace_stall_s.get(trace.iteration, 0.0)
        compute_s = max(trace.iteration_s - stall_s, trace.iteration_s * MIN_COMPUTE_SHARE)
        scale = compute_s * self.time_scale / max(trace.iteration_s, 1e-12)
        return dataclasses.replace(
            trace, iteration_s=trace.iteration_s * scale,
            layer_times_s={layer: t * scale for layer, t in trace.layer_times_s.items()},
        )

    def _generate(self, trace: StepTrace, min_swap_bytes: int) -> None:
        settings = dataclasses.replace(self.settings, min_swap_bytes=min_swap_bytes, reserve_bytes=self.reserve_bytes)
        start = time.perf_counter()
        result = generate_policies(trace, settings)
        self._trace, self._min_swap_bytes = trace, min_swap_bytes
        self._needed_bytes = max(0, result.no_swap_peak_bytes - settings.budget_bytes)
        self.generation_s = time.perf_counter() - start
        self._regenerate = False
        feasible = [p for p in result.policies if p.feasible]
        if not feasible and any(r.held for r in self.results):
            # feedback made the model stricter than reality: keep trying what already held
            logger.info("regenerated policies are predicted not to fit; keeping the ones that held")
            return
        # A policy the simulator says does not fit is tried only when none does (smallest shortfall
        # first): the trial shows whether it beats the swap-everything executor behind it. Once such a
        # policy failed, none is tried: swapping everything (with passive swap behind it) is safer.
        self.candidates = feasible or ([] if self._infeasible_failed else list(result.policies))
        best = result.best
        logger.info(
            "generated %d policies (%d predicted to fit, %d to try) from iteration %d in %.3f s; best: %s",
            len(result.policies), len(feasible), len(self.candidates), trace.iteration, self.generation_s,
            best.summary().splitlines()[0] if best else "none",
        )
        if best is not None and not best.feasible:
            logger.warning("no policy is predicted to fit the memory budget (%s); %s", best.reason,
                           "swapping every eligible tensor (such a policy already failed)" if self._infeasible_failed
                           else "trying the closest ones")

    def _next_trial(self) -> Policy | None:
        """The next candidate not tried yet since the last generation (cycling when all were)."""
        if not self.candidates:
            return None
        tried = {id(r.policy) for r in self.results}
        fresh = [p for p in self.candidates if id(p) not in tried]
        return fresh[0] if fresh else self.candidates[len(self.results) % len(self.candidates)]

    def _record_trial(self, policy: Policy, iteration_s: float, peak_bytes: int, held: bool, stall_s: float,
                      grew: bool = False) -> None:
        """One trial's outcome, fed back into the next generation:

        - a policy that went over the budget makes the next ones aim lower by as much as it missed (not
          when the iteration ``grew``: saved more than the traced one);
        - a policy that stalled more than predicted because the trace's op times were off (the profiled
          iteration ran with the detailed recorder, whose cost is not the job's) rescales the op times
          by the compute time this iteration actually took."""
        budget_bytes = self.settings.budget_bytes
        self.results.append(TrialResult(policy, iteration_s, peak_bytes, held))
        compute_s = max(iteration_s - stall_s, 1e-9)
        ratio = compute_s / max(policy.compute_s, 1e-9)
        stalled = policy.predicted_stall_s + STALL_TOLERANCE * iteration_s < stall_s < iteration_s / 2
        if stalled and abs(ratio - 1) > TIME_TOLERANCE:  # (a link-bound trial says little about compute)
            self.time_scale *= ratio
            self._regenerate = True
            logger.info("policy %s stalled %.1f ms (predicted %.1f): op times rescaled by %.2f",
                        policy.name, stall_s * 1e3, policy.predicted_stall_s * 1e3, ratio)
        if peak_bytes > budget_bytes and peak_bytes > policy.predicted_peak_bytes and not grew:
            miss = peak_bytes - max(policy.predicted_peak_bytes, 1)
            self.reserve_bytes = min(budget_bytes, self.reserve_bytes + miss)
            self._regenerate = True
            logger.info("policy %s peaked %s above its prediction: next policies aim %s under the budget",
                        policy.name, format_bytes(miss), format_bytes(self.reserve_bytes))

    def _choose(self) -> None:
        """Keep the fastest policy that held with headroom (per policy: its best trial); the fastest that
        held when none has headroom; none when none held. The headroom is how much one policy's peak moved
        between its trials (``_peak_variation_bytes``): what timing jitter, routing and shapes move a
        peak by. (Not the spread of prediction errors across policies: a policy predicted far off, such as
        swapping everything on a slow link, would make every fast one look short of room.)"""
        held = [r for r in self.results if r.held]
        self.chosen = None
        if not self.results:
            return
        if not held:
            logger.warning(
                "none of %d policy trials held the memory budget; swapping every eligible tensor until the "
                "next policy (lower memory_budget or min_swap_bytes if this repeats)", len(self.results),
            )
            return
        self.headroom_bytes = self._peak_variation_bytes()
        roomy = [r for r in held if r.peak_bytes + self.headroom_bytes <= self.allowed_peak_bytes]
        best = min(roomy or held, key=lambda r: r.iteration_s)
        self.chosen = best.policy
        self.version += 1
        self._in_place_left = MAX_IN_PLACE_TIGHTENINGS
        self._scaled_for = 1.0
        logger.info(
            "policy %s chosen (v%d): %.1f ms/iteration, peak %s (headroom %s%s)", best.policy.name, self.version,
            best.iteration_s * 1e3, format_bytes(best.peak_bytes), format_bytes(self.headroom_bytes),
            "" if roomy else "; no trial had it",
        )

    def _peak_variation_bytes(self) -> int:
        """How much the peak of one policy moved between its trials (timing jitter, routing, shapes): the
        largest spread over the policies tried more than once, 0 when none was."""
        peaks: dict[int, list[int]] = {}
        for r in self.results:
            peaks.setdefault(id(r.policy), []).append(r.peak_bytes)
        return max((max(p) - min(p) for p in peaks.values() if len(p) > 1), default=0)

    def _tighten(self, failed: Policy | None) -> None:
        if failed is not None and not failed.feasible:
            self._infeasible_failed = True
        self.reserve_bytes += max(1, int(STRICTER_SHARE * self._needed_bytes))
        logger.info("the policy did not hold: the next policies aim %s under the budget", format_bytes(self.reserve_bytes))
