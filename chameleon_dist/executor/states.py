"""The life of a ``SwapEntry`` (executor/records.py): its states and the moves between them, in one table
(NOTE [Swap entry lifecycle]). ``SwapEntry._move`` is the only code that changes an entry's state, and it
goes through ``checked_move``."""

from __future__ import annotations

import enum
import types
from typing import Mapping


class EntryState(enum.Enum):
    """Where a ``SwapEntry`` is in its life; NOTE [Swap entry lifecycle] lists the legal moves."""

    HELD = "held"  # the entry holds the device original; its swap-out is not issued yet
    REFUSED = "refused"  # the host budget had no room at ``issue``: the entry keeps holding the original
    COPYING = "copying"  # the swap-out is issued; the entry still holds the original (until ``release``)
    RELEASED = "released"  # the entry let go of the original: its bytes are on the host (or on their way)
    RESTORING = "restoring"  # the swap-in copy is in flight
    RESTORED = "restored"  # the swap-in copy landed: new device bytes, the host buffer went back
    REUSED_AFTER_COPY = "reused after copy"  # restored by reusing the live original after its swap-out
    REUSED_WITHOUT_COPY = "reused without copy"  # restored by reusing the original, never copied out
    PENDING_RECOMPUTE = "pending recompute"  # off the device with no copy: rebuilt when backward needs it
    REBUILT = "rebuilt"  # recomputed from its producer's inputs
    ABANDONED = "abandoned"  # its attempt ran out of memory and was retried: unpacking it raises


# NOTE [Swap entry lifecycle]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``_TRANSITIONS`` is the whole state machine of a ``SwapEntry``, and ``SwapEntry._move`` the one place that
# changes its state (an AssertionError on a move the table lacks). Other files read the state (``state``
# and the properties derived from it) and ask the entry to move through its methods:
#
#     from                 to (method)
#     HELD                 COPYING (issue), REFUSED (issue: the host budget is full),
#                          PENDING_RECOMPUTE (recompute_later),
#                          REUSED_WITHOUT_COPY (reuse_source: backward needs it before its swap-out op)
#     REFUSED              REUSED_WITHOUT_COPY (reuse_source)
#     COPYING              RELEASED (release)
#     RELEASED             RESTORING (start_swap_in), REUSED_AFTER_COPY (reuse_source: the original lives)
#     RESTORING            RESTORED (finish_swap_in), RELEASED (evict)
#     REUSED_AFTER_COPY    RELEASED (evict)
#     PENDING_RECOMPUTE    REBUILT (finish_rebuild), REUSED_WITHOUT_COPY (reuse_source)
#     RESTORED, REUSED_WITHOUT_COPY, REBUILT: nothing more
#     every state but ABANDONED: ABANDONED (abandon)
#
# ``evict`` is pressure relief giving back a restore made ahead of its use while a host copy still exists
# (NOTE [Relief under pressure] in pressure.py): it comes back later, copied or reused again. The two REUSED
# states differ in what may follow: only one reused after its copy has a host copy to go back to, and only
# that one counts at its planned release point (its swap-out was issued: ``issued``). Whether the *device*
# still holds a released original until its copy completed is the device's business (NOTE [Release after
# copy] in device/base.py), not a state of the entry.

_S = EntryState
_TRANSITIONS: Mapping[EntryState, frozenset[EntryState]] = types.MappingProxyType({
    _S.HELD: frozenset({_S.COPYING, _S.REFUSED, _S.PENDING_RECOMPUTE, _S.REUSED_WITHOUT_COPY, _S.ABANDONED}),
    _S.REFUSED: frozenset({_S.REUSED_WITHOUT_COPY, _S.ABANDONED}),
    _S.COPYING: frozenset({_S.RELEASED, _S.ABANDONED}),
    _S.RELEASED: frozenset({_S.RESTORING, _S.REUSED_AFTER_COPY, _S.ABANDONED}),
    _S.RESTORING: frozenset({_S.RESTORED, _S.RELEASED, _S.ABANDONED}),
    _S.RESTORED: frozenset({_S.ABANDONED}),
    _S.REUSED_AFTER_COPY: frozenset({_S.RELEASED, _S.ABANDONED}),
    _S.REUSED_WITHOUT_COPY: frozenset({_S.ABANDONED}),
    _S.PENDING_RECOMPUTE: frozenset({_S.REBUILT, _S.REUSED_WITHOUT_COPY, _S.ABANDONED}),
    _S.REBUILT: frozenset({_S.ABANDONED}),
    _S.ABANDONED: frozenset(),
})
RESTORED_STATES = frozenset({_S.RESTORED, _S.REUSED_AFTER_COPY, _S.REUSED_WITHOUT_COPY, _S.REBUILT})
"""Device bytes are back (``SwapEntry.restored``)."""
ISSUED_STATES = frozenset({_S.COPYING, _S.RELEASED, _S.RESTORING, _S.RESTORED, _S.REUSED_AFTER_COPY})
"""Its swap-out copy was started and the host took it (``SwapEntry.issued``)."""
del _S


def legal_transitions() -> Mapping[EntryState, frozenset[EntryState]]:
    """The state machine of ``SwapEntry`` (NOTE [Swap entry lifecycle]): state -> the states it may move to."""
    return _TRANSITIONS


def checked_move(current: EntryState, to: EntryState) -> EntryState:
    """``to``, when the table lets ``current`` move there; else AssertionError (an executor bug, never a
    user error). ``SwapEntry._move`` is its one caller."""
    if to not in _TRANSITIONS[current]:
        raise AssertionError(f"swap entry: illegal transition {current.name} -> {to.name}")
    return to
