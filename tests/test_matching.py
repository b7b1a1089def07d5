"""Finding policy entries for saved tensors without stable identities (executor/matching.py)."""

import functools

import pytest
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


def _policy(saved_shapes, swapped, sites=None):
    """``saved_shapes``: the traced iteration's saves by ordinal; ``swapped``: ordinals the policy swaps;
    ``sites``: their save sites (None: a policy written before sites existed)."""
    entries = [_entry(k, saved_shapes[k], 10 * (k + 1)) for k in swapped]
    return Policy("p", 10**9, True, 0, 0, 0.0, 0.0, 0.0, 0.0, entries, [], 200, 1, {},
                  save_keys=[save_key("float32", shape) for shape in saved_shapes], save_sites=sites or [])


SHAPES = [(4, 8), (4, 8), (16, 8), (4, 8), (2, 2)]
SITES = ["0:0:aten.mm.default:float32:2", "0:0:aten.gelu.default:float32:2", "0:0:aten.mm.default:float32:2",
         "0:1:aten.mm.default:float32:2", "0:1:aten.sum.default:float32:2"]


def _saves(matcher, saves):
    """The ordinal of the entry each (site, shape) save gets, or None."""
    found = [matcher.match(torch.zeros(shape), site) for site, shape in saves]
    return [e.save_ordinal if e else None for e in found]


def test_an_aligned_sequence_matches_exactly_and_keeps_what_the_policy_keeps():
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[1, 2], sites=SITES))
    assert _saves(matcher, zip(SITES, SHAPES)) == [None, 1, 2, None, None]
    assert (matcher.counts.exact, matcher.counts.fuzzy, matcher.counts.unmatched, matcher.counts.skipped) == (2, 0, 0, 0)
    matcher.reset()  # the next iteration (or retry) starts at the first save again
    assert _saves(matcher, zip(SITES, SHAPES)) == [None, 1, 2, None, None]


def test_other_shapes_at_the_same_sites_match_scaled():
    """A longer sequence or another batch size: the same sites, other shapes."""
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[1, 2], sites=SITES))
    longer = [(8, 8), (8, 8), (32, 8), (8, 8), (2, 2)]
    assert _saves(matcher, zip(SITES, longer)) == [None, 1, 2, None, None]
    assert (matcher.counts.exact, matcher.counts.fuzzy) == (0, 2)


def test_a_save_the_iteration_does_not_make_skips_its_entry():
    """An expert that got no token: its saves are missing, and what follows still matches."""
    expert = ["0:1:aten.index.Tensor:float32:2", "0:1:aten.mm.default:float32:2", "0:1:aten.gelu.default:float32:2"]
    sites = ["0:0:aten.mm.default:float32:2"] + expert * 3 + ["0:1:aten.index_add.default:float32:2"]
    shapes = [(4, 8)] * len(sites)
    matcher = PolicyMatcher(_policy(shapes, swapped=list(range(1, len(sites))), sites=sites))
    # experts 0 and 2 ran; expert 1 got no token
    run = [sites[0]] + expert + expert + [sites[-1]]
    found = _saves(matcher, [(site, (3, 8)) for site in run])
    # expert 2's saves take expert 1's entries (the same sites); expert 2's own entries are passed over
    # at the index_add, which matches its own entry
    assert found == [None, 1, 2, 3, 4, 5, 6, 10]
    assert matcher.counts.skipped == 3 and matcher.counts.unmatched == 0


def test_an_inserted_save_stays_on_the_device_and_the_rest_still_matches():
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[1, 2, 3], sites=SITES))
    run = list(zip(SITES, SHAPES))
    run.insert(2, ("0:0:aten.tanh.default:float32:2", (4, 8)))  # one extra op saved something
    assert _saves(matcher, run) == [None, 1, None, 2, 3, None]
    assert matcher.counts.unmatched == 1 and matcher.counts.skipped == 0


def test_each_policy_save_matches_once():
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[0, 2], sites=SITES))
    mm = "0:0:aten.mm.default:float32:2"
    assert _saves(matcher, [(mm, (4, 8)), (mm, (4, 8)), (mm, (4, 8))]) == [0, 2, None]
    assert matcher.counts.unmatched == 1


def test_other_micro_batch_layer_dtype_or_rank_is_another_site():
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[0], sites=SITES))
    for site in ("1:0:aten.mm.default:float32:2", "0:3:aten.mm.default:float32:2",
                 "0:0:aten.mm.default:float64:2", "0:0:aten.mm.default:float32:3"):
        assert matcher.match(torch.zeros(4, 8), site) is None
    assert matcher.counts.unmatched == 4


def test_the_search_stops_at_the_window():
    sites = ["0:0:aten.add.Tensor:float32:2"] * 10 + ["0:0:aten.mm.default:float32:2"]
    matcher = PolicyMatcher(_policy([(4, 8)] * 11, swapped=[10], sites=sites), window=5)
    assert matcher.match(torch.zeros(4, 8), sites[-1]) is None
    wide = PolicyMatcher(_policy([(4, 8)] * 11, swapped=[10], sites=sites), window=10)
    assert wide.match(torch.zeros(4, 8), sites[-1]).save_ordinal == 10


def test_a_policy_without_sites_matches_on_shapes_alone():
    """Policy files written before sites existed: only the traced shapes match, in order."""
    matcher = PolicyMatcher(_policy(SHAPES, swapped=[1, 2]))
    assert not matcher.by_site
    assert _saves(matcher, [("", shape) for shape in SHAPES]) == [None, 1, 2, None, None]
    other = PolicyMatcher(_policy(SHAPES, swapped=[2]))
    assert other.match(torch.zeros(16, 9), "") is None and other.counts.unmatched == 1


@pytest.mark.slow  # (out of the quick tier: 13 s loaded)
def test_sites_name_micro_batch_and_layer_and_an_unchanged_iteration_matches_exactly():
    """Through the runtime: the trace's sites (recorded by the executor) are the ones it meets again."""
    from chameleon_dist import Chameleon
    from chameleon_dist.device.emulated import EmulatedDevice
    from launch.models.toy_gpt import GPT

    tokens = torch.randint(0, 64, (2, 4, 33), generator=torch.Generator().manual_seed(0))

    def train(config, capacity_bytes, iterations):
        torch.manual_seed(0)
        model = GPT(64, 32, 4, 2)
        chameleon = Chameleon(config, device=EmulatedDevice(capacity_bytes, host_op_s=1e-6))  # (trials rank alike)
        chameleon.attach(model)

        def two_micro_batches():
            for batch in tokens:
                model(batch[:, :-1]).sum().backward()

        for _ in range(iterations):
            chameleon.run_iteration(two_micro_batches)
        return chameleon

    peak = train({"enabled": False}, 2**40, 1).last_report.peak_device_bytes
    chameleon = train({"min_swap_bytes": 1024}, int(0.75 * peak), 8)
    report, policy = chameleon.last_report, chameleon.controller.chosen
    assert report.stage == "stable" and policy is not None and policy.save_sites
    micro_batches = {site.split(":")[0] for site in policy.save_sites}
    layers = {site.split(":")[1] for site in policy.save_sites}
    assert micro_batches == {"0", "1"} and {"0", "1"} <= layers
    assert report.matched_exact > 0 and report.matched_fuzzy == report.unmatched == report.skipped_entries == 0


class _ScaledLayer(torch.nn.Module):
    """``(x @ w) * x.mean(-1)``: the multiplication saves a small tensor and a large one at the same site (the
    same op before them, dtype and dimensions), the small one first."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.proj(x) * x.mean(-1, keepdim=True)


def test_saves_too_small_to_swap_keep_the_walk_aligned():
    """A save under ``min_swap_bytes`` is never swapped, but it took a save ordinal in the trace: the executor
    must walk past it too. When it did not, the large save after it at the same site took the small one's
    ordinal (kept), and its own entry was passed over (``skipped_entries``) at the next site."""
    from chameleon_dist import Chameleon
    from chameleon_dist.device.emulated import EmulatedDevice

    hidden = 64
    batches = torch.randn(10, 4, 32, hidden, generator=torch.Generator().manual_seed(0))

    def train(config, capacity_bytes):
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.layers = torch.nn.ModuleList(_ScaledLayer(hidden) for _ in range(6))
        model.forward = lambda x: functools.reduce(lambda h, layer: layer(h), model.layers, x)
        chameleon = Chameleon(config, device=EmulatedDevice(capacity_bytes, host_op_s=1e-6))  # (trials rank alike)
        chameleon.attach(model)
        losses, reports = [], []
        for batch in batches:
            losses.append(chameleon.run_iteration(lambda: _backward(model(batch).square().mean())))
            reports.append(chameleon.last_report)
        return losses, [p.grad for p in model.parameters()], reports

    reference, grads, probe = train({"enabled": False}, 2**40)
    losses, swapped_grads, reports = train({"min_swap_bytes": 1024}, int(0.7 * probe[0].peak_device_bytes))
    assert all(torch.equal(a, b) for a, b in zip(reference, losses)) and all(
        torch.equal(a, b) for a, b in zip(grads, swapped_grads))
    stable = [r for r in reports if r.stage == "stable"]
    assert stable and all(r.swap_out_bytes > 0 for r in stable)
    assert all(r.skipped_entries == r.unmatched == 0 for r in stable), [(r.skipped_entries, r.unmatched) for r in stable]


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def _expert_sites(expert: int) -> list[str]:
    return [f"0:1.e{expert}:aten.index.Tensor:float32:2", f"0:1.e{expert}:aten.mm.default:float32:2",
            f"0:1.e{expert}:aten.gelu.default:float32:2"]


def test_an_experts_saves_match_its_own_entries_whatever_the_others_did():
    """Issue 27, item 4: with the expert in the site (experts that are modules of their own), expert 2's saves
    take expert 2's entries when expert 1 got no token, not expert 1's (before: the same sites for all)."""
    sites = ["0:0:aten.mm.default:float32:2"] + _expert_sites(0) + _expert_sites(1) + _expert_sites(2)
    shapes = [(4, 8)] * len(sites)
    matcher = PolicyMatcher(_policy(shapes, swapped=[2, 5, 8, 9], sites=sites))  # each expert's mm, expert 2's gelu too
    run = [sites[0]] + _expert_sites(0) + _expert_sites(2)
    assert _saves(matcher, [(site, (3, 8)) for site in run]) == [None, None, 2, None, None, 8, 9]
    assert matcher.counts.unmatched == 0 and matcher.counts.skipped == 1  # expert 1's entry passed over


def test_an_expert_idle_in_the_traced_iteration_gets_the_decision_its_siblings_got():
    """Issue 27, item 4: expert 3 had no token when the policy was traced, so the policy has none of its saves;
    now it runs, and its saves take the entries of its siblings' saves at the same sites (where at least half
    of the siblings have one), instead of staying on the device."""
    sites = ["0:0:aten.mm.default:float32:2"] + _expert_sites(0) + _expert_sites(1) + _expert_sites(2)
    shapes = [(4, 8)] * len(sites)
    # every expert's mm swapped; only expert 0's gelu (1 of 3 siblings: not the siblings' decision)
    matcher = PolicyMatcher(_policy(shapes, swapped=[2, 3, 5, 8], sites=sites))
    run = [sites[0]] + _expert_sites(0) + _expert_sites(3)
    assert _saves(matcher, [(site, (3, 8)) for site in run]) == [None, None, 2, 3, None, 2, None]
    assert matcher.counts.unmatched == 2 and matcher.counts.fuzzy == 3  # expert 3's index and gelu stay
    matcher.reset()
    assert _saves(matcher, [(site, (3, 8)) for site in run]) == [None, None, 2, 3, None, 2, None]
    # outside an expert nothing is borrowed: an unknown site stays on the device
    assert matcher.match(torch.zeros(3, 8), "0:2:aten.mm.default:float32:2") is None


def test_the_layer_clock_names_the_expert_running_inside_a_layer():
    from torch import nn

    from chameleon_dist.profiler.scope import LayerClock

    clock, seen = LayerClock(), []

    class Expert(nn.Module):
        def forward(self, x):
            seen.append(clock.site)
            return x

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(3))

        def forward(self, x):
            seen.append(clock.site)
            for k in (2, 0):  # expert 1 got no token
                x = self.experts[k](x)
            seen.append(clock.site)
            return x

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(MoE())])
    clock.watch(model)
    model.layers[0](torch.zeros(1))
    assert seen == ["0", "0.e2", "0.e0", "0"] and clock.site == "-1"
