"""Dynamic MoE at half the unswapped peak (issue 27, items 2, 5 and 6): models whose routing, or routing and
length, change every iteration stay in Stable without leaning on passive swap.

Three cases (items 5 and 6; item 4: an expert's saves matched by expert, its siblings' decisions when it was
idle in the traced iteration), each trained 24 iterations (``mixtral_eager`` 16: warm-up 2, trials 5 and 9 Stable,
its iterations the costliest) with and without Chameleon on a device half the size of the unswapped
peak (the maximum over the plain run's iterations):

- ``mixtral_eager``: a tiny random ``transformers`` Mixtral (4 layers, 32 experts, top-2, no cache) with the
  eager expert loop: an expert that gets no token does not run, so the ops change with the routing;
- ``mixtral_grouped``: the same model with the ``grouped_mm`` experts: one op for all experts, whose saved
  sizes per expert change with the routing (the ops do not);
- ``top1_lengths``: a top-1 MoE of our own (``launch/models/toy_gpt.py``, idle experts skipped) whose sequence
  length cycles 32/48/64: the ops and the saved bytes move together every iteration.

Targets (the issue's): at least 80% of the iterations after the first Stable one are Stable, at most one
passive swap per Stable iteration on average, no out-of-memory retry, every loss and gradient ``torch.equal``
to the plain run's. The device model is fixed (h100-pcie figures, 20 us of host time per op, a 1 GB/s link
each way except where a case says), so the figures repeat on any machine. The ``transformers`` cases skip without the ``hf`` extra.

``python -m tests.test_dynamic_moe`` prints each case's stages, passive swaps and retries.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

from chameleon_dist.device.emulated import EmulatedDevice
from launch.bench import bench_dynamic
from launch.models.toy_gpt import GPT
from tests.scenario_models import one_thread
from tests.trained_runs import ForwardBackward, Trained, assert_bit_identical, next_token_step, stages, train

ITERATIONS = 24
VOCAB = 128
LINK_BYTES_PER_S = 1e9
UNBOUNDED_BYTES = 2**40
MIN_STABLE_SHARE = 0.8  # of the iterations from the first Stable one on
LENGTHS = (32, 48, 64)


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], tuple[torch.nn.Module, ForwardBackward]]
    shape: Callable[[int], tuple[int, int]]  # iteration -> (batch, length)
    link_bytes_per_s: float | None = LINK_BYTES_PER_S  # each way; None: the preset's own (h100-pcie)
    expert_modules: bool = False  # each expert a module of its own: its saves are matched by expert (item 4)
    iterations: int = ITERATIONS


def _mixtral(experts_implementation: str) -> Callable[[], tuple[torch.nn.Module, ForwardBackward]]:
    def make() -> tuple[torch.nn.Module, ForwardBackward]:
        transformers = pytest.importorskip("transformers")
        config = bench_dynamic.mixtral_config(transformers, bench_dynamic.MIXTRAL, VOCAB, 256, experts_implementation)
        model = transformers.MixtralForCausalLM(config).train()

        def forward_backward(tokens: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1], use_cache=False)
            out.loss.backward()
            return out.loss.detach()

        return model, forward_backward

    return make


def _top1_moe() -> tuple[torch.nn.Module, ForwardBackward]:
    model = GPT(VOCAB, 32, 4, 4, experts=16, top_k=1, skip_idle_experts=True)
    return model, next_token_step(model)


CASES = {
    # (16 iterations: at 24 it ran WWGGGGG + 17 x S, no passive swap, its routing moving from iteration 2 on)
    "mixtral_eager": Case(_mixtral("eager"), lambda i: (8, 128), iterations=16),
    # (on a 1 GB/s link no policy is predicted to fit it, so its trials lean on passive swap, and one of them
    # can run out of memory, depending on the allocation order: measured 0 or 1 retry in 24 iterations)
    "mixtral_grouped": Case(_mixtral("grouped_mm"), lambda i: (8, 128), link_bytes_per_s=None),
    "top1_lengths": Case(_top1_moe, lambda i: (8, LENGTHS[(i - 1) % len(LENGTHS)]), expert_modules=True),
}


def _train(case: Case, config: dict, capacity_bytes: int) -> Trained:
    def tokens(i: int) -> torch.Tensor:
        batch, length = case.shape(i)
        return torch.randint(0, VOCAB, (batch, length + 1), generator=torch.Generator().manual_seed(1000 + i))

    link = {} if case.link_bytes_per_s is None else {"h2d_bytes_per_s": case.link_bytes_per_s,
                                                     "d2h_bytes_per_s": case.link_bytes_per_s}
    device = EmulatedDevice(capacity_bytes, preset="h100-pcie", host_op_s=2e-5, **link)
    return train(case.make, tokens, config, device, case.iterations)


def _run_at_half_capacity(name: str) -> tuple[Trained, Trained, int]:
    case = CASES[name]
    plain = _train(case, {"enabled": False}, UNBOUNDED_BYTES)
    capacity = max(r.peak_device_bytes for r in plain.reports) // 2
    return _train(case, {"min_swap_bytes": 1024}, capacity), plain, capacity


def _summary(name: str, swapped: Trained, capacity: int) -> str:
    reports = swapped.reports
    return (f"{name}: {stages(swapped)} | capacity {capacity} | passive swaps {[r.passive_swaps for r in reports]} | "
            f"oom retries {sum(r.oom_retries for r in reports)} | kinds {sorted({r.sequence_change_kind for r in reports})} "
            f"| transitions {[(r.iteration, r.transition.reason) for r in reports if r.transition is not None]}")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


QUICK_CASE = "top1_lengths"
"""The case the quick tier runs (no transformers, the cheapest: 14 s loaded; the Mixtral cases are slow)."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == QUICK_CASE else pytest.mark.slow) for n in CASES])
def test_moe_whose_routing_changes_every_iteration_stays_stable_at_half_capacity(name):
    swapped, plain, capacity = _run_at_half_capacity(name)
    summary = _summary(name, swapped, capacity)
    assert_bit_identical(swapped, plain)
    reports = swapped.reports
    # the routing really moved: iterations differ from the reference sequence (other ops, other saved sizes)
    if name != "mixtral_grouped":  # (one op for all experts: the routing moves sizes inside it, not the signature)
        assert sum(r.sequence_differs for r in reports[1:]) >= len(reports) // 2, summary
    letters = stages(swapped)
    first = letters.find("S")
    assert first >= 0, summary
    after = letters[first:]
    assert after.count("S") >= MIN_STABLE_SHARE * len(after), summary
    stable = [r for r in reports if r.stage == "stable"]
    assert sum(r.passive_swaps for r in stable) <= len(stable), summary
    assert all(r.oom_retries == 0 for r in reports), summary
    assert sum(r.swap_out_bytes for r in stable) > 0, summary  # Stable swaps: the capacity needs it
    if CASES[name].expert_modules:
        # every save found its entry (or its siblings'): an expert idle when the policy was traced is covered
        # too (before item 4: 9 saves left on the device in some Stable iterations)
        assert all(r.unmatched == 0 for r in stable), [r.unmatched for r in stable]


if __name__ == "__main__":
    with one_thread():
        for case_name in CASES:
            run, _, device_capacity = _run_at_half_capacity(case_name)
            print(_summary(case_name, run, device_capacity))
