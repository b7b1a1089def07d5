"""The executor carries out the swap-outs, releases and swap-ins at the ops the policy placed them (NOTE
[Placed swaps] in executor/swap.py), not at the save or the unpack."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.policy.model import Decision
from tests.models import make_lm

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


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, MODEL["vocab"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))


def _train(chameleon: Chameleon, steps: int, after_step=None):
    torch.manual_seed(0)
    model = chameleon.attach(make_lm(0, **MODEL))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens = _tokens(step)

        def closure():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            return loss.detach()

        losses.append(chameleon.run_iteration(closure, optimizer=optimizer))
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(chameleon)
    return losses, [p.detach().clone() for p in model.parameters()]


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
