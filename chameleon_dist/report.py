"""``IterationReport``: what one training iteration did, as the runtime saw it.

The report nests the records its parts made: the executor's counts (``swaps``, a ``SwapFigures``), the
memory figures (``memory``, a ``MemoryFigures``: capacity, budgets, host pool), the times (``times``, a
``TimeFigures``), the profiler's comparison with the reference sequence (``comparison``) and the stage machine's
move (``transition``). ``to_dict()`` flattens them into the JSON keys reports always had, plus
``schema_version`` (``chameleon_dist.schema_version``); every field of ``swaps``, ``memory`` and ``times`` and the
most-read comparison values are also attributes of the report itself (``report.passive_swaps`` is
``report.swaps.passive_swaps``, ``report.capacity_bytes`` is ``report.memory.capacity_bytes``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from chameleon_dist.schema_version import SCHEMA_VERSION, SCHEMA_VERSION_KEY

if TYPE_CHECKING:  # annotations only: the report imports none of the parts it describes
    from chameleon_dist.executor.context import SwapFigures
    from chameleon_dist.profiler.signature import Comparison
    from chameleon_dist.trace.stages import Transition

# The order of ``to_dict()``'s keys: the one reports always had (keys not named here follow at the end, in the
# order of the report's fields, then of ``SwapFigures``' fields). It is the JSON contract as of issue 38
# (tests/data/iteration_reports.json), not a list to keep up: a new field of the report or of ``SwapFigures``
# needs no line here (tests/test_counters_once.py checks that each swap figure named here is a field there).
_JSON_ORDER = (
    "iteration", "enabled", "stage", "peak_device_bytes", "capacity_bytes", "memory_budget_bytes", "swap_out_bytes",
    "swap_in_bytes", "swapped_storages", "prefetched", "kept_on_device_bytes", "host_pool_bytes", "stall_s",
    "iteration_s", "policy_version", "num_ops", "sequence_changed", "sequence_change_major", "sequence_cosine",
    "sequence_length_change", "saved_bytes_change", "stage_transition", "passive_swaps", "oom_retries", "emulated",
    "pressure_waits", "policy", "matched_exact", "matched_fuzzy", "unmatched", "on_demand_fetches", "sequence_differs",
    "reused_original_bytes", "delayed_swap_outs", "late_swap_outs", "recomputed_bytes", "recompute_unavailable",
    "sequence_change_kind", "skipped_entries", "tightened_in_place", "failed", "error", "evicted_prefetches", "rank",
    "host_memory_budget_bytes", "iteration_s_lag", "verdict_rule",
)

_NESTED = ("swaps", "memory", "times", "comparison", "transition")  # flattened by ``to_dict``
_READ_THROUGH = ("memory", "times", "swaps")  # records whose fields are the report's attributes too


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
    """The iteration's device capacity and budgets, and the host pool's size and budget (bytes)."""

    capacity_bytes: int
    memory_budget_bytes: int
    host_pool_bytes: int
    host_memory_budget_bytes: int | None = None  # this rank's host budget (a share of the node's RAM); None: unbounded


@dataclasses.dataclass(frozen=True)
class TimeFigures:
    """The iteration's device time and its stall (seconds; see ``IterationReport`` for Stable's lag)."""

    stall_s: float
    iteration_s: float
    iteration_s_lag: int = 0  # iterations ``iteration_s`` lags (Stable: usually 1)


def _field_names(record: Any) -> tuple[str, ...]:
    """The field names of the dataclass (or dataclass type) ``record`` (the report reads its nested records'
    fields through by them)."""
    return tuple(field.name for field in dataclasses.fields(record))


@dataclasses.dataclass(frozen=True)
class IterationReport:
    """One iteration. Byte counts are device bytes unless named ``host``; ``emulated`` marks CPU figures.

    ``stage`` is the stage the iteration ran in ("warmup", "gen_policy", "stable"). ``num_ops`` is the
    number of aten ops in its signature. ``swaps`` holds what the executor did (``SwapFigures``: bytes
    swapped, matches, passive swaps, ...; each also readable as ``report.<name>``).

    ``comparison`` is the profiler's comparison with the reference sequence (the one the policy is built
    from; None for a failed iteration, which is not compared), read through these properties:
    ``sequence_change_kind`` classifies the difference (``profiler.signature.ChangeKind``: "identical",
    "absorbed", "rerouted" (other ops on the same data: skipped experts), "rescaled" (the same ops on other
    sizes: a sequence length or batch size change) or "changed"), and ``sequence_changed`` is true for
    "changed", a new program: the op-pair profiles of the autograd ops are less cosine-similar than
    ``profiler.cosine_threshold``, or the number of autograd ops and the bytes saved for backward both
    changed by at least ``profiler.length_change`` (in GenPolicy and Stable it sends the runtime back to
    WarmUp). ``sequence_cosine`` is that op-pair cosine. ``sequence_differs`` is true for any difference at
    all (an op, the order, an op outside autograd, a saved size), also one the policy absorbs; it is
    reported only. ``tightened_in_place`` says a Stable iteration went over the memory budget within the
    capacity and the policy was made stricter without leaving Stable. ``transition`` is what changed
    stage after this iteration, and why; ``stage_transition`` the same as one line
    ("stable -> warmup: <reason>"), or None.

    Deprecated: the JSON key ``sequence_change_major`` (``to_dict()``) is the older name of
    ``sequence_changed`` and always equals it; it is no attribute any more, and the key goes in the next
    release: read ``sequence_changed``.

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
    memory: MemoryFigures  # capacity, memory budget, host pool and host budget
    times: TimeFigures  # iteration time, stall, lag
    policy_version: int
    num_ops: int
    oom_retries: int
    emulated: bool
    swaps: SwapFigures  # what the executor did (the attempt that completed)
    comparison: Comparison | None = None  # with the reference sequence; None: a failed iteration
    transition: Transition | None = None  # what changed stage after this iteration, and why
    policy: str = ""  # the policy applied ("" = swap every eligible tensor: WarmUp or no policy)
    tightened_in_place: bool = False  # see above
    failed: bool = False  # the iteration raised (``error``): nothing after the failing op happened
    error: str = ""  # the exception's type and first line, for a failed iteration
    rank: str = ""  # the rank's coordinates in a distributed job (``RankCoordinates.label``); "" alone
    verdict_rule: str | None = None  # the policy controller's rule that judged it (``policy.judgement``); None: failed

    # ---- the nested records, read through (``memory``, ``times``, ``swaps``): their fields, none named here ----
    def __getattr__(self, name: str) -> Any:
        """``report.<name>`` is ``report.swaps.<name>`` for each field of ``SwapFigures`` (and the same for
        ``memory`` and ``times``; read-only: the report is frozen), so that a count declared there is a report
        attribute without another line here."""
        if not name.startswith("_"):
            for record in self._read_through():
                if name in _field_names(record):
                    return getattr(record, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _read_through(self) -> list[Any]:
        # (``self.__dict__``, not ``self.swaps``: absent while a copy or unpickling builds one)
        return [record for record in map(self.__dict__.get, _READ_THROUGH) if record is not None]

    def __dir__(self) -> list[str]:
        """The report's names with the nested records' fields among them (completion in a shell, ``dir(report)``)."""
        return sorted(set(super().__dir__()).union(*(_field_names(record) for record in self._read_through())))

    # ---- the sequence comparison, read through (``comparison``; a failed iteration: no change) ----
    @property
    def sequence_changed(self) -> bool:
        """A new program: a new policy is needed (see above)."""
        return self.comparison is not None and self.comparison.changed

    @property
    def sequence_differs(self) -> bool:
        """Any difference from the reference sequence, absorbed or not (see above)."""
        return self.comparison is not None and self.comparison.differs

    @property
    def sequence_change_kind(self) -> str:
        return "identical" if self.comparison is None else str(self.comparison.kind)

    @property
    def sequence_cosine(self) -> float:
        return 1.0 if self.comparison is None else self.comparison.cosine

    @property
    def sequence_length_change(self) -> float:
        """Relative, among ops inside autograd."""
        return 0.0 if self.comparison is None else self.comparison.length_change

    @property
    def saved_bytes_change(self) -> float:
        """Relative change of the bytes saved for backward."""
        return 0.0 if self.comparison is None else self.comparison.saved_bytes_change

    @property
    def stage_transition(self) -> str | None:
        """``transition`` as one line, "before -> after: reason"; None when the stage stayed."""
        t = self.transition
        return None if t is None else f"{t.before} -> {t.after}: {t.reason}"

    def to_dict(self) -> dict[str, Any]:
        """The report as the flat JSON object it always was (the nested records' fields at the top level)."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NESTED}
        for record in (self.memory, self.times, self.swaps):
            flat.update(dataclasses.asdict(record))
        flat.update(
            sequence_changed=self.sequence_changed,
            sequence_change_major=self.sequence_changed,  # deprecated (see above): goes in the next release
            sequence_cosine=self.sequence_cosine,
            sequence_length_change=self.sequence_length_change,
            saved_bytes_change=self.saved_bytes_change,
            sequence_differs=self.sequence_differs,
            sequence_change_kind=self.sequence_change_kind,
            stage_transition=self.stage_transition,
        )
        return {key: flat.pop(key) for key in _JSON_ORDER if key in flat} | flat | {SCHEMA_VERSION_KEY: SCHEMA_VERSION}

    @classmethod
    def of(cls, **fields: Any) -> "IterationReport":
        """A report from its flat fields (as ``to_dict()`` names them): ``capacity_bytes`` and the other fields
        of ``MemoryFigures`` and ``TimeFigures`` are gathered into ``memory`` and ``times``."""
        for name, record in (("memory", MemoryFigures), ("times", TimeFigures)):
            fields[name] = record(**{f: fields.pop(f) for f in _field_names(record) if f in fields})
        return cls(**fields)

    @classmethod
    def completed(cls, iteration: int, iteration_s: float, profile: Any, **measured: Any) -> "IterationReport":
        """A completed iteration: ``profile`` is the profiler's ``IterationProfile`` (stage, signature,
        comparison with the reference, transition); ``measured`` the fields a failed one has too."""
        return cls.of(
            iteration=iteration,
            stage=str(profile.stage),  # the plain string ("stable"), as reports always had
            iteration_s=iteration_s,
            num_ops=profile.signature.num_ops,
            comparison=profile.comparison,
            transition=profile.transition,
            **measured,
        )

    @classmethod
    def failed_with(cls, exc: BaseException, iteration: int, stage: str, iteration_s: float, num_ops: int,
                    **measured: Any) -> "IterationReport":
        """An iteration that raised ``exc``: what it did until then, and the error (no sequence comparison,
        no transition: the iteration is not counted)."""
        return cls.of(
            iteration=iteration,
            stage=str(stage),
            iteration_s=iteration_s,
            num_ops=num_ops,
            failed=True,
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            **measured,
        )
