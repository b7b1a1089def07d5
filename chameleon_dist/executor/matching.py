"""Finding a policy entry for a tensor autograd saves, without stable tensor identities.

Eager tensors get new identities every iteration; what repeats is where autograd saves them: in which
micro-batch and layer, after which op, of which dtype and rank, and in which order. ``PolicyMatcher``
follows the iteration's saves along the policy's saves in that order (an alignment that skips what one
side lacks). See NOTE [Save-site matching] below for the rule.
"""

from __future__ import annotations

import bisect
import dataclasses
import re

import torch

from chameleon_dist.policy.model import Decision, Policy, PolicyEntry, save_key

# NOTE [Save-site matching]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A saved tensor has no identity that survives the iteration, so both sides describe every saved storage
# (the first save of each distinct storage, in first-save order: its *save ordinal*; a second view of a
# storage already numbered adds none) by its *site*:
#
#     "<micro-batch>:<layer>:<last op>:<dtype>:<rank>"
#
# - micro-batch: how many times a forward save followed a backward pass in this iteration (the executor
#   counts it: a save outside backward after an unpack starts the next micro-batch), or the identity an
#   engine's schedule names (``IterationContext.micro_batch``: under 1F1B and interleaving, counting is wrong);
# - layer: the transformer layer running (``layers.<i>`` and the like; -1 outside any), from hooks on the
#   layer modules (``profiler.scope.LayerClock``), and the expert running inside it (``3.e5``) where experts
#   are modules of their own, so that an expert's saves match that expert's entries whatever the others did;
# - last op: the aten op recorded last before the save. For an op's outputs that is the op itself; for its
#   inputs it is the op before it, because autograd saves inputs before the op reaches the dispatcher.
#   For the same reason the argument position (``PolicyEntry.arg_position``) cannot be known at run time
#   and is not part of the site: the order of saves within a site stands in for it;
# - dtype and rank: not the shape, so that one policy serves every sequence length, batch size and expert
#   load (the tensor actually saved is what moves; its size is not the traced one).
#
# The walk passes every first save of a strided storage, also those the executor never moves (under
# ``min_swap_bytes``, a parameter's view, a protected buffer, a save inside backward): the trace numbered
# them too. Walking only the movable ones let a large save take the ordinal of a small one before it at the
# same site (kept), and its own entry was passed over (in Megatron's MoE layer, small per-expert saves share
# their site with the experts' activations: 16 of 151 entries never fired, peaks 2 MiB over the prediction).
#
# The generator (policy/assemble.py) writes ``Policy.save_sites`` (from ``StepTrace.save_sites``, which the
# executor reported while the trace was recorded) and ``Policy.save_keys`` ("dtype[shape]") per ordinal,
# KEEPs included. At run time ``PolicyMatcher.match`` keeps a cursor into the policy's saves:
#
# 1. the policy ordinal at the cursor with the same site is the match (the sequences are aligned);
# 2. else the nearest ordinal after the cursor, within ``window``, with the same site: the policy ordinals
#    passed over are saves this iteration does not make (an expert that got no token), and their
#    entries do not fire (``MatchCounts.skipped``);
# 3. else, inside an expert (the site's layer reads ``<layer>.e<expert>``: experts that are modules of their
#    own, ``experts.<j>`` or Megatron's ``local_experts.<j>``), the decision its siblings got: an expert idle
#    in the traced iteration has no saves in the policy, so its k-th save at a site takes the entry of the
#    first sibling expert's k-th save at the same site, when at least half the siblings' saves there have an
#    entry (counted ``fuzzy``; its swaps are placed shifted like any match, by the op clock at the save);
# 4. else nothing: a save the policy does not know (an inserted op) stays on the device
#    (``MatchCounts.unmatched``), and the cursor stays where it was.
#
# A match is *exact* when the shape is also the traced one, *fuzzy* (scaled) when only the site is.
# The policy entry at the matched ordinal decides (none: the policy keeps it). Each ordinal is matched at
# most once per attempt, and the cursor starts over with every iteration and out-of-memory retry. A policy
# without sites (written before they existed, or built from a trace without them) is matched the same way
# on its ``save_keys``, so that only the same shapes match.
#
# A wrong match never corrupts data: swapping copies any tensor byte for byte and restores it with its
# own shape and strides, so a tensor swapped in another's place comes back intact. It can only cost memory
# (a tensor kept that the plan would have moved) or time (a tensor moved that the plan would have kept, or
# brought back at another tensor's trigger), and the controller watches both: a peak over the budget
# tightens the policy, a passive swap makes the runtime profile again.

DEFAULT_WINDOW = 512
"""How many policy saves past the cursor a save may skip to find its site (an MoE layer whose experts all
stayed idle skips one expert's saves per expert)."""


@dataclasses.dataclass
class MatchCounts:
    exact: int = 0
    fuzzy: int = 0  # matched on the site with another shape (a rescaled or rerouted tensor)
    unmatched: int = 0  # saved storages whose site the policy has nowhere near (kept on the device)
    skipped: int = 0  # policy entries whose save this iteration did not make (passed over)


class PolicyMatcher:
    def __init__(self, policy: Policy, window: int = DEFAULT_WINDOW) -> None:
        self.policy = policy
        self._by_ordinal: dict[int, PolicyEntry] = {
            e.save_ordinal: e for e in policy.entries if e.decision in (Decision.SWAP, Decision.RECOMPUTE)
        }
        self._entry_ordinals = sorted(self._by_ordinal)
        # per micro-batch, the traced op where its backward pass began (its earliest backward use): a
        # swap-out placed before it belongs to the forward pass (NOTE [Placed swaps] in schedule.py)
        self.backward_start: dict[int, int] = {}
        for e in self._by_ordinal.values():
            start = self.backward_start.get(e.micro_batch)
            self.backward_start[e.micro_batch] = e.first_backward_use if start is None else min(start, e.first_backward_use)
        sites = policy.save_sites
        self.by_site = bool(sites) and len(sites) == len(policy.save_keys) and all(sites)
        self._symbols: list[str] = list(sites) if self.by_site else list(policy.save_keys)
        self._window = window
        self._cursor = 0
        self.counts = MatchCounts()
        self._siblings = _sibling_entries(self._symbols, self._by_ordinal) if self.by_site else {}
        self._occurrences: dict[str, int] = {}  # site -> saves walked at it in this attempt

    def reset(self) -> None:
        self._cursor = 0
        self.counts = MatchCounts()
        self._occurrences = {}

    def match(self, tensor: torch.Tensor, site: str, eligible: bool = True) -> PolicyEntry | None:
        """The entry for a storage saved first now at ``site``, or None to keep it on the device. Enforces
        NOTE [Save-site matching]. Every first save is walked, also one the executor never moves
        (``eligible`` false: under ``min_swap_bytes``, a parameter's view, protected): it took an ordinal in
        the trace too. Such a save gets no entry; an entry at its ordinal counts as skipped."""
        key = save_key(str(tensor.dtype).removeprefix("torch."), tensor.shape)
        symbols, start = self._symbols, self._cursor
        symbol = site if self.by_site else key
        occurrence = self._occurrences.get(symbol, 0)
        if self._siblings:  # (only a policy with expert sites has siblings to count for)
            self._occurrences[symbol] = occurrence + 1
        stop = min(len(symbols), start + self._window + 1)
        for ordinal in range(start, stop):
            if symbols[ordinal] == symbol:
                break
        else:
            sibling = self._siblings.get((_without_expert(symbol), occurrence)) if _EXPERT.search(symbol) else None
            if sibling is not None and eligible:
                self.counts.fuzzy += 1
                return sibling
            self.counts.unmatched += 1
            return None
        self.counts.skipped += bisect.bisect_left(self._entry_ordinals, ordinal) - bisect.bisect_left(
            self._entry_ordinals, start
        )
        self._cursor = ordinal + 1
        entry = self._by_ordinal.get(ordinal)
        if entry is None:
            return None
        if not eligible:
            self.counts.skipped += 1
            return None
        if self.policy.save_keys[ordinal] == key:
            self.counts.exact += 1
        else:
            self.counts.fuzzy += 1
        return entry


_EXPERT = re.compile(r"^([^:]*:[^:]*)\.e\d+:")


def _without_expert(site: str) -> str:
    """``site`` with its expert index left out (``"0:3.e5:aten.mm:float32:2"`` -> ``"0:3:aten.mm:float32:2"``)."""
    return _EXPERT.sub(r"\1:", site, count=1)


def _sibling_entries(sites: list[str], by_ordinal: dict[int, PolicyEntry]) -> dict[tuple[str, int], PolicyEntry]:
    """(site without its expert, k) -> the entry an expert's k-th save at that site takes when the policy has
    none of that expert's (NOTE [Save-site matching], rule 3): the first sibling's entry, where at least half
    the siblings' k-th saves there have one."""
    counts: dict[tuple[str, int], list[int]] = {}  # key -> [siblings, siblings with an entry]
    first: dict[tuple[str, int], PolicyEntry] = {}
    occurrences: dict[str, int] = {}
    for ordinal, site in enumerate(sites):
        if not _EXPERT.search(site):
            continue
        k = occurrences.get(site, 0)
        occurrences[site] = k + 1
        key = (_without_expert(site), k)
        tally = counts.setdefault(key, [0, 0])
        tally[0] += 1
        entry = by_ordinal.get(ordinal)
        if entry is not None:
            tally[1] += 1
            first.setdefault(key, entry)
    return {key: entry for key, entry in first.items() if 2 * counts[key][1] >= counts[key][0]}
