"""The executor carries out the swap-outs, releases and swap-ins at the ops the policy placed them (NOTE
[Placed swaps] in executor/swap.py), not at the save or the unpack."""

from __future__ import annotations

import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.executor import IterationContext, SwapExecutor
from chameleon_dist.executor.context import SwapCounters
from chameleon_dist.policy.model import Decision, Policy, PolicyEntry
from tests.models import make_lm, train_next_token

MODEL = dict(vocab=64, hidden=64, heads=4, layers=4, dropout=0.0)
BATCH, SEQ = 2, 64


class _PlannedSlowDevice(EmulatedDevice):
    """An emulated device whose copies are instant but which tells the policy generator its link is slow:
    the generator delays swap-outs past their layers, and every copy has completed by the op the policy
    placed its release at, so the executor's points must be the policy's exactly."""

    def __init__(self, capacity_bytes: int, planned_bytes_per_s: float) -> None:
        super().__init__(capacity_bytes)
        self._planned_bytes_per_s = planned_bytes_per_s

    @property
    def d2h_bytes_per_s(self) -> float:
        return self._planned_bytes_per_s

    @property
    def h2d_bytes_per_s(self) -> float:
        return self._planned_bytes_per_s


def _train(chameleon: Chameleon, steps: int, after_step=None):
    torch.manual_seed(0)
    model = chameleon.attach(make_lm(0, **MODEL))
    return train_next_token(chameleon, model, steps, MODEL["vocab"], BATCH, SEQ, after_step)


STEPS = 8


def _unswapped_peak_and_time() -> tuple[int, list, list, float]:
    probe = Chameleon({"enabled": False}, device=EmulatedDevice(10**11))
    losses, params = _train(probe, STEPS)
    return probe.last_report.peak_device_bytes, losses, params, probe.last_report.iteration_s


def test_delayed_swap_outs_are_issued_and_released_at_the_policys_ops():
    peak_bytes, reference_losses, reference_params, iteration_s = _unswapped_peak_and_time()
    # a link that moves about a fifth of the activations in one iteration: the producing layers' copy
    # time runs out and the generator places swap-outs in later layers
    device = _PlannedSlowDevice(int(peak_bytes * 0.97), planned_bytes_per_s=peak_bytes / iteration_s / 5)
    config = {"memory_budget": int(peak_bytes * 0.97), "min_swap_bytes": 4096,
              "profiler": {"warmup_iterations": 1, "policy_trials": 2}}
    chameleon = Chameleon(config, device=device)
    checked = []

    def check_placement(chameleon: Chameleon) -> None:
        """The iteration that just ran under a policy carried out its points exactly."""
        policy, report = chameleon.executor.policy, chameleon.last_report
        if policy is None:
            return
        swaps = [e for e in policy.entries if e.decision == Decision.SWAP]
        delayed = [e for e in swaps if e.swap_out_at + 1 > e.save_op_index]
        placed = chameleon.executor.counters.placed
        assert report.late_swap_outs == 0 and report.unmatched == 0 and report.oom_retries == 0
        outs = [(op, ordinal) for op, kind, ordinal in placed if kind == "out"]
        releases = [(op, ordinal) for op, kind, ordinal in placed if kind == "release"]
        # the entries whose save came (the matcher may pass over one: NOTE [Save-site matching])
        issued = {ordinal for _, ordinal in outs}
        assert len(issued) == len(outs) == len(swaps) - report.skipped_entries
        # issue order and points: the policy's swap-outs, each at the end of its placed op
        assert outs == sorted((e.swap_out_at + 1, e.save_ordinal) for e in swaps if e.save_ordinal in issued)
        # every release the policy placed, at its op (the copies were instant: none had to wait)
        assert releases == sorted(
            (e.release_at + 1, e.save_ordinal) for e in swaps if e.release_at >= 0 and e.save_ordinal in issued
        )
        assert report.delayed_swap_outs == sum(e.save_ordinal in issued for e in delayed)
        checked.append(report.delayed_swap_outs)

    losses, params = _train(chameleon, STEPS, check_placement)
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, reference_params, strict=True))
    assert checked and max(checked) > 0, "no policy delayed a swap-out: the test needs a slower planned link"


def _one_entry_policy(swap_out_at: int, release_at: int, swap_in_at: int, first_backward_use: int) -> Policy:
    """A policy for one saved float32[64, 64] storage, saved when 1 op had run (matched on its shape)."""
    entry = PolicyEntry(
        decision=Decision.SWAP, nbytes=64 * 64 * 4, micro_batch=0, layer=0, group=0, save_ordinal=0,
        layer_save_ordinal=0, save_op_index=1, calling_op="aten.exp.default", arg_position=-1, dtype="float32",
        shape=(64, 64), tensor_nbytes=64 * 64 * 4, swap_out_at=swap_out_at, last_forward_use=1,
        release_at=release_at, swap_in_at=swap_in_at, first_backward_use=first_backward_use,
    )
    return Policy(name="one", budget_bytes=1, feasible=True, predicted_peak_bytes=0, no_swap_peak_bytes=0,
                  predicted_stall_s=0.0, predicted_recompute_s=0.0, predicted_iteration_s=0.0, compute_s=0.0,
                  entries=[entry], layers=[], num_ops=30, trace_iteration=1, settings={},
                  save_keys=["float32[64, 64]"])


def _run_one(policy: Policy, ops_before_backward: int) -> SwapCounters:
    """Save one tensor at op 1, run the op clock to ``ops_before_backward``, then backward."""
    device = EmulatedDevice(10**9)
    executor = SwapExecutor(device, min_swap_bytes=0)
    clock = [1]
    context = IterationContext(policy=policy, op_clock=lambda: clock[0])
    x = torch.randn(64, 64, requires_grad=True)
    with device.active(), executor.active(context) as counters:
        y = (x * 2).exp()  # exp saves its output: the policy's save 0
        for op_count in range(2, ops_before_backward + 1):
            clock[0] = op_count
            if op_count >= executor.due_op:
                executor.on_op(op_count)
        y.sum().backward()
    assert torch.equal(x.grad, (x.detach() * 2).exp() * 2)
    return counters


def test_a_swap_out_is_issued_at_its_op_and_released_at_its_own():
    counters = _run_one(_one_entry_policy(swap_out_at=5, release_at=8, swap_in_at=20, first_backward_use=25), 12)
    assert [(op, kind) for op, kind, _ in counters.placed][:2] == [(6, "out"), (9, "release")]
    assert counters.delayed_swap_outs == 1 and counters.late_swap_outs == 0


def test_a_swap_out_whose_op_never_comes_is_issued_when_backward_begins():
    """The sequence moved: backward begins (op 4) before the swap-out's placed op (6) came in the
    forward pass. It is issued then, counted, and the gradient is right."""
    counters = _run_one(_one_entry_policy(swap_out_at=5, release_at=8, swap_in_at=20, first_backward_use=25), 4)
    assert counters.late_swap_outs == 1 and counters.swap_out_bytes == 64 * 64 * 4
