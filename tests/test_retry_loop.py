"""``Chameleon.retry_out_of_memory``: the one retry loop that ``run_iteration`` and DeepSpeed's ``run_window`` and
``train_batch`` replay use (issue 25). These tests drive it directly, with attempts that raise on purpose."""

import contextlib

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice


def _runtime(retries: int = 2, enabled: bool = True) -> Chameleon:
    return Chameleon({"enabled": enabled, "min_swap_bytes": 4096, "executor": {"max_oom_retries": retries}},
                     device=EmulatedDevice(10**9))


def _failing(times: int, events: list[str]):
    count = {"n": 0}

    def attempt():
        count["n"] += 1
        events.append(f"attempt {count['n']}")
        if count["n"] <= times:
            raise torch.OutOfMemoryError(f"injected {count['n']}")
        return "done"

    return attempt


def test_it_runs_only_inside_an_open_iteration():
    with pytest.raises(RuntimeError, match="iteration"):
        _runtime().retry_out_of_memory(lambda: 1, lambda: None)


def test_each_retry_resets_then_tightens_and_runs_again():
    runtime, events = _runtime(retries=2), []
    with runtime.iteration():
        result = runtime.retry_out_of_memory(_failing(2, events), lambda: events.append("reset"))
    assert result == "done"
    assert events == ["attempt 1", "reset", "attempt 2", "reset", "attempt 3"]
    assert runtime.last_report.oom_retries == 2 and not runtime.last_report.failed
    assert runtime.executor.min_swap_bytes < 4096  # the controller's retry action, applied by the executor


def test_the_last_failure_names_what_to_change_and_reaches_on_last():
    runtime, events, seen = _runtime(retries=1), [], []
    with pytest.raises(torch.OutOfMemoryError) as raised, runtime.iteration():
        runtime.retry_out_of_memory(_failing(5, events), lambda: events.append("reset"), on_last=seen.append)
    assert events == ["attempt 1", "reset", "attempt 2"]
    assert seen == [raised.value] and "injected 2" in str(raised.value.__cause__)
    assert "min_swap_bytes" in str(raised.value) or "memory_budget" in str(raised.value)
    assert runtime.last_report.failed


def test_disabled_runtime_raises_the_first_error_as_it_is():
    runtime, events = _runtime(enabled=False), []
    with pytest.raises(torch.OutOfMemoryError, match="injected 1") as raised, runtime.iteration():
        runtime.retry_out_of_memory(_failing(1, events), lambda: events.append("reset"))
    assert events == ["attempt 1"] and raised.value.__cause__ is None


def test_an_attempt_that_closed_the_iteration_is_not_retried():
    """An integration that gave the iteration up inside the attempt (one rank of several) cannot be retried."""
    runtime, events = _runtime(retries=3), []
    opened = runtime.iteration()
    opened.__enter__()

    def attempt():
        events.append("attempt")
        error = torch.OutOfMemoryError("rank gives up")
        opened.__exit__(type(error), error, None)
        raise error

    with pytest.raises(torch.OutOfMemoryError, match="rank gives up"):
        runtime.retry_out_of_memory(attempt, lambda: events.append("reset"))
    assert events == ["attempt"] and runtime.last_report.failed


def test_other_errors_are_not_retried():
    runtime, events = _runtime(retries=3), []

    def attempt():
        events.append("attempt")
        raise ValueError("not memory")

    with pytest.raises(ValueError), contextlib.ExitStack() as stack:
        stack.enter_context(runtime.iteration())
        runtime.retry_out_of_memory(attempt, lambda: events.append("reset"))
    assert events == ["attempt"]
