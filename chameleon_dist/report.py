"""``IterationReport``: what one training iteration did, as the runtime saw it."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class IterationReport:
    """One iteration. Byte counts are device bytes unless named ``host``; ``emulated`` marks CPU figures.

    ``stage`` is the stage the iteration ran in ("warmup", "gen_policy", "stable"). ``num_ops`` is the
    number of aten ops in its signature. Compared with the reference sequence (the one the policy is
    built from), ``sequence_change_kind`` classifies the difference (``profiler.signature.ChangeKind``:
    "identical", "absorbed", "rerouted" (other ops on the same data: skipped experts), "rescaled" (the
    same ops on other sizes: a sequence length or batch size change) or "changed"), and
    ``sequence_changed`` is true for "changed", a new program: the op-pair profiles of the autograd ops
    are less cosine-similar than ``profiler.cosine_threshold``, or the number of autograd ops and the
    bytes saved for backward both changed by at least ``profiler.length_change`` (in GenPolicy and
    Stable it sends the runtime back to WarmUp). ``sequence_cosine`` is that op-pair cosine.
    ``sequence_differs`` is true for any difference at all (an op, the order, an op outside autograd, a
    saved size), also one the policy absorbs; it is reported only. ``sequence_change_major`` is the older
    name of ``sequence_changed`` and always equals it. ``tightened_in_place`` says a Stable iteration went
    over the memory budget within the capacity and the policy was made stricter without leaving Stable.
    ``stage_transition`` says what changed stage after this iteration, and why.

    After an out-of-memory retry inside ``run_iteration`` (``oom_retries`` > 0), the counters (swaps,
    matches, ``passive_swaps``, ``pressure_waits``, ``kept_on_device_bytes``), ``num_ops`` and the
    sequence comparison describe only the attempt that completed, as if it had been the only one;
    ``peak_device_bytes``, ``iteration_s`` and ``stall_s`` span the whole iteration, failed attempts
    included.

    A Stable iteration never waits for the device to read its own times (NOTE [Stable iterations never
    wait for their own figures] in ``device/iteration_times.py``): ``iteration_s`` is then the device time of the
    newest iteration whose end the device had reached when this one ended, ``iteration_s_lag`` iterations
    back (usually 1 on a GPU, 0 once the device has caught up), and ``stall_s`` counts the waits on copies
    whose timing events had completed by then, so a stall at the end of one iteration is counted in the
    next one's figure. WarmUp and GenPolicy iterations wait: their figures are their own (lag 0)."""

    iteration: int
    enabled: bool  # chameleon.enabled: false means measured only, nothing swapped
    stage: str
    peak_device_bytes: int
    capacity_bytes: int
    memory_budget_bytes: int
    swap_out_bytes: int
    swap_in_bytes: int
    swapped_storages: int
    prefetched: int
    kept_on_device_bytes: int
    host_pool_bytes: int
    stall_s: float
    iteration_s: float
    policy_version: int
    num_ops: int
    sequence_changed: bool  # a new program: a new policy is needed (see above)
    sequence_change_major: bool  # == sequence_changed (older name)
    sequence_cosine: float
    sequence_length_change: float  # relative, among ops inside autograd
    saved_bytes_change: float  # relative change of the bytes saved for backward
    stage_transition: str | None
    passive_swaps: int  # kept tensors swapped out synchronously because the device ran out of memory
    oom_retries: int
    emulated: bool
    pressure_waits: int = 0  # out-of-memory averted by waiting for in-flight swap-outs (their time is stall)
    policy: str = ""  # the policy applied ("" = swap every eligible tensor: WarmUp or no policy)
    matched_exact: int = 0
    matched_fuzzy: int = 0
    unmatched: int = 0  # saved storages a policy could not place confidently (kept on the device)
    on_demand_fetches: int = 0  # planned swap-ins that had not started when backward needed the tensor
    sequence_differs: bool = False  # any difference from the reference sequence, absorbed or not (see above)
    reused_original_bytes: int = 0  # restores that reused a still-alive device original (no copy, no new bytes)
    delayed_swap_outs: int = 0  # swap-outs the policy placed after the save, issued at their op
    late_swap_outs: int = 0  # ... whose op never came (the sequence moved): issued when backward began
    recomputed_bytes: int = 0  # saved storages rebuilt from their producer's inputs instead of swapped
    recompute_unavailable: int = 0  # planned recomputes kept on the device (producer not found exactly)
    sequence_change_kind: str = "identical"  # see above
    skipped_entries: int = 0  # policy entries whose tensor this iteration did not save (an idle expert)
    tightened_in_place: bool = False  # see above
    failed: bool = False  # the iteration raised (``error``): nothing after the failing op happened
    error: str = ""  # the exception's type and first line, for a failed iteration
    evicted_prefetches: int = 0  # prefetched swap-ins given back under memory pressure (fetched again on use)
    rank: str = ""  # the rank's coordinates in a distributed job (``RankCoordinates.label``); "" alone
    host_memory_budget_bytes: int | None = None  # this rank's host budget (a share of the node's RAM); None: unbounded
    iteration_s_lag: int = 0  # iterations ``iteration_s`` lags (Stable: usually 1; see below)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def completed(cls, iteration: int, iteration_s: float, profile: Any, **measured: Any) -> "IterationReport":
        """A completed iteration: ``profile`` is the profiler's ``IterationProfile`` (stage, signature,
        comparison with the reference, transition); ``measured`` the fields a failed one has too."""
        comparison, transition = profile.comparison, profile.transition
        return cls(
            iteration=iteration,
            stage=str(profile.stage),  # the plain string ("stable"), as reports always had
            iteration_s=iteration_s,
            num_ops=profile.signature.num_ops,
            sequence_changed=comparison.changed,
            sequence_change_major=comparison.changed,  # older name, same value
            sequence_differs=comparison.differs,  # any difference, absorbed or not
            sequence_change_kind=str(comparison.kind),
            sequence_cosine=comparison.cosine,
            sequence_length_change=comparison.length_change,
            saved_bytes_change=comparison.saved_bytes_change,
            stage_transition=None if transition is None else f"{transition.before} -> {transition.after}: {transition.reason}",
            **measured,
        )

    @classmethod
    def failed_with(cls, exc: BaseException, iteration: int, stage: str, iteration_s: float, num_ops: int,
                    **measured: Any) -> "IterationReport":
        """An iteration that raised ``exc``: what it did until then, and the error (no sequence comparison,
        no transition: the iteration is not counted)."""
        return cls(
            iteration=iteration,
            stage=str(stage),
            iteration_s=iteration_s,
            num_ops=num_ops,
            sequence_changed=False,
            sequence_change_major=False,
            sequence_cosine=1.0,
            sequence_length_change=0.0,
            saved_bytes_change=0.0,
            stage_transition=None,
            failed=True,
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            **measured,
        )
