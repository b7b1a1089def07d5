"""Finding a policy entry for a tensor autograd saves, without stable tensor identities.

The executor numbers the storages saved in an iteration in save order (the same numbering as
``PolicyEntry.save_ordinal``, parameters included) and notes the op count at the save. A match is:

- **exact**: the traced iteration saved a storage of the same dtype and shape at this ordinal (the
  sequence is aligned here): the entry at that ordinal, or nothing when the policy keeps it;
- **fuzzy**: otherwise, among the entries within ``window`` ordinals, those with the same dtype and
  number of dimensions, bytes within ``bytes_tolerance`` and a save op count within ``op_tolerance``
  (relative) of the expected one; the nearest ordinal wins. A fuzzy match is taken only when it is
  unique at that distance (confident); everything else stays on the device.

A wrong match never corrupts data: swapping is exact for any tensor; it can only cost memory or time.
"""

from __future__ import annotations

import dataclasses

import torch

from chameleon_dist.policy.model import Policy, PolicyEntry, save_key
from chameleon_dist.policy.simulator import SWAP


@dataclasses.dataclass
class MatchCounts:
    exact: int = 0
    fuzzy: int = 0
    unmatched: int = 0  # saved storages the policy covers nowhere near (kept on the device)


class PolicyMatcher:
    def __init__(self, policy: Policy, window: int = 8, bytes_tolerance: float = 0.5, op_tolerance: float = 0.25) -> None:
        self.policy = policy
        # recompute decisions are carried out as swaps (the executor has no recompute path yet)
        self._by_ordinal: dict[int, PolicyEntry] = {e.save_ordinal: e for e in policy.entries if e.decision in (SWAP, "recompute")}
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
