"""Chameleon's own work never reads as a program change (issue 37 item 3): the ops it issues inside an observed
iteration (the gradient snapshot's copies, swap-outs and swap-ins, prefetches, releases, recompute replays,
relief and passive swaps) stay out of the signature, so a static model stays Stable whatever Chameleon does,
and the signature of each iteration is the one a run that swaps nothing records. Runs on a device that lags
its host (the host queues far ahead, as on a GPU), where the snapshot's zero check has not landed when
backward reaches the first gradient and every gradient is copied.

NOTE [Chameleon's own ops are never the program's] in profiler/scope.py."""

from __future__ import annotations

import threading

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.profiler.scope import TrainingScope
from launch.models.swiglu_lm import SwiGLULM

WIDTH, DEPTH, BATCH = 128, 6, 64
STEPS = 24
VOCAB, HIDDEN, LAYERS, SEQ = 64, 64, 3, 64


def _lagging_device(capacity_bytes: int = 10**10, **figures) -> EmulatedDevice:
    """A slow device and a fast host (tests/test_gpu_semantics.py): the host queues kernels far ahead."""
    settings = dict(peak_flop_per_s=2e9, memory_bytes_per_s=2e9, launch_latency_s=1e-6, host_op_s=1e-8,
                    h2d_bytes_per_s=2e10, d2h_bytes_per_s=2e10)
    settings.update(figures)
    return EmulatedDevice(capacity_bytes, **settings)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())
                                 for _ in range(DEPTH)])


def _batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))


def _record_signatures(chameleon: Chameleon) -> list[list[int]]:
    """Every iteration's signature ids, as the profiler concludes them."""
    seen: list[list[int]] = []
    conclude = chameleon.profiler.conclude

    def recording(observation, saved_bytes, verdict, **kwargs):
        seen.append(list(observation.ids))
        return conclude(observation, saved_bytes, verdict, **kwargs)

    chameleon.profiler.conclude = recording
    return seen


def _train_mlp(chameleon: Chameleon | None, set_to_none: bool, steps: int = STEPS):
    model = _mlp()
    if chameleon is not None:
        model = chameleon.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, reports = [], []
    for step in range(steps):
        x = _batch(step)

        def closure():
            loss = model(x).square().mean()
            loss.backward()
            return loss.detach()

        if chameleon is None:
            losses.append(closure())
            optimizer.step()
        else:
            losses.append(chameleon.run_iteration(closure, optimizer=optimizer))
            reports.append(chameleon.last_report)
        optimizer.zero_grad(set_to_none=set_to_none)
    return losses, [p.detach().clone() for p in model.parameters()], reports


@pytest.fixture(scope="module")
def unswapped_peak_bytes() -> int:
    chameleon = Chameleon({"enabled": False}, device=_lagging_device())
    _train_mlp(chameleon, set_to_none=True, steps=2)
    return chameleon.last_report.peak_device_bytes


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_static_mlp_stays_stable_whatever_the_gradient_snapshot_copies(set_to_none, unswapped_peak_bytes):
    reference_losses, reference_params, _ = _train_mlp(None, set_to_none)
    chameleon = Chameleon({"memory_budget": int(unswapped_peak_bytes * 0.85), "min_swap_bytes": 4096},
                          device=_lagging_device())
    losses, params, reports = _train_mlp(chameleon, set_to_none)
    stages = "".join(r.stage[0].upper() for r in reports)
    first_stable = stages.index("S")
    # WarmUp, GenPolicy, then Stable for good: the snapshot's copies (made whenever its zero check had not
    # landed) must never read as a new operator sequence
    assert stages[first_stable:] == "S" * (STEPS - first_stable), stages
    assert STEPS - first_stable >= 15, stages
    stable = reports[first_stable:]
    assert [r.sequence_change_kind for r in stable] == ["identical"] * len(stable), \
        [(r.num_ops, r.sequence_change_kind) for r in stable]
    assert any(r.swap_out_bytes for r in stable)  # the policy swaps: Chameleon works inside these iterations
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, reference_params, strict=True))


def _train_lm(chameleon: Chameleon, set_to_none: bool, steps: int):
    torch.manual_seed(0)
    model = chameleon.attach(SwiGLULM(VOCAB, HIDDEN, LAYERS))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, reports = [], []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(step))

        def closure():
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            return loss.detach()

        losses.append(chameleon.run_iteration(closure, optimizer=optimizer))
        reports.append(chameleon.last_report)
        optimizer.zero_grad(set_to_none=set_to_none)
    return losses, reports


# (capacity and budget as shares of the unswapped peak; what Chameleon does there differs by setting)
_SMALL_DEVICES = {False: (0.55, 0.5, ("swap_out_bytes", "recomputed_bytes", "passive_swaps", "evicted_prefetches",
                                     "oom_retries")),
                  True: (0.6, 0.55, ("swap_out_bytes", "evicted_prefetches", "oom_retries"))}


@pytest.mark.parametrize("set_to_none", [False, pytest.param(True, marks=pytest.mark.slow)])  # (True: 3.6 s, not quick)
def test_every_iteration_records_the_signature_a_run_that_swaps_nothing_records(set_to_none):
    """The same model with hooks that keep everything on the device, and on a small device with a slow link,
    where Chameleon swaps, recomputes, relieves and retries: the two record the same ops in every iteration."""
    steps = 12
    keeping = Chameleon({"min_swap_bytes": 10**12}, device=_lagging_device())
    kept_ids = _record_signatures(keeping)
    kept_losses, _ = _train_lm(keeping, set_to_none, steps)
    peak_bytes, iteration_s = keeping.last_report.peak_device_bytes, keeping.last_report.iteration_s
    rate = peak_bytes / iteration_s / 40  # (tests/test_recompute.py: a link far too slow to swap it all)
    capacity_share, budget_share, figures = _SMALL_DEVICES[set_to_none]
    working = Chameleon({"memory_budget": int(peak_bytes * budget_share), "min_swap_bytes": 4096,
                         "profiler": {"warmup_iterations": 1, "policy_trials": 3}},
                        device=_lagging_device(int(peak_bytes * capacity_share), h2d_bytes_per_s=rate,
                                               d2h_bytes_per_s=rate))
    worked_ids = _record_signatures(working)
    losses, reports = _train_lm(working, set_to_none, steps)
    assert all(torch.equal(a, b) for a, b in zip(losses, kept_losses, strict=True))
    # Chameleon's work inside these iterations: swaps, recompute replays, relief (passive swaps, prefetches given
    # back) and out-of-memory retries (the gradient snapshot's restore)
    for figure in figures:
        assert any(getattr(r, figure) for r in reports), figure
    differing = [i + 1 for i, (a, b) in enumerate(zip(worked_ids, kept_ids, strict=True)) if a != b]
    assert differing == [], (differing, [len(a) - len(b) for a, b in zip(worked_ids, kept_ids)])


def test_quiet_hides_only_the_thread_that_runs_chameleon_s_own_ops():
    """A joined worker's model ops are the program's while the training thread runs a hook (and the reverse)."""
    scope = TrainingScope()
    seen: list[bool] = []
    inside, release = threading.Event(), threading.Event()

    def worker() -> None:
        inside.wait()
        seen.append(scope.paused)
        release.set()

    thread = threading.Thread(target=worker)
    thread.start()
    with scope.quiet():
        with scope.quiet():
            assert scope.paused
        assert scope.paused
        inside.set()
        release.wait()
    thread.join()
    assert seen == [False] and not scope.paused
