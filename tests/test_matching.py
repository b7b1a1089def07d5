"""Finding policy entries for saved tensors without stable identities (executor/matching.py)."""

import torch

from chameleon_dist.executor.matching import PolicyMatcher
from chameleon_dist.policy.model import Decision, Policy, PolicyEntry, save_key


def _entry(ordinal, shape, save_op, dtype="float32"):
    nbytes = 4
    for size in shape:
        nbytes *= size
    return PolicyEntry(
        decision=Decision.SWAP, nbytes=nbytes, micro_batch=0, layer=0, group=0, save_ordinal=ordinal,
        layer_save_ordinal=ordinal, save_op_index=save_op, calling_op="aten.mm.default", arg_position=0,
        dtype=dtype, shape=tuple(shape), tensor_nbytes=nbytes, swap_out_at=save_op, last_forward_use=save_op + 1,
        release_at=save_op + 2, swap_in_at=90, first_backward_use=100,
    )


def _policy(saved_shapes, swapped):
    """``saved_shapes``: the traced iteration's saves by ordinal; ``swapped``: ordinals the policy swaps."""
    entries = [_entry(k, saved_shapes[k], 10 * (k + 1)) for k in swapped]
    return Policy("p", 10**9, True, 0, 0, 0.0, 0.0, 0.0, 0.0, entries, [], 200, 1, {},
                  save_keys=[save_key("float32", shape) for shape in saved_shapes])


SHAPES = [(4, 8), (4, 8), (16, 8), (4, 8), (2, 2)]


def test_an_aligned_sequence_matches_exactly_and_keeps_what_the_policy_keeps():
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[1, 2]))
    found = [matcher.match(k, torch.zeros(shape), 10 * (k + 1)) for k, shape in enumerate(SHAPES)]
    assert [e.save_ordinal if e else None for e in found] == [None, 1, 2, None, None]
    assert (matcher.counts.exact, matcher.counts.fuzzy, matcher.counts.unmatched) == (2, 0, 0)


def test_a_shifted_sequence_matches_the_one_nearest_similar_entry():
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[2]))
    # one extra save before it (ordinal 3 instead of 2) and 12.5% more bytes: still the entry of ordinal 2
    entry = matcher.match(3, torch.zeros(16, 9), 31)
    assert entry is not None and entry.save_ordinal == 2 and matcher.counts.fuzzy == 1
    assert matcher.match(3, torch.zeros(16, 9), 31) is None  # an entry is used once


def test_no_confident_match_keeps_the_tensor_on_the_device():
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[0, 1]))
    assert matcher.match(5, torch.zeros(4, 8), 60) is None  # saved far later in the op sequence than 0 and 1
    assert matcher.match(2, torch.zeros(64, 64), 30) is None  # nothing of that size nearby
    assert matcher.match(2, torch.zeros(4, 8, dtype=torch.float64), 30) is None  # other dtype
    assert matcher.counts.exact == matcher.counts.fuzzy == 0 and matcher.counts.unmatched == 3


def test_two_equally_near_candidates_are_ambiguous():
    shapes = [(4, 8), (2, 2), (4, 8)]
    matcher = PolicyMatcher(_policy(shapes, swapped=[0, 2]))
    assert matcher.match(1, torch.zeros(4, 8), 20) is None  # entries 0 and 2 are both one ordinal away
