"""The swap entry's life is an explicit state (NOTE [Swap entry lifecycle] in executor/states.py): every move
the table allows works, every other one raises, and the executor's operations walk the expected states."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.executor import IterationContext, SwapExecutor
from chameleon_dist.executor.records import SwapEntry
from chameleon_dist.executor.states import EntryState, legal_transitions
from chameleon_dist.policy.model import Decision
from tests.by_hand import Producers, policy_by_hand

S = EntryState
COPIED_BACK = [S.HELD, S.COPYING, S.RELEASED, S.RESTORING, S.RESTORED]
REUSED_BACK = [S.HELD, S.COPYING, S.RELEASED, S.REUSED_AFTER_COPY]
SLOW_BYTES_PER_S = 2e6  # a 64 KiB storage takes ~30 ms over the emulated link


def _entry(device: EmulatedDevice, nbytes: int = 4096) -> tuple[SwapEntry, torch.Tensor]:
    tensor = device.track(torch.arange(nbytes // 4, dtype=torch.float32))
    return SwapEntry(device, tensor.untyped_storage(), tensor._version, position=0), tensor


# ---- the table --------------------------------------------------------------------------------
@pytest.mark.parametrize("source,target", list(itertools.product(EntryState, EntryState)),
                         ids=lambda s: s.name)
def test_the_table_allows_its_moves_and_raises_on_every_other(source, target):
    entry, _ = _entry(EmulatedDevice(10**9))
    entry._state = source  # (put there directly: each pair is checked on its own)
    if target in legal_transitions()[source]:
        entry._move(target)
        assert entry.state is target
    else:
        with pytest.raises(AssertionError, match=f"illegal transition {source.name} -> {target.name}"):
            entry._move(target)
        assert entry.state is source


def test_every_state_is_reachable_from_held_and_only_abandoned_is_final_for_good():
    table = legal_transitions()
    reached, frontier = {S.HELD}, [S.HELD]
    while frontier:
        for nxt in table[frontier.pop()] - reached:
            reached.add(nxt)
            frontier.append(nxt)
    assert reached == set(EntryState)
    assert all(S.ABANDONED in table[s] for s in EntryState if s is not S.ABANDONED)
    assert not table[S.ABANDONED]
    with pytest.raises(TypeError):
        table[S.HELD] = frozenset()  # read-only


def test_derived_flags_cannot_be_assigned_from_outside():
    entry, _ = _entry(EmulatedDevice(10**9))
    for name in ("state", "issued", "refused", "restored", "in_flight", "reused_source", "abandoned"):
        with pytest.raises(AttributeError):
            setattr(entry, name, True)


def test_only_records_writes_an_entrys_lifecycle_fields():
    """The state and the data the states own are written by ``SwapEntry``'s own methods alone."""
    owned = {"_state", "held", "to_host", "to_device", "device_bytes", "recipe"}
    package = Path(__file__).resolve().parents[1] / "chameleon_dist"
    offenders = []
    for path in package.rglob("*.py"):
        if path.relative_to(package).as_posix() == "executor/records.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and t.attr in owned:
                        offenders.append(f"{path.relative_to(package)}:{node.lineno} .{t.attr}")
    assert not offenders, offenders


# ---- the entry's own methods ------------------------------------------------------------------
def test_swap_out_release_swap_in_restore():
    device = EmulatedDevice(10**9)
    entry, tensor = _entry(device)
    expected = tensor.clone()
    assert entry.awaiting_swap_out and not entry.issued
    assert entry.issue() and entry.state is S.COPYING and entry.issued and entry.held is not None
    entry.release()
    assert entry.state is S.RELEASED and entry.held is None
    del tensor  # the program lets go; the device holds the original until a release orders it after the copy
    device.release_all_sources()  # ... so the bytes come back by a copy
    assert entry.start_swap_in() and entry.state is S.RESTORING and entry.in_flight
    assert not entry.start_swap_in()  # under way: no second copy
    restored = entry.finish_swap_in()
    assert entry.state is S.RESTORED and entry.restored and entry.issued and not entry.reused_source
    assert torch.equal(restored.view(torch.float32), expected)
    with pytest.raises(AssertionError):
        entry.release()  # only right after the issue


def test_a_live_original_is_reused_and_an_eviction_goes_back_to_the_host_copy():
    device = EmulatedDevice(10**9, h2d_bytes_per_s=SLOW_BYTES_PER_S, d2h_bytes_per_s=SLOW_BYTES_PER_S)
    entry, tensor = _entry(device, 2**16)
    entry.issue()
    entry.release()
    assert not entry.start_swap_in()  # the user still holds the original: it is the restored copy
    assert entry.state is S.REUSED_AFTER_COPY and entry.reused_source and entry.to_host is not None
    device.wait(entry.to_host)
    entry.evict()
    assert entry.state is S.RELEASED and entry.device_bytes is None
    del tensor
    device.synchronize()
    assert entry.start_swap_in() and entry.state is S.RESTORING  # the original is gone: copied in
    device.wait(entry.to_device)
    entry.evict()
    assert entry.state is S.RELEASED and entry.to_device is None and entry.to_host is not None
    entry.finish_swap_in()
    assert entry.state is S.RESTORED
    with pytest.raises(AssertionError):
        entry.evict()  # no host copy any more


def test_refused_recompute_and_abandon():
    device = EmulatedDevice(10**9, host_memory_budget_bytes=1024)
    entry, tensor = _entry(device)
    assert not entry.issue() and entry.state is S.REFUSED and entry.refused and entry.held is not None
    assert not entry.start_swap_in() and entry.state is S.REUSED_WITHOUT_COPY and not entry.issued

    entry, tensor = _entry(device)
    entry.recompute_later(recipe=object())
    assert entry.state is S.PENDING_RECOMPUTE and entry.held is None and not entry.restored
    entry.finish_rebuild(tensor.untyped_storage())
    assert entry.state is S.REBUILT and entry.recipe is None and entry.restored

    entry, _ = _entry(EmulatedDevice(10**9))
    entry.issue()
    entry.release()
    entry.abandon()
    entry.abandon()  # every saved tensor of the storage asks
    assert entry.state is S.ABANDONED and entry.to_host is None
    with pytest.raises(AssertionError):
        entry.issue()


# ---- the executor's operations ----------------------------------------------------------------
@pytest.fixture
def walks(monkeypatch):
    """Every entry's states, in order, as the executor moves it (entries kept alive: ids stay unique)."""
    recorded: dict[int, tuple[SwapEntry, list[EntryState]]] = {}
    move = SwapEntry._move

    def recording_move(self, to):
        walk = recorded.setdefault(id(self), (self, [self.state]))[1]
        move(self, to)
        walk.append(to)

    monkeypatch.setattr(SwapEntry, "_move", recording_move)
    return lambda: [walk for _, walk in recorded.values()]


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers)


BATCH = 256  # 64 KiB activations


def _input() -> torch.Tensor:
    return torch.linspace(-1, 1, BATCH * 64).reshape(BATCH, 64)


def _run(device, executor, model, context=None, inside=None, backward=True):
    """Forward and backward of the tiny model under the executor; the input's gradient."""
    device.track_module(model)
    executor.protect(model)
    x = device.track(_input()).requires_grad_()
    with device.active(), executor.active(context) as counters:
        loss = model(x).square().sum()
        if inside is not None:
            inside(loss)
        if backward:
            loss.backward()
    return x.grad, counters


def _reference_grad(model):
    x = _input().requires_grad_()
    model(x).square().sum().backward()
    grad = x.grad
    model.zero_grad(set_to_none=True)
    return grad


def test_swap_everything_walks_out_and_back(walks):
    model = _model()
    reference = _reference_grad(model)
    device = EmulatedDevice(10**9)
    grad, counters = _run(device, SwapExecutor(device, min_swap_bytes=0, prefetch_depth=2), model)
    assert torch.equal(grad, reference)
    assert counters.swapped_storages >= 4 and counters.prefetched > 0
    assert walks() and all(walk in (COPIED_BACK, REUSED_BACK) for walk in walks()), walks()
    assert COPIED_BACK in walks()


def test_pressure_gives_back_a_prefetch_in_flight_and_it_comes_back(walks):
    model = _model()
    reference = _reference_grad(model)
    # (an instant swap-out lets go of each original at once: every restore is a copy, over a slow link)
    device = EmulatedDevice(10**9, h2d_bytes_per_s=SLOW_BYTES_PER_S)
    executor = SwapExecutor(device, min_swap_bytes=0, prefetch_depth=2)
    evictions = []
    # once backward reaches the third tanh from the end, the unpacks before it started prefetches of earlier ones
    def relieve_when_its_gradient_comes(module, args, out):
        out.register_hook(lambda grad: evictions.append(executor.relieve_pressure(2**40)))

    model[-5].register_forward_hook(relieve_when_its_gradient_comes)
    grad, counters = _run(device, executor, model)
    assert torch.equal(grad, reference)
    assert evictions and counters.evicted_prefetches > 0
    evicted = [walk for walk in walks() if walk[3:6] == [S.RESTORING, S.RELEASED, S.RESTORING]]
    assert evicted and all(walk == COPIED_BACK[:4] + [S.RELEASED] + COPIED_BACK[3:] for walk in evicted), walks()
    assert all(walk in (COPIED_BACK, evicted[0]) for walk in walks()), walks()


def test_a_retry_abandons_the_failed_attempts_entries(walks):
    model = _model()
    device = EmulatedDevice(10**9)
    executor = SwapExecutor(device, min_swap_bytes=0)

    def retry(loss):
        executor.new_attempt()
        with pytest.raises(RuntimeError, match="retried"):
            loss.backward()

    _run(device, executor, model, inside=retry, backward=False)
    assert walks() and all(walk == [S.HELD, S.COPYING, S.RELEASED, S.ABANDONED] for walk in walks()), walks()


def test_a_full_host_budget_refuses_and_keeps(walks):
    model = _model()
    reference = _reference_grad(model)
    device = EmulatedDevice(10**9, host_memory_budget_bytes=1024)
    grad, counters = _run(device, SwapExecutor(device, min_swap_bytes=0), model)
    assert torch.equal(grad, reference)
    assert counters.kept_on_device_bytes > 0 and counters.swapped_storages == 0
    assert walks() and all(walk == [S.HELD, S.REFUSED] for walk in walks()), walks()


def test_passive_swap_takes_kept_tensors_out_and_back(walks):
    model = _model()
    reference = _reference_grad(model)
    device = EmulatedDevice(10**9)
    executor = SwapExecutor(device, min_swap_bytes=0)
    relieved = []
    policy = policy_by_hand([], "none")  # matches nothing: every saved tensor is kept, a passive swap may take it
    grad, counters = _run(device, executor, model, IterationContext(policy=policy),
                          inside=lambda loss: relieved.append(executor.relieve_pressure(32 * 64 * 4)))
    assert torch.equal(grad, reference)
    assert relieved[0] > 0 and counters.passive_swaps > 0
    assert walks() and all(walk in (COPIED_BACK, REUSED_BACK) for walk in walks()), walks()


def _chain(device, executor, context, hold=False):
    """exp saves its output h (the first saved storage), gelu saves h again, sin saves y = gelu(h) (the
    second); ``hold``: the caller holds h and y, else only the graph does."""
    x = device.track(torch.linspace(-2, 2, 64 * 64).reshape(64, 64)).requires_grad_()
    with device.active(), executor.active(context), Producers(executor):
        if hold:
            h = x.exp()
            y = torch.nn.functional.gelu(h)
            y.sin().sum().backward()
        else:
            torch.nn.functional.gelu(x.exp()).sin().sum().backward()
    return x.grad


def test_recompute_and_a_restore_before_the_swap_out_op(walks):
    x = torch.linspace(-2, 2, 64 * 64).reshape(64, 64).requires_grad_()
    torch.nn.functional.gelu(x.exp()).sin().sum().backward()
    device = EmulatedDevice(10**9)
    key = "float32[64, 64]"

    recompute = policy_by_hand([Decision.SWAP, Decision.RECOMPUTE], key)
    assert torch.equal(_chain(device, SwapExecutor(device, min_swap_bytes=0), IterationContext(policy=recompute)), x.grad)
    assert [S.HELD, S.PENDING_RECOMPUTE, S.REBUILT] in walks(), walks()
    assert len(walks()) == 2 and (COPIED_BACK in walks() or REUSED_BACK in walks()), walks()  # h: swapped

    # held by the caller: both originals are still there when backward needs them
    before = len(walks())
    executor = SwapExecutor(device, min_swap_bytes=0)
    assert torch.equal(_chain(device, executor, IterationContext(policy=recompute), hold=True), x.grad)
    assert sorted(map(str, walks()[before:])) == sorted(map(str, [REUSED_BACK, [S.HELD, S.PENDING_RECOMPUTE,
                                                                                  S.REUSED_WITHOUT_COPY]]))

    # a swap-out placed after backward began (its op never comes): the held original is the restored copy
    late = policy_by_hand([Decision.SWAP, None], key, swap_out_at=10**6)
    executor = SwapExecutor(device, min_swap_bytes=0)
    before = len(walks())
    assert torch.equal(_chain(device, executor, IterationContext(policy=late, op_clock=lambda: 0)), x.grad)
    assert walks()[before:] == [[S.HELD, S.REUSED_WITHOUT_COPY]], walks()
