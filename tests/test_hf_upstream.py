"""The Trainer callback's records per reviewed transformers release group (``integrations/hf/upstream.py``): the
groups of each change are contiguous and disjoint and cover the reviewed range, the installed transformers gets
its group's record (and its code matches that group's fingerprint: fails when upstream changes), and a release
outside every group is refused naming the whole reviewed range."""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from chameleon_dist.integrations.hf import upstream
from chameleon_dist.patching import PatchRefused, problems_with_change, verify_instance_changes

RELEASES = ["5.17.0", "5.18.0", "5.19.0", "5.20.0", "5.20.1", "5.20.2", "5.21.0", "5.21.1", "5.22.0", "5.22.1",
            "5.22.2", "5.23.0", "5.24.0", "5.25.0"]
"""The transformers releases whose code was read for the groups (every 5.x on the registry from 5.17.0)."""


@pytest.mark.parametrize("change", upstream.REVIEWED_CHANGES, ids=lambda c: c.name)
def test_every_reviewed_release_is_in_exactly_one_group(change):
    for release in RELEASES:
        holding = [v for v, _ in change.groups if SpecifierSet(v).contains(Version(release))]
        assert len(holding) == 1, (change.name, release, holding)
    assert [Version(r) in SpecifierSet(upstream.REVIEWED_RANGE) for r in RELEASES] == [True] * len(RELEASES)
    assert len({f for _, f in change.groups}) == len(change.groups)  # a group per distinct code, no duplicates


@pytest.mark.parametrize("change", upstream.REVIEWED_CHANGES, ids=lambda c: c.name)
def test_groups_are_contiguous_from_the_oldest_to_the_open_newest(change):
    assert change.groups[0][0].startswith(">=5.17,") and change.groups[-1][0].endswith(",<6")
    for (earlier, _), (later, _) in zip(change.groups, change.groups[1:]):
        bound = earlier.partition(",<")[2]
        assert later.startswith(f">={bound},"), (earlier, later)


def test_each_release_gets_its_groups_record_and_others_the_whole_range():
    found, epoch = upstream.records_for("5.17.0")
    assert (found.versions, found.fingerprint) == upstream.FOUND_FROM_CALLBACK.groups[0]
    assert (epoch.versions, epoch.fingerprint) == upstream.EPOCH_GUARDED.groups[0]
    assert [r.versions for r in upstream.records_for("5.24.0")] == [">=5.24,<5.25", ">=5.23,<5.25"]
    for outside in ("5.16.1", "4.57.6", "6.0.0", None, "not-a-version"):
        assert [r.versions for r in upstream.records_for(outside)] == [upstream.REVIEWED_RANGE] * 2


def test_the_installed_transformers_matches_its_groups_fingerprint():
    """Fails when upstream changes: read the relied-on code of the installed release, then add its group."""
    pytest.importorskip("transformers")
    installed = importlib.metadata.version("transformers")
    records = upstream.records_for(installed)
    assert records == upstream.INSTANCE_CHANGES
    assert [problems_with_change(r) for r in records] == [(), ()], installed


def test_a_release_outside_every_group_is_refused_naming_the_reviewed_range(monkeypatch):
    pytest.importorskip("transformers")
    installed = importlib.metadata.version("transformers")
    record = upstream.FOUND_FROM_CALLBACK.record("<5.17", upstream.FOUND_FROM_CALLBACK.groups[0][1])
    with pytest.raises(PatchRefused, match=rf"installed transformers {installed} is outside the supported range"):
        verify_instance_changes([record])


def test_another_groups_fingerprint_is_refused():
    """A release whose code is another group's: the fingerprint check refuses it (a group is not interchangeable)."""
    pytest.importorskip("transformers")
    installed = importlib.metadata.version("transformers")
    own = upstream.records_for(installed)[0]
    other = next(f for v, f in upstream.FOUND_FROM_CALLBACK.groups if f != own.fingerprint)
    with pytest.raises(PatchRefused, match=f"recorded fingerprint {other}"):
        verify_instance_changes([upstream.FOUND_FROM_CALLBACK.record(upstream.REVIEWED_RANGE, other)])
