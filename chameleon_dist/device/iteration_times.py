"""Iteration times read from the device's timing marks, waiting for the device only where asked.

NOTE [Stable iterations never wait for their own figures]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An iteration's device time is the distance between a mark at its start and one at its end on the compute
stream (``DeviceTimer``). Reading it at the iteration's end needs the device to have reached the end mark:
on a GPU that is a host synchronisation, after which the device runs dry until the host has queued the next
iteration's first kernels. WarmUp and GenPolicy iterations wait (a trial is ranked by its own time, and the
trace's layer times need the wait anyway). A Stable iteration does not: its marks are kept, and the figure
reported is that of the newest iteration whose end mark has completed by the time this one ends (``query``
only), normally the previous iteration, or this one when the device has caught up already (as on a host
that waits for its values, e.g. ``loss.item()``). ``IterationReport.iteration_s_lag`` says how many
iterations the figure lags. Stall times follow the same rule (``StreamDevice.stall_s``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

MAX_PENDING_ITERATIONS = 64  # marks kept while the device lags; older ones are dropped unread


class IterationTimes:
    """The device times of iterations, each resolved when its end mark has completed (see the NOTE)."""

    def __init__(self) -> None:
        self._pending: deque[tuple[int, Any, Any, Any]] = deque(maxlen=MAX_PENDING_ITERATIONS)
        self._latest_iteration = 0
        self._latest_s = math.nan  # nothing resolved yet

    def finish(self, iteration: int, timer: Any, start: Any, wait: bool) -> tuple[float, int]:
        """Mark the end of ``iteration`` (which began at ``timer``'s mark ``start``); ``wait``: block until the
        device has reached it. Returns (the newest resolved iteration's device seconds, its lag in iterations)."""
        self._pending.append((iteration, timer, start, timer.mark()))
        if wait:
            timer.resolve()  # the device reached every mark made so far: every pending one
        while self._pending:
            done, done_timer, done_start, done_end = self._pending[0]
            if not (wait or done_timer.completed(done_end)):
                break
            self._pending.popleft()
            self._latest_iteration, self._latest_s = done, done_timer.elapsed_s(done_start, done_end)
        return self._latest_s, iteration - self._latest_iteration
