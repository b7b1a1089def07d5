"""The stage machine (the paper's Algorithm 1): WarmUp -> GenPolicy -> Stable, and back on a change.

- WarmUp (``warmup_iterations``): detailed profiling; out-of-memory is absorbed by passive swap.
- GenPolicy (``policy_trials``): a policy is generated from the latest trace and tried per iteration; it lasts
  longer while the controller's verdict asks for more trials (``Verdict.more_trials``: a close pair tried again).
- Stable: only the cheap signature. A sequence change (a new program), or the policy controller's verdict
  that the policy stopped holding (``trace.stages.Verdict``: a passive swap, a peak above the memory budget,
  that the controller could not absorb) returns to WarmUp. The controller decides what it absorbs
  (``policy/selection.py``): peaks over the budget within the capacity, by tightening the policy in place;
  a larger shape, by scaling the policy; a trial's passive swaps; and the passive swaps a policy predicted
  short was chosen with, while they stay near what its trials measured.
A verdict during WarmUp does not restart it: WarmUp runs with passive swap as its safety net.
A major change during GenPolicy restarts WarmUp (the trace no longer describes the job). During WarmUp
it does not: every WarmUp iteration renews the trace and the reference anyway, and the first iteration
of a job (lazy initialisation: optimizer state, framework buffers) routinely differs from the second.
"""

from __future__ import annotations

import logging

from chameleon_dist.trace.stages import Stage, Transition, TransitionCause, Verdict

logger = logging.getLogger(__name__)


class StageMachine:
    def __init__(self, warmup_iterations: int, policy_trials: int) -> None:
        if warmup_iterations < 0 or policy_trials < 1:
            raise ValueError("profiler.warmup_iterations must be >= 0 and profiler.policy_trials >= 1")
        self.warmup_iterations = warmup_iterations
        self.policy_trials = policy_trials
        self.stage = Stage.WARMUP if warmup_iterations > 0 else Stage.GEN_POLICY
        self._done_in_stage = 0

    def advance(self, major_change: bool, verdict: Verdict = Verdict(), change_reason: str = "") -> Transition | None:
        """Account one finished iteration; returns the transition it caused, if any. ``verdict`` is the policy
        controller's (``PolicyController.record``): outside WarmUp, its ``restart`` sends the runtime back to
        WarmUp with that cause and reason (before a sequence change is considered)."""
        before = self.stage
        if verdict.restart is not None and self.stage != Stage.WARMUP:
            return self._go(Stage.WARMUP, verdict.restart, verdict.reason, before)
        if major_change and self.stage != Stage.WARMUP:
            return self._go(Stage.WARMUP, TransitionCause.SEQUENCE_CHANGED, f"operator sequence changed: {change_reason}", before)
        self._done_in_stage += 1
        if self.stage == Stage.WARMUP and self._done_in_stage >= self.warmup_iterations:
            return self._go(Stage.GEN_POLICY, TransitionCause.PROFILED,
                            f"{self._done_in_stage} warm-up iteration(s) profiled", before)
        if self.stage == Stage.GEN_POLICY and self._done_in_stage >= self.policy_trials and not verdict.more_trials:
            return self._go(Stage.STABLE, TransitionCause.TRIALS_DONE, f"{self._done_in_stage} policy trial(s) done", before)
        return None

    def _go(self, stage: Stage, cause: TransitionCause, reason: str, before: Stage) -> Transition:
        if stage == Stage.WARMUP and self.warmup_iterations == 0:
            stage = Stage.GEN_POLICY
        self.stage = stage
        self._done_in_stage = 0
        transition = Transition(before, stage, cause, reason)
        logger.info("stage %s -> %s: %s", before, stage, reason)
        return transition
