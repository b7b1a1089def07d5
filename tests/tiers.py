"""Which tier a test belongs to, read from its markers (NOTE [The test tiers] in tests/conftest.py).

A tier is a set of tests picked by markers alone, so that the rule can be checked on the collected items
before any test runs: ``quick_tier_gaps`` names the test modules the quick tier would leave with no test that
runs on a machine without a GPU."""

from __future__ import annotations

from collections.abc import Iterable

LEFT_OUT_OF_QUICK = frozenset({"slow", "extended", "multirank"})
"""Markers that keep a test out of the quick tier (unless it is also marked ``quick``)."""
LEFT_OUT_OF_DEFAULT = frozenset({"extended", "multirank"})
"""Markers that keep a test out of the default tier (``--extended`` brings it in)."""


def marker_names(item) -> frozenset[str]:
    """The names of the markers on a collected test (its own, its class's and its module's)."""
    return frozenset(mark.name for mark in item.iter_markers())


def ci_tier(markers: Iterable[str]) -> str:
    """The tier CI runs a test with these markers in: ``extended`` (``--extended``) or ``default``."""
    return "extended" if frozenset(markers) & LEFT_OUT_OF_DEFAULT else "default"


def in_quick_tier(markers: Iterable[str]) -> bool:
    """Whether ``--quick`` runs a test with these markers: not slow, extended or multirank, or marked quick (the
    one test that stands for a module whose every other test is in the extended tier)."""
    names = frozenset(markers)
    return "quick" in names or not names & LEFT_OUT_OF_QUICK


def tier_label(markers: Iterable[str]) -> str:
    """``default``, ``extended``, with `` + quick`` when the quick tier runs it too (README's test table)."""
    return ci_tier(markers) + (" + quick" if in_quick_tier(markers) else "")


def quick_tier_gaps(tests: Iterable[tuple[str, Iterable[str]]]) -> list[str]:
    """The modules (first element of each ``(module, markers)`` pair) with no test in the quick tier that runs
    without a GPU (``gpu``-marked tests are skipped there), sorted."""
    modules, covered = set(), set()
    for module, markers in tests:
        names = frozenset(markers)
        modules.add(module)
        if in_quick_tier(names) and "gpu" not in names:
            covered.add(module)
    return sorted(modules - covered)
