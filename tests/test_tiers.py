"""The test tiers (NOTE [The test tiers] in tests/conftest.py): which markers put a test in which tier, and the
collection check that the quick tier runs a test of every module."""

import pytest

from tests.tiers import ci_tier, in_quick_tier, quick_tier_gaps, tier_label

pytest_plugins = ["pytester"]
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")  # (hypothesis's summary takes seconds a run)


def test_slow_extended_and_multirank_tests_leave_the_quick_tier_unless_marked_quick():
    assert in_quick_tier(set()) and in_quick_tier({"parametrize", "gpu"})
    assert not any(in_quick_tier({name}) for name in ("slow", "extended", "multirank"))
    assert in_quick_tier({"multirank", "quick"}) and in_quick_tier({"slow", "quick"})


def test_ci_runs_extended_and_multirank_tests_in_the_extended_tier_and_slow_ones_in_the_default_tier():
    assert ci_tier({"slow"}) == ci_tier(set()) == "default"
    assert ci_tier({"multirank"}) == ci_tier({"extended"}) == ci_tier({"multirank", "quick"}) == "extended"
    assert tier_label(set()) == "default + quick" and tier_label({"slow"}) == "default"
    assert tier_label({"multirank", "quick"}) == "extended + quick"


def test_a_module_whose_tests_are_all_slow_or_gpu_is_a_gap_of_the_quick_tier():
    tests = [("a.py", {"slow"}), ("a.py", {"gpu"}), ("b.py", set()), ("b.py", {"slow"}),
             ("c.py", {"multirank"}), ("d.py", {"multirank", "quick"})]
    assert quick_tier_gaps(tests) == ["a.py", "c.py"]
    assert quick_tier_gaps([("b.py", set())]) == []


def test_quick_collection_fails_naming_a_module_without_a_quick_test(pytester):
    """The repository's conftest hooks on a suite of two modules, in this process: one whose only test is slow
    fails ``--quick`` collection (exit status 4) naming it; the default tier runs both tests, and with a quick
    test the quick tier runs only that one."""
    pytester.makeini("[pytest]\nmarkers =\n    slow: x\n    quick: x\n    multirank: x\n    extended: x\n")
    pytester.makeconftest("from tests.conftest import pytest_addoption, pytest_collection_modifyitems\n")
    pytester.makepyfile(test_fast="def test_fast():\n    pass\n",
                        test_only_slow="import pytest\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n")
    done = pytester.runpytest(*QUIET, "--quick", "test_fast.py", "test_only_slow.py")
    assert done.ret == pytest.ExitCode.USAGE_ERROR
    assert "the quick tier runs no test of test_only_slow.py" in "\n".join(done.errlines)
    pytester.runpytest(*QUIET, "test_fast.py", "test_only_slow.py").assert_outcomes(passed=2)
    pytester.makepyfile(test_only_slow="import pytest\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n\n"
                                       "@pytest.mark.quick\n@pytest.mark.slow\ndef test_stands_for_it():\n    pass\n")
    done = pytester.runpytest(*QUIET, "--quick", "test_fast.py", "test_only_slow.py")
    done.assert_outcomes(passed=2, deselected=1)


def test_the_slowest_table_sums_a_tests_phases_and_names_its_tier():
    from tests.slowest import durations_s, table, tier_totals_s

    log = ("=== slowest durations ===\n12.50s setup    tests/test_a.py::test_x\n3.00s call     tests/test_a.py::test_x\n"
           "9.00s call     tests/test_b.py::test_y[1]\n0.10s teardown tests/test_b.py::test_z\nnoise 1.0s call\n")
    seconds = durations_s(log)
    assert seconds == {"tests/test_a.py::test_x": 15.5, "tests/test_b.py::test_y[1]": 9.0, "tests/test_b.py::test_z": 0.1}
    rows = table(seconds, {"tests/test_a.py::test_x": frozenset({"multirank"}), "tests/test_b.py::test_y[1]": frozenset()}, 2)
    assert rows.splitlines()[2:] == ["| 15.5 | extended | `tests/test_a.py::test_x` |",
                                     "| 9.0 | default + quick | `tests/test_b.py::test_y[1]` |"]
    markers = {"tests/test_a.py::test_x": frozenset({"multirank", "quick"}), "tests/test_b.py::test_y[1]": frozenset({"slow"}),
               "tests/test_b.py::test_z": frozenset()}
    assert tier_totals_s(seconds, markers) == {"quick": 15.6, "default": 9.1, "extended": 15.5}
