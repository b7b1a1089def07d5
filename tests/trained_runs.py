"""What the single-rank training tests record of a run (``Trained``) and how they compare two runs: the stage
letters of its reports and bit-identity of every loss, gradient and final parameter."""

from __future__ import annotations

import dataclasses

import torch

from tests.scenario_models import bits_equal


@dataclasses.dataclass
class Trained:
    losses: list[torch.Tensor]
    grads: list[list[torch.Tensor | None]]
    parameters: list[torch.Tensor]
    reports: list


def stages(trained: Trained) -> str:
    """One letter per iteration: W(armUp), G(enPolicy), S(table)."""
    return "".join({"warmup": "W", "gen_policy": "G", "stable": "S"}[r.stage] for r in trained.reports)


def assert_bit_identical(swapped: Trained, plain: Trained) -> None:
    for i, (a, b) in enumerate(zip(swapped.losses, plain.losses), start=1):
        assert bits_equal(a, b), f"loss of iteration {i} differs"
    for i, (ga, gb) in enumerate(zip(swapped.grads, plain.grads), start=1):
        assert all(bits_equal(x, y) for x, y in zip(ga, gb)), f"a gradient of iteration {i} differs"
    assert all(bits_equal(x, y) for x, y in zip(swapped.parameters, plain.parameters))
