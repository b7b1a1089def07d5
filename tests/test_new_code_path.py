"""Routing variance and a new code path told apart (issue 37 item 3; NOTE [A new code path] in
profiler/signature.py). A branch that switches on extra blocks (about 10% more ops, about 20% more saved bytes:
what the routing rule alone reads as ``rescaled``) is a new program: ``changed``, and the runtime profiles again.
The same code whose expert ops move in count and size (routing) stays ``rescaled``/``rerouted`` and Stable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.profiler.signature import ChangeKind, Signature, compare

WIDTH, DEPTH, BATCH = 32, 10, 16
STEPS, SWITCH_AT = 20, 12  # the branch is on from iteration SWITCH_AT + 1 on


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class WideBlock(nn.Module):
    """A block of another kind: its ops follow each other in ways the model's own blocks never do."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Branching(nn.Module):
    """``DEPTH`` blocks at ``layers.<i>``; with ``extra_on``, extra blocks run after them: as more layers of the
    same kind (``layers.<DEPTH + i>``, wider) or as blocks of another kind outside the layers (``extra.<i>``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [Block(WIDTH, WIDTH) for _ in range(DEPTH)]
        self.extra_on = False
        if kind == "layers":
            self.first_extra = DEPTH
            blocks.append(Block(WIDTH, 3 * WIDTH))
            self.extra = nn.ModuleList()
        else:
            self.first_extra = None
            self.extra = nn.ModuleList([WideBlock(WIDTH, 3 * WIDTH)])
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.layers):
            if index != self.first_extra or self.extra_on:
                x = block(x)
        if self.extra_on:
            for block in self.extra:
                x = block(x)
        return x.square().mean()


def _train(chameleon: Chameleon | None, kind: str):
    model = Branching(kind)
    if chameleon is not None:
        model = chameleon.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, reports = [], []
    for step in range(STEPS):
        model.extra_on = step >= SWITCH_AT
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))

        def closure():
            loss = model(x)
            loss.backward()
            return loss.detach()

        if chameleon is None:
            losses.append(closure())
            optimizer.step()
        else:
            losses.append(chameleon.run_iteration(closure, optimizer=optimizer))
            reports.append(chameleon.last_report)
        optimizer.zero_grad(set_to_none=True)
    return losses, reports


@pytest.mark.parametrize("kind", ["layers", "other_blocks"])
def test_a_branch_that_switches_on_extra_blocks_is_a_new_program(kind):
    reference_losses, _ = _train(None, kind)
    chameleon = Chameleon({"min_swap_bytes": 1024, "profiler": {"warmup_iterations": 1, "policy_trials": 2}},
                          device=EmulatedDevice(10**9))
    losses, reports = _train(chameleon, kind)
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses, strict=True))
    before, event = reports[SWITCH_AT - 1], reports[SWITCH_AT]
    assert before.stage == "stable"
    # what the routing rule alone reads as other sizes: a tenth more ops, a fifth more saved bytes
    assert 0.05 <= event.sequence_length_change <= 0.15 and 0.15 <= event.saved_bytes_change <= 0.3, (
        event.sequence_length_change, event.saved_bytes_change)
    assert event.sequence_change_kind == "changed" and event.sequence_changed, event.stage_transition
    # more layers of the same kind: a layer that never saved; blocks of another kind: op pairs never seen
    signal = f"layers [{DEPTH}] saved" if kind == "layers" else "follow each other in ways the reference never had"
    assert "a new code path" in event.stage_transition and signal in event.stage_transition, event.stage_transition
    assert reports[SWITCH_AT + 1].stage == "warmup"  # profiled again, then Stable on the new program
    assert [r.stage for r in reports[-3:]] == ["stable"] * 3


def _routed(expert_calls: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
    """A synthetic MoE sequence: per layer a router (ops 1, 2), then each expert that got tokens (ops 3, 4, 5 on
    ``tokens`` bytes each), then a combine (op 6); the backward mirrors it. ``expert_calls[l]``: experts run."""
    forward, saved = [], []
    for layer, calls in enumerate(expert_calls):
        forward += [1, 2]
        saved.append(4096)
        for expert in range(calls):
            forward += [3, 4, 5]
            saved += [tokens[layer] * 64, tokens[layer] * 256]
        forward.append(6)
    backward = [10 + op for op in reversed(forward)]
    return forward + [7] + backward, saved


def test_routing_variance_only_changes_counts_of_pairs_that_exist():
    reference = Signature.of(*_routed([4, 4, 4, 4], [32, 32, 32, 32]), saved_layers=range(4))
    # a longer batch routed to fewer experts: +30% saved bytes, fewer expert ops
    ids, saved = _routed([4, 3, 4, 4], [48, 48, 48, 48])
    comparison = compare(Signature.of(ids, saved, range(4)), reference, 0.05, 0.95)
    assert comparison.kind in (ChangeKind.RESCALED, ChangeKind.REROUTED), comparison.reason
    assert comparison.novel_pair_share < 0.01 and comparison.novel_layers == ()
    # the same routing with a new stretch in the last layer (a branch: ops 20-22 twice, larger saves): ~10% more
    # ops and ~25% more saved bytes (under ROUTING_SHARE: as a new length routed otherwise could move them), but
    # its pairs were never there
    ids, saved = _routed([4, 4, 4, 4], [32, 32, 32, 32])
    combine = len(ids) // 2 - 1  # (the last layer's combine, before the loss)
    branch = [20, 21, 22] * 2
    ids = ids[:combine] + branch + ids[combine:combine + 2] + [10 + op for op in reversed(branch)] + ids[combine + 2:]
    saved = saved + [22 * 1024] * 2
    changed = compare(Signature.of(ids, saved, range(4)), reference, 0.05, 0.95)
    assert 0.05 <= changed.length_change <= 0.15 and 0.15 <= changed.saved_bytes_change <= 0.3, changed.reason
    assert changed.kind == ChangeKind.CHANGED and "new code path" in changed.reason, changed.reason


def test_a_layer_that_never_saved_is_a_new_code_path_only_with_a_large_difference():
    ids, saved = _routed([4, 4, 4, 4], [32, 32, 32, 32])
    reference = Signature.of(ids, saved, saved_layers=range(4))
    grown = Signature.of(*_routed([4, 4, 4, 4, 1], [32, 32, 32, 32, 80]), saved_layers=range(5))
    assert compare(grown, reference, 0.05, 0.95).novel_layers == (4,)
    assert compare(grown, reference, 0.05, 0.95).kind == ChangeKind.CHANGED
    # a layer that saved one more small tensor (under 5% in ops and bytes): absorbed, whatever its layer
    nudged = Signature.of(ids, saved + [64], saved_layers=range(5))
    assert compare(nudged, reference, 0.05, 0.95).kind == ChangeKind.ABSORBED
