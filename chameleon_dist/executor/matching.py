"""Finding a policy entry for a tensor autograd saves, without stable tensor identities.

Eager tensors get new identities every iteration; what repeats is the order in which autograd saves them.
``PolicyMatcher`` finds a saved storage's entry by its save ordinal, exactly where the sequence is aligned
and fuzzily nearby where it has shifted. See NOTE [Save-ordinal matching] below for the rule.
"""

from __future__ import annotations

import dataclasses

import torch

from chameleon_dist.policy.model import Decision, Policy, PolicyEntry, save_key

# NOTE [Save-ordinal matching]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A saved tensor has no identity that survives the iteration, so a policy entry names it by its *save
# ordinal*: the position of its storage among the distinct storages autograd saved in the iteration, in
# first-save order. Every saved storage counts (parameters and storages the policy keeps included); a
# second view of a storage already numbered takes that storage's number and adds none. Both sides number
# the same way:
#
# - the generator (policy/assemble.py) numbers the storages of ``StepTrace.saves`` and writes
#   ``PolicyEntry.save_ordinal`` per entry and ``Policy.save_keys`` ("dtype[shape]" per ordinal, KEEPs
#   included) so that the executor can tell an aligned sequence from a shifted one;
# - the executor (executor/swap.py) numbers the storages it packs, starting over at every iteration and
#   every out-of-memory retry, and asks ``PolicyMatcher.match`` with that ordinal and its op count.
#
# A match is
#
# - **exact** when the traced iteration saved a storage of the same dtype and shape at this ordinal (the
#   sequence is aligned here): the entry at that ordinal, or nothing when the policy keeps it;
# - **fuzzy** otherwise: among the unused entries within ``window`` ordinals, those with the same dtype and
#   number of dimensions, saved-view bytes within ``bytes_tolerance`` and a save op count within
#   ``op_tolerance`` (both relative) of the entry's; the nearest ordinal wins, and only when it is unique at
#   that distance (two equally near: ambiguous, not confident).
#
# Each entry is used at most once per attempt. Everything else stays on the device (counted as unmatched
# when it falls inside the range the policy covers). A wrong match never corrupts data: swapping is exact
# for any tensor; it can only cost memory or time.


@dataclasses.dataclass
class MatchCounts:
    exact: int = 0
    fuzzy: int = 0
    unmatched: int = 0  # saved storages the policy covers nowhere near (kept on the device)


class PolicyMatcher:
    def __init__(self, policy: Policy, window: int = 8, bytes_tolerance: float = 0.5, op_tolerance: float = 0.25) -> None:
        self.policy = policy
        # recompute decisions are carried out as swaps (the executor has no recompute path yet)
        self._by_ordinal: dict[int, PolicyEntry] = {
            e.save_ordinal: e for e in policy.entries if e.decision in (Decision.SWAP, Decision.RECOMPUTE)
        }
        self._window = window
        self._bytes_tolerance = bytes_tolerance
        self._op_tolerance = op_tolerance
        self._used: set[int] = set()
        self.counts = MatchCounts()
        self._max_ordinal = max(self._by_ordinal, default=-1)

    def reset(self) -> None:
        self._used.clear()
        self.counts = MatchCounts()

    def match(self, ordinal: int, tensor: torch.Tensor, op_count: int) -> PolicyEntry | None:
        """The entry for the storage saved at ``ordinal`` after ``op_count`` ops (-1: unknown), or None to
        keep it on the device. Enforces NOTE [Save-ordinal matching]."""
        dtype = str(tensor.dtype).removeprefix("torch.")
        keys = self.policy.save_keys
        if ordinal < len(keys) and keys[ordinal] == save_key(dtype, tensor.shape):
            entry = self._by_ordinal.get(ordinal)
            if entry is None or ordinal in self._used:
                return None
            self._used.add(ordinal)
            self.counts.exact += 1
            return entry
        nbytes = tensor.numel() * tensor.element_size()
        for distance in range(0, self._window + 1):
            found = []
            for k in {ordinal - distance, ordinal + distance}:
                e = self._by_ordinal.get(k)
                if e is None or k in self._used or e.dtype != dtype or len(e.shape) != tensor.dim():
                    continue
                if abs(e.tensor_nbytes - nbytes) > self._bytes_tolerance * max(e.tensor_nbytes, 1):
                    continue
                if op_count >= 0 and abs(e.save_op_index - op_count) > self._op_tolerance * max(e.save_op_index, 1):
                    continue
                found.append(k)
            if len(found) == 1:
                self._used.add(found[0])
                self.counts.fuzzy += 1
                return self._by_ordinal[found[0]]
            if len(found) > 1:
                break  # ambiguous: not confident
        if self._by_ordinal and ordinal <= self._max_ordinal + self._window:
            self.counts.unmatched += 1
        return None
