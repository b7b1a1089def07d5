"""The stages of the paper's Algorithm 1 and the causes of moving between them.

They live in ``trace/`` because the profiler (which runs the stage machine), the policy controller (which
reacts to transitions) and the runtime's reports all speak of them, and ``policy/`` must not import
``profiler/``. Both are string-valued: ``Stage.STABLE == "stable"``, so reports and JSON stay as they were.
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
