"""One profiled iteration's trace and each of its ops' kernel seconds on the emulated device's clock, lined
up one to one (``launch/experiments/scale_eq1.py`` and ``scale_runs.profiled_iteration`` use it).

How the observer's ops line up with the trace's: the observer hears every op that reaches the backend, in
order; the recorder (``profiler/recorder.py``) numbers the ops it sees, i.e. the same ops except those run
while ``TrainingScope`` is paused (the swap executor's and the saved-tensor hooks' own: detach, host buffers,
copies). ``profile_iteration`` notes ``scope.paused`` at each of the observer's ops and keeps the others: they
are the trace's ops, one to one and in order (a test checks the names, with and without swapping). Ops the
backend runs on the host side append 0.0, so a recorded one of those has its entry too. The recorder also
drops ``profiler::`` markers (``record_function``); a closure that runs them makes the counts differ, and
``profile_iteration`` raises rather than misalign.
"""

from __future__ import annotations

from typing import Callable

from chameleon_dist import Chameleon
from chameleon_dist.device import SimulatedBackend
from chameleon_dist.trace import StepTrace


class _TaggedOpTimes(list):
    """``SimulatedBackend.op_times_s`` that notes, per op, whether the profiler recorded it."""

    def __init__(self, scope) -> None:
        super().__init__()
        self.scope = scope
        self.recorded: list[bool] = []

    def append(self, seconds: float) -> None:
        super().append(seconds)
        self.recorded.append(not self.scope.paused)


def profile_iteration(runtime: Chameleon, closure: Callable[[], object]) -> tuple[StepTrace, list[float]]:
    """Run ``closure`` as one profiled (WarmUp) iteration of ``runtime`` on an emulated device; return the
    trace and each of its ops' kernel seconds (module docstring: how the two line up)."""
    backend = getattr(runtime.device, "backend", None)
    if not isinstance(backend, SimulatedBackend):
        raise ValueError("profile_iteration needs an EmulatedDevice (the per-op times come from its backend)")
    times = backend.op_times_s = _TaggedOpTimes(runtime.profiler.scope)
    try:
        runtime.run_iteration(closure)
    finally:
        backend.op_times_s = None
    trace, report = runtime.last_trace, runtime.last_report
    if trace is None or trace.iteration != report.iteration or report.oom_retries:
        raise ValueError("the iteration was not one profiled attempt (a runtime past WarmUp, or an OOM retry)")
    op_times_s = [t for t, recorded in zip(times, times.recorded) if recorded]
    if len(op_times_s) != len(trace.ops):
        raise ValueError(f"{len(op_times_s)} recorded op times for {len(trace.ops)} trace ops")
    return trace, op_times_s
