"""``sequence_changed`` is the paper's test (the one that can re-plan); ``sequence_differs`` is any difference.

A monitoring loop reads ``last_report.sequence_changed``: it must not say "changed" in every iteration of
a job whose sequence only wobbles (an MoE expert that gets no token skips its bookkeeping ops) while
nothing is re-planned. A real change (the layers run twice) is ``sequence_changed``.
"""

import logging

import pytest
import torch
from torch import nn

from chameleon_dist import Chameleon, EmulatedDevice
from chameleon_dist.trace.stages import Stage

from tests.scenario_models import one_thread

HIDDEN, EXPERTS, LAYERS = 16, 4, 6


class RoutedMLP(nn.Module):
    """Dense layers and a top-1 router; ``repeat`` runs the layers that many times (a real change)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(LAYERS))
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.repeat = 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(self.repeat):
            for layer in self.layers:
                x = layer(x)
        return x.square().mean(), self.router(x).argmax(-1)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _iteration(model: RoutedMLP, x: torch.Tensor, empty_expert: int | None) -> None:
    loss, route = model(x)
    loss.backward()
    if empty_expert is not None:
        route = route.masked_fill(route == empty_expert, (empty_expert + 1) % EXPERTS)
    # per-expert load bookkeeping, only for the experts that received tokens: a few ops come and go
    for expert in range(EXPERTS):
        taken = route == expert
        if bool(taken.any()):
            taken.float().mean()


def test_a_wobbling_sequence_differs_but_is_not_changed_and_a_real_change_is(caplog):
    caplog.set_level(logging.INFO, logger="chameleon_dist.profiler")
    torch.manual_seed(0)
    model = RoutedMLP()
    runtime = Chameleon({"min_swap_bytes": 0}, device=EmulatedDevice(capacity_bytes=10**9, host_op_s=1e-6))
    runtime.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, HIDDEN)
    reports, logged = [], []
    for i in range(1, 16):
        caplog.clear()
        model.repeat = 2 if i == 14 else 1
        empty = (i % EXPERTS) if i >= 9 else None  # from iteration 9 on, one expert gets no token
        runtime.run_iteration(lambda: _iteration(model, x, empty), optimizer=optimizer)
        optimizer.zero_grad(set_to_none=True)
        reports.append(runtime.last_report)
        # (a rank's log prefix may stand before the message when another test left its RankLogPrefix installed)
        logged.append([r.getMessage() for r in caplog.records if "operator sequence:" in r.getMessage()])
    wobbling = reports[8:13]  # iterations 9-13
    assert all(r.stage == Stage.STABLE for r in wobbling)
    assert all(r.sequence_differs for r in wobbling), [r.num_ops for r in reports]
    assert not any(r.sequence_changed for r in wobbling), [r.stage_transition for r in wobbling]
    assert all(r.stage_transition is None for r in wobbling), "nothing is re-planned"
    assert logged[8:13] == [[]] * 5, "the profiler does not log an absorbed difference as a change"
    doubled = reports[13]  # iteration 14: the layers run twice
    assert doubled.sequence_differs and doubled.sequence_changed and doubled.to_dict()["sequence_change_major"]
    assert doubled.stage_transition.startswith("stable -> warmup: operator sequence changed")
    assert len(logged[13]) == 1 and "profiler.cosine_threshold" in logged[13][0], "the log names the setting"
    assert [r.to_dict()["sequence_change_major"] for r in reports] == [r.sequence_changed for r in reports], (
        "the older name (a deprecated JSON key) agrees")


class SkippingSGD(torch.optim.SGD):
    """An SGD whose step runs with gradients enabled (as DeepSpeed's ZeRO step does) and does its work only on
    some iterations (a step skipped on an fp16 overflow): many ops come and go."""

    def __init__(self, params, skip_at: set[int]) -> None:
        super().__init__(params, lr=0.01)
        self.skip_at, self.calls = skip_at, 0

    def step(self, closure=None):
        self.calls += 1
        with torch.enable_grad():
            if self.calls in self.skip_at:
                return None
            for group in self.param_groups:
                for p in (p for p in group["params"] if p.grad is not None):
                    norm = p.grad.detach().float().norm()  # an unscale / overflow check of its own
                    p.grad.detach().div_(torch.clamp(norm, min=1.0)).mul_(torch.clamp(norm, min=1.0))
        return super().step(closure)


def test_a_skipped_optimizer_step_is_not_another_program():
    """The optimizer step's ops are not the model's, whatever its grad mode: skipping the step changes only ops
    outside the model's program (absorbed), so nothing is re-planned (before: "changed", back to WarmUp)."""
    torch.manual_seed(0)
    model = RoutedMLP()
    runtime = Chameleon({"min_swap_bytes": 0}, device=EmulatedDevice(capacity_bytes=10**9, host_op_s=1e-6))
    runtime.attach(model)
    optimizer = SkippingSGD(model.parameters(), skip_at={4, 9, 10})
    x = torch.randn(32, HIDDEN)
    reports = []
    for _ in range(12):
        runtime.run_iteration(lambda: _iteration(model, x, None), optimizer=optimizer)
        optimizer.zero_grad(set_to_none=True)
        reports.append(runtime.last_report)
    kinds = [r.sequence_change_kind for r in reports]
    # a skipped step leaves only ~ops (outside the model) different: absorbed, never a change to re-plan for
    assert kinds[1:] == ["absorbed" if i in optimizer.skip_at else "identical" for i in range(2, 13)], \
        [r.stage_transition for r in reports]
    assert reports[-1].stage == Stage.STABLE and all(r.stage_transition is None for r in reports[8:])
