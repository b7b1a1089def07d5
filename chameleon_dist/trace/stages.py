"""The stages of the paper's Algorithm 1, the causes of moving between them, the policy controller's
``Verdict`` on a completed iteration and the causes of an out-of-memory retry.

They live in ``trace/`` because the profiler (which runs the stage machine and takes the verdict), the
policy controller (which gives the verdict and reacts to transitions) and the runtime's reports all speak
of them, and ``policy/`` must not import ``profiler/``. The enums are string-valued:
``Stage.STABLE == "stable"``, so reports and JSON stay as they were.
"""

from __future__ import annotations

import dataclasses
import enum


class Stage(enum.StrEnum):
    WARMUP = "warmup"  # detailed profiling; passive swap absorbs out-of-memory
    GEN_POLICY = "gen_policy"  # generated policies are tried, one per iteration
    STABLE = "stable"  # the chosen policy runs; only the cheap signature is taken


class TransitionCause(enum.StrEnum):
    """Why the stage machine moved (a ``Transition`` also carries a readable reason)."""

    PROFILED = "profiled"  # the WarmUp iterations are done
    TRIALS_DONE = "trials_done"  # every policy trial of GenPolicy ran
    SEQUENCE_CHANGED = "sequence_changed"  # a new program (profile cosine or ops and saved bytes): a new policy
    PASSIVE_SWAP = "passive_swap"  # the device ran out of memory under the applied policy
    OVER_BUDGET = "over_budget"  # a Stable iteration peaked above the memory budget


@dataclasses.dataclass(frozen=True)
class Transition:
    """One move of the stage machine: from ``before`` to ``after``, with its typed ``cause`` (for code to
    branch on) and a readable ``reason`` (for logs and reports)."""

    before: Stage
    after: Stage
    cause: TransitionCause
    reason: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The policy controller's word on one completed iteration (``PolicyController.record``): whether the
    applied policy stopped holding, so that the stage machine goes back to WarmUp (``restart``, a typed
    cause, with a readable ``reason``; None: it held, or what went wrong was absorbed), how many passive
    swaps of the completed attempt were absorbed (a trial's, a new shape scaled for, the remainder a
    policy predicted short was kept to leave to passive swap: they restart nothing), and whether the
    chosen policy was tightened in place. The stage machine only acts on ``restart`` outside WarmUp
    (WarmUp runs with passive swap as its safety net)."""

    restart: TransitionCause | None = None  # PASSIVE_SWAP or OVER_BUDGET
    reason: str = ""
    absorbed_passive_swaps: int = 0
    tightened_in_place: bool = False
    more_trials: bool = False  # GenPolicy: a close pair of trials is tried again before Stable (``policy.ranking``)
    rule: str = ""  # the judgement rule that decided (``policy.judgement.RULES``); "": none (not judged)


class RetryCause(enum.StrEnum):
    """Why the next attempt of an iteration that ran out of memory runs differently, and so what it
    changes (``policy.outcome.RetryAction`` carries the new settings)."""

    POLICY_FAILED = "policy_failed"  # the applied policy did not hold: swap every eligible tensor instead
    HOST_BUDGET_FULL = "host_budget_full"  # the host budget refused swaps: swapping more cannot help, wait
    EVERYTHING_SWAPPED = "everything_swapped"  # every eligible tensor already swapped: a shortage may pass
    SMALL_TENSORS_KEPT = "small_tensors_kept"  # swap smaller tensors too (``min_swap_bytes`` goes down)
