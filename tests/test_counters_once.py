"""The executor's per-iteration counts are declared once, as the fields of ``SwapFigures``
(trace/swap_figures.py), and everything else follows from them (issue 38 item 3): the executor's mutable
``SwapCounters``, the report's read-through attributes and JSON keys, and the ``IterationOutcome`` the policy
controller reads. These tests add a field in that one place and follow it, and catch a hand-written copy of
the list coming back (a field declared again, a read-through property, a stale name in the report's key
order).
"""

import dataclasses
import json
from pathlib import Path

import pytest

from chameleon_dist.executor import SwapCounters, SwapFigures
from chameleon_dist.executor.matching import MatchCounts
from chameleon_dist.policy.outcome import IterationOutcome
from chameleon_dist.report import _JSON_ORDER, IterationReport
from chameleon_dist.trace.stages import Stage
from chameleon_dist.trace.swap_figures import counting_twin

SAVED = Path(__file__).parent / "data" / "iteration_reports.json"
FIGURES = tuple(f.name for f in dataclasses.fields(SwapFigures))


@dataclasses.dataclass(frozen=True)
class WiderFigures(SwapFigures):
    """``SwapFigures`` with a count added the way a new one is: one field."""

    new_count: int = 0


def _distinct(figures: type = SwapFigures) -> SwapFigures:
    """``figures`` with every field a different non-zero value, so that a value read from the wrong field shows."""
    return figures(**{f.name: 100 + i for i, f in enumerate(dataclasses.fields(figures))})


def _report(swaps: SwapFigures) -> IterationReport:
    return IterationReport.of(iteration=3, enabled=True, stage="stable", peak_device_bytes=7, capacity_bytes=8,
                           memory_budget_bytes=6, host_pool_bytes=0, stall_s=0.0, iteration_s=0.1, policy_version=1,
                           num_ops=5, oom_retries=0, emulated=True, swaps=swaps)


def _outcome(swaps: SwapFigures) -> IterationOutcome:
    return IterationOutcome(iteration=3, stage=Stage.STABLE, policy=None, peak_device_bytes=7, iteration_s=0.1,
                            stall_s=0.0, attempt_stall_s=0.0, oom_retries=0, profiled=False, swaps=swaps)


def _redeclared(cls: type, names: tuple[str, ...] = FIGURES) -> set[str]:
    """The names in ``names`` that ``cls`` declares in its own body (a field annotation or a class attribute
    such as a property): a hand-written copy of the list of figures."""
    own = set(vars(cls).get("__annotations__", {})) | {name for name in vars(cls) if not name.startswith("__")}
    return own & set(names)


# ---- a figure declared once reaches every reader ----------------------------------------------------------
@pytest.mark.parametrize("figures", [SwapFigures, WiderFigures], ids=["today", "one_field_added"])
def test_every_figure_is_a_report_attribute_a_json_key_and_on_the_outcome(figures):
    swaps = _distinct(figures)
    report, outcome = _report(swaps), _outcome(swaps)
    flat = report.to_dict()
    for field in dataclasses.fields(figures):
        value = getattr(swaps, field.name)
        assert getattr(report, field.name) == value, field.name
        assert flat[field.name] == value, field.name
        assert getattr(outcome.swaps, field.name) == value, field.name
        assert field.name in dir(report)
    assert outcome.passive_swaps == swaps.passive_swaps
    if figures is WiderFigures:  # named nowhere in the report: it follows the keys the order names
        assert list(flat)[-2:] == ["new_count", "schema_version"] and report.new_count == 100 + len(FIGURES)


def test_a_name_that_is_no_figure_is_no_report_attribute():
    report = _report(SwapFigures())
    with pytest.raises(AttributeError):
        report.new_count  # noqa: B018 (only WiderFigures has it)
    with pytest.raises(AttributeError):
        report.sequence_change_major  # noqa: B018 (a JSON key only, deprecated)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.passive_swaps = 1


def test_the_counters_count_every_figure_and_freeze_into_it():
    """Every int counter and every match count set to its own value: each figure comes from a live counter
    (none left at its default, none read twice)."""
    counters = SwapCounters(matches=MatchCounts(exact=1, fuzzy=2, unmatched=3, skipped=4))
    ints = [f.name for f in dataclasses.fields(SwapCounters) if isinstance(getattr(counters, f.name), int)]
    for i, name in enumerate(ints):
        setattr(counters, name, 10 + i)
    values = dataclasses.asdict(counters.figures())
    assert list(values) == list(FIGURES)
    assert 0 not in values.values() and len(set(values.values())) == len(values), values


def test_a_field_added_to_the_figures_is_a_counter_too():
    twin = counting_twin(WiderFigures, {"matched_exact"}, "Twin", __name__)
    names = [f.name for f in dataclasses.fields(twin)]
    assert "new_count" in names and "matched_exact" not in names
    counts = twin()
    counts.new_count += 2  # mutable, from the field's default
    assert counts.new_count == 2 and twin.__module__ == __name__


# ---- no hand-written copy of the list comes back ---------------------------------------------------------
def test_the_redeclaration_check_fires_on_a_copied_field_and_a_read_through_property():
    @dataclasses.dataclass
    class CopiedField:
        passive_swaps: int = 0

    class ReadThrough:
        swap_in_bytes = property(lambda self: 0)

    assert _redeclared(CopiedField) == {"passive_swaps"}
    assert _redeclared(ReadThrough) == {"swap_in_bytes"}


@pytest.mark.parametrize("cls", [IterationReport, SwapCounters])
def test_no_figure_is_declared_again(cls):
    assert not _redeclared(cls), f"{cls.__name__} repeats {sorted(_redeclared(cls))}: read them from SwapFigures"


def test_the_outcome_copies_no_figure_into_a_field_of_its_own():
    fields = {f.name for f in dataclasses.fields(IterationOutcome)}
    assert not fields & set(FIGURES), "IterationOutcome holds SwapFigures (swaps): read the counts there"
    assert set(_redeclared(IterationOutcome)) == {"passive_swaps"}  # the one read-through property, kept for callers


def test_no_report_field_shares_a_name_with_a_figure():
    """``to_dict`` flattens ``swaps`` into the report's own keys: a shared name would lose one of the two."""
    assert not {f.name for f in dataclasses.fields(IterationReport)} & set(FIGURES)


def test_the_key_order_names_only_keys_a_report_has_in_the_figures_order():
    """``_JSON_ORDER`` is the JSON contract as it stands, not a list to extend: each name in it is a key a
    report writes (a removed or misspelt figure fails), and the figures it names keep their declared order."""
    keys = set(_report(SwapFigures()).to_dict())
    assert not set(_JSON_ORDER) - keys, sorted(set(_JSON_ORDER) - keys)
    named = [key for key in _JSON_ORDER if key in FIGURES]
    assert named == [name for name in FIGURES if name in named]


def test_the_saved_reports_keep_the_order_the_code_now_derives():
    saved = json.loads(SAVED.read_text())
    swaps = SwapFigures(**{name: saved[0][name] for name in FIGURES})
    assert [key for key in saved[0] if key in FIGURES] == list(FIGURES)
    assert [key for key in _report(swaps).to_dict() if key in saved[0]] == list(saved[0])
