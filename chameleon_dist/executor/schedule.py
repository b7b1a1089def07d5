"""``PlacedSchedule``: the swap-outs, releases and swap-ins a policy placed on the op clock, for one attempt
of an iteration (NOTE [Placed swaps])."""

from __future__ import annotations

import heapq
import weakref
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from chameleon_dist.executor.records import SwapEntry

# NOTE [Placed swaps]
# ~~~~~~~~~~~~~~~~~~~
# The policy generator places three points per swapped storage on the traced iteration's op clock, and
# its simulator predicts peak and time from exactly those points (policy/simulator.py): the swap-out is
# issued at the end of op ``swap_out_at`` (later than the save when the producing layer's copy time is
# spent), the device block is released at the end of op ``release_at`` (once the copy completed), and
# the swap-in starts before op ``swap_in_at``. The executor carries out all three on the same clock: the
# profiler's dispatch mode calls ``SwapExecutor.on_op`` after an op whenever the op count reached
# ``due_op``, the earliest scheduled point (an op with nothing due costs one comparison). Each point is
# shifted by how far the sequence had moved when the storage was saved (its op count minus the traced
# ``save_op_index``), so an inserted op or an earlier micro-batch moves its points alike. Until its
# swap-out is issued the entry holds the device original (``EntryState.HELD``), where the simulator counts
# it too. From the issue on, the device holds the original until its copy completed (NOTE [Release after
# copy] in device/base.py); the release point is where the executor asks the device to let go of every
# source whose copy completed (``release_completed_sources``: on CUDA a query of the copies' events, no
# wait). The emulated device lets go the moment a copy completes, and so may CUDA at any earlier query:
# memory is never held longer than the simulator assumed, only sometimes less. (Holding every original
# until its planned op, where copies completed earlier than predicted, kept bytes the old executor had
# freed: more passive swaps when sequences grew.) A swap-out placed in the forward pass whose op never
# came there (the sequence moved) is issued when backward begins, the latest point before backward needs
# the link, and counted (``late_swap_outs``); memory pressure issues the pending ones at once. Without an
# op clock (the executor used without the runtime) every point is the save, as without a policy.
# ``counters.placed`` lists each point as it was carried out (a release point where the copy had
# completed): tests compare it with the policy's.

NEVER = 1 << 62
"""``due_op`` when nothing is scheduled on the op clock."""

_Heap = list[tuple[int, int, "weakref.ReferenceType[SwapEntry]"]]


class PlacedSchedule:
    """Three heaps of (op count, save position, entry), earliest first: delayed swap-outs, releases and
    swap-ins. Entries are held weakly: one that died (its saved tensors were freed) is skipped."""

    def __init__(self) -> None:
        self.swap_outs: _Heap = []
        self.releases: _Heap = []
        self.swap_ins: _Heap = []

    @staticmethod
    def add(heap: _Heap, at_op: int, entry: "SwapEntry") -> None:
        heapq.heappush(heap, (at_op, entry.position, weakref.ref(entry)))

    @staticmethod
    def due(heap: _Heap, op_count: int) -> Iterator["SwapEntry"]:
        """Pops the live entries whose point is at or before ``op_count`` (every one when it is < 0)."""
        while heap and (op_count < 0 or heap[0][0] <= op_count):
            entry = heapq.heappop(heap)[2]()
            if entry is not None:
                yield entry

    def next_op(self) -> int:
        """The op count at which the next point is due (``NEVER`` when none is)."""
        return min((heap[0][0] for heap in (self.swap_outs, self.releases, self.swap_ins) if heap), default=NEVER)

    def take_swap_outs(self, everything: bool) -> list["SwapEntry"]:
        """The pending swap-outs to issue now: those placed in the forward pass (``everything``: all); the
        others keep their op."""
        taken, waiting = [], []
        for item in self.swap_outs:
            entry = item[2]()
            if entry is None or not entry.awaiting_swap_out:
                continue
            if everything or entry.out_in_forward:
                taken.append(entry)
            else:
                waiting.append(item)
        heapq.heapify(waiting)
        self.swap_outs = waiting
        return taken
