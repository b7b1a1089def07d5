"""The lightweight profiler's signature and comparison, and the stage machine."""

import pytest
import torch

from chameleon_dist.profiler import OpVocabulary, Signature, SignatureMode, StageMachine, compare
from chameleon_dist.trace.stages import Stage, TransitionCause, Verdict

from chameleon_dist.profiler.signature import ChangeKind, cosine_similarity, pair_profile_cosine


def _record(fn):
    vocabulary = OpVocabulary()
    mode = SignatureMode(vocabulary)
    with mode:
        fn()
    return mode.ids, vocabulary


def test_signature_records_every_op_and_marks_ops_outside_autograd():
    x = torch.randn(8, 8, requires_grad=True)

    def step():
        y = (x @ x).relu().sum()
        y.backward()
        with torch.no_grad():
            x.mul_(0.5)

    ids, vocabulary = _record(step)
    names = [vocabulary.names[i if i >= 0 else ~i] for i in ids]
    assert names[:2] == ["aten.mm.default", "aten.relu.default"] and "aten.sum.default" in names
    assert ids[0] >= 0 and ids[1] >= 0, "forward ops under grad count"
    assert ids[-1] < 0 and names[-1] == "aten.mul_.Tensor", "the no-grad update is outside autograd"
    backward = [i for i, name in zip(ids, names) if name == "aten.threshold_backward.default"]
    assert backward and all(i >= 0 for i in backward), "backward ops count"


def _sig(ids, saved=()):
    return Signature.of(list(ids), list(saved))


def test_identical_sequences_are_unchanged():
    comparison = compare(_sig(range(100), [4] * 10), _sig(range(100), [4] * 10), 0.05, 0.95)
    assert not comparison.differs and not comparison.changed and comparison.cosine == pytest.approx(1.0)


def test_ops_outside_autograd_flag_a_change_but_need_no_new_policy():
    base = list(range(100))
    with_validation = base + [~i for i in range(50)]
    comparison = compare(_sig(with_validation), _sig(base), 0.05, 0.95)
    assert comparison.differs and not comparison.changed and not comparison.major
    assert "absorbed" in comparison.reason


def test_more_ops_and_more_saved_bytes_is_a_new_program():
    """An added branch or another micro-batch: more work on more data."""
    reference = _sig(list(range(100)) * 2, [100] * 20)
    comparison = compare(_sig(list(range(100)) * 2 + list(range(10)), [100] * 21), reference, 0.05, 0.95)
    assert comparison.length_change == pytest.approx(0.05) and comparison.changed and comparison.major
    assert comparison.kind == ChangeKind.CHANGED and "profiler.length_change" in comparison.reason
    small = compare(_sig(list(range(100)) * 2 + [1, 2], [100] * 20), reference, 0.05, 0.95)
    assert small.differs and not small.changed and small.kind == ChangeKind.ABSORBED


def test_a_new_length_under_moe_routing_is_rescaled_not_a_new_program():
    """Issue 27: a longer sequence under top-1 routing moves every saved size (+50%) but only the expert loop's
    ops (+10%: more experts got tokens); another micro-batch moves both alike (+50%, +50%: a new program)."""
    expert = list(range(10, 20))
    reference = _sig(list(range(10)) + expert * 8 + list(range(20, 30)), [64] * 20)
    longer = _sig(list(range(10)) + expert * 9 + list(range(20, 30)), [96] * 20)
    comparison = compare(longer, reference, 0.05, 0.95)
    assert comparison.length_change > 0.05 and comparison.saved_bytes_change == pytest.approx(0.5)
    assert comparison.kind == ChangeKind.RESCALED and not comparison.changed, comparison.reason
    another_micro_batch = _sig((list(range(10)) + expert * 8 + list(range(20, 30))) * 3, [64] * 30)
    doubled = _sig((list(range(10)) + expert * 8 + list(range(20, 30))) * 2, [64] * 20)
    assert compare(another_micro_batch, doubled, 0.05, 0.95).changed


def test_more_ops_on_the_same_data_is_rerouting():
    """Experts that got no token skip their ops; the tokens (hence the saved bytes) stay."""
    expert = list(range(10, 20))
    reference = _sig(list(range(10)) + expert * 16 + list(range(20, 30)), [64] * 32)
    fewer = _sig(list(range(10)) + expert * 13 + list(range(20, 30)), [64] * 26 + [128] * 3)
    comparison = compare(fewer, reference, 0.05, 0.95)
    assert comparison.length_change > 0.05 and comparison.saved_bytes_change == 0
    assert comparison.kind == ChangeKind.REROUTED and not comparison.changed


def test_a_skipped_block_early_in_the_sequence_keeps_the_pair_profile():
    """The paper's positional cosine drops when a deletion shifts every later op; the pair profile does not."""
    block = list(range(5, 45))
    reference = list(range(5)) + block * 32 + list(range(50, 90))
    skipped = list(range(5)) + block * 31 + list(range(50, 90))
    a, b = torch.tensor(skipped), torch.tensor(reference)
    assert cosine_similarity(a, b) < 0.95
    comparison = compare(_sig(skipped, [8]), _sig(reference, [8]), 0.05, 0.95)
    assert comparison.cosine > 0.99 and not comparison.changed and comparison.kind == ChangeKind.ABSORBED


def test_one_inserted_op_is_absorbed():
    reference = list(range(200))
    inserted = reference[:20] + [7] + reference[20:]
    comparison = compare(_sig(inserted, [8]), _sig(reference, [8]), 0.05, 0.95)
    assert comparison.differs and comparison.kind == ChangeKind.ABSORBED


def test_reversed_sequence_fails_the_cosine_test():
    reference = list(range(1, 200))
    comparison = compare(_sig(reference[::-1]), _sig(reference), 0.05, 0.95)
    assert comparison.length_change == 0 and comparison.cosine < 0.95 and comparison.major
    assert "profiler.cosine_threshold" in comparison.reason


def test_saved_bytes_change_with_the_same_ops_is_a_rescale():
    comparison = compare(_sig(range(100), [1000] * 10), _sig(range(100), [500] * 10), 0.05, 0.95)
    assert comparison.kind == ChangeKind.RESCALED and not comparison.changed
    assert "saved for backward" in comparison.reason
    minor = compare(_sig(range(100), [1000, 1010]), _sig(range(100), [1010, 1000]), 0.05, 0.95)
    assert minor.differs and not minor.changed and minor.kind == ChangeKind.ABSORBED


def test_pair_profile_cosine_edges():
    empty = torch.tensor([], dtype=torch.int64)
    assert pair_profile_cosine(empty, empty) == 1.0
    assert pair_profile_cosine(empty, torch.tensor([1])) == 0.0
    assert pair_profile_cosine(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])) == pytest.approx(1.0)
    assert pair_profile_cosine(torch.tensor([0, 1]), torch.tensor([1, 0])) == 0.0


def test_cosine_pads_the_shorter_sequence():
    a = torch.tensor([0, 1, 2])
    assert cosine_similarity(a, a) == pytest.approx(1.0)
    assert cosine_similarity(a, torch.tensor([0, 1, 2, 0, 1, 2])) < 1.0
    assert cosine_similarity(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == 1.0


def _passive_swaps(count: int) -> Verdict:
    """The policy controller's verdict on an iteration that needed ``count`` passive swaps it did not absorb."""
    return Verdict(TransitionCause.PASSIVE_SWAP, f"{count} passive swap(s): the device ran out of memory")


def test_stage_machine_follows_algorithm_1():
    machine = StageMachine(warmup_iterations=2, policy_trials=3)
    stages = []
    for _ in range(7):
        stages.append(machine.stage)
        machine.advance(major_change=False, verdict=Verdict())
    assert stages == [Stage.WARMUP, Stage.WARMUP, Stage.GEN_POLICY, Stage.GEN_POLICY, Stage.GEN_POLICY, Stage.STABLE, Stage.STABLE]
    transition = machine.advance(major_change=True, verdict=Verdict(), change_reason="length changed")
    assert (transition.before, transition.after) == (Stage.STABLE, Stage.WARMUP) and "length changed" in transition.reason
    assert machine.advance(False, _passive_swaps(1)) is None  # a passive swap in WarmUp is its safety net: no restart
    assert machine.advance(False, Verdict()).after == Stage.GEN_POLICY
    transition = machine.advance(False, _passive_swaps(2))  # a passive swap under a policy goes back to WarmUp
    assert (transition.before, transition.after) == (Stage.GEN_POLICY, Stage.WARMUP) and "passive swap" in transition.reason


def test_zero_warmup_goes_straight_to_gen_policy():
    machine = StageMachine(warmup_iterations=0, policy_trials=1)
    assert machine.stage == Stage.GEN_POLICY
    assert machine.advance(False, Verdict()).after == Stage.STABLE
    assert machine.advance(True, Verdict(), "x").after == Stage.GEN_POLICY


def test_a_major_change_restarts_warmup_from_gen_policy_but_not_within_warmup():
    machine = StageMachine(warmup_iterations=2, policy_trials=2)
    assert machine.advance(False, Verdict()) is None  # iteration 1
    transition = machine.advance(True, Verdict(), "lazy initialisation in iteration 1")  # iteration 2 differs from 1
    assert transition.after == Stage.GEN_POLICY, "WarmUp renews its reference every iteration: no restart"
    transition = machine.advance(True, Verdict(), "branch taken")
    assert (transition.before, transition.after) == (Stage.GEN_POLICY, Stage.WARMUP)
