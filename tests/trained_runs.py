"""What the single-rank training tests record of a run (``Trained``), the loop that records it (``train``), and
how they compare two runs: the stage letters of its reports and bit-identity of every loss, gradient and final
parameter."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.nn import functional as F

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice

from tests.scenario_models import bits_equal


@dataclasses.dataclass
class Trained:
    losses: list[torch.Tensor]
    grads: list[list[torch.Tensor | None]]
    parameters: list[torch.Tensor]
    reports: list


ForwardBackward = Callable[[torch.Tensor], torch.Tensor]  # one iteration's batch -> its detached loss, after backward


def next_token_step(model: torch.nn.Module) -> ForwardBackward:
    """Forward and backward of a model that maps tokens to logits, on next-token cross entropy."""

    def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    return forward_backward


def train(make: Callable[[], tuple[torch.nn.Module, ForwardBackward]], batch: Callable[[int], torch.Tensor],
          config: dict, device: EmulatedDevice, iterations: int) -> Trained:
    """``iterations`` SGD steps of the model ``make`` builds (seeded 0) under ``Chameleon(config, device)``, on
    ``batch(i)`` in iteration ``i`` (from 1), recording every loss, gradient and report."""
    torch.manual_seed(0)
    model, forward_backward = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    chameleon = Chameleon(config, device=device)
    chameleon.attach(model)
    trained = Trained([], [], [], [])
    for i in range(1, iterations + 1):
        tokens = batch(i)
        optimizer.zero_grad(set_to_none=True)
        trained.losses.append(chameleon.run_iteration(lambda: forward_backward(tokens), optimizer=optimizer))
        trained.grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        trained.reports.append(chameleon.last_report)
    trained.parameters = [p.detach().clone() for p in model.parameters()]
    return trained


def stages(trained: Trained) -> str:
    """One letter per iteration: W(armUp), G(enPolicy), S(table)."""
    return "".join({"warmup": "W", "gen_policy": "G", "stable": "S"}[r.stage] for r in trained.reports)


def assert_bit_identical(swapped: Trained, plain: Trained) -> None:
    for i, (a, b) in enumerate(zip(swapped.losses, plain.losses), start=1):
        assert bits_equal(a, b), f"loss of iteration {i} differs"
    for i, (ga, gb) in enumerate(zip(swapped.grads, plain.grads), start=1):
        assert all(bits_equal(x, y) for x, y in zip(ga, gb)), f"a gradient of iteration {i} differs"
    assert all(bits_equal(x, y) for x, y in zip(swapped.parameters, plain.parameters))
