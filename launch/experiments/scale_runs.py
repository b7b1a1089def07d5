"""One variant of ``launch/experiments/bench_scale.py``: a Megatron-core GPT on meta tensors, driven by Megatron's own schedule,
on the emulated device (``meta_tensors=True``) with or without Chameleon, and what its iterations measured.

Every figure is simulated: the device clock's roofline times for the preset, memory metered from sizes (NOTE [Meta
tensors] in ``chameleon_dist/device/simulated/backend.py``). The host's time is a fixed cost per op
(``HOST_OP_S``), so runs repeat exactly. What a rank holds: the stage's bf16 parameters and the gradients backward
makes (``.grad``, dropped before each iteration, as ``zero_grad`` would); no optimizer state (a data-parallel rank
with Megatron's distributed optimizer holds a 1/DP share of it) and no DDP gradient buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from chameleon_dist.device import EmulatedDevice
from chameleon_dist.planner import load_model
from launch.experiments.op_times import profile_iteration
from launch.experiments.scale_bound import SavedBytesByLayer

logger = logging.getLogger(__name__)

HOST_OP_S = 1e-5
"""Host seconds per op: what a GPU host spends to launch one (5-20 us); fixed so that runs repeat exactly."""

UNBOUNDED_BYTES = 1 << 62

VARIANTS = ("reference", "chameleon-swap", "chameleon-swap-recompute", "megatron-selective", "megatron-full",
            "megatron-selective+chameleon", "megatron-full+chameleon")
_SETTINGS = {  # variant -> (Megatron's recomputation, Chameleon on, Chameleon may recompute)
    "reference": (None, False, False),
    "chameleon-swap": (None, True, False),
    "chameleon-swap-recompute": (None, True, True),
    "megatron-selective": ("selective", False, False),
    "megatron-full": ("full", False, False),
    "megatron-selective+chameleon": ("selective", True, True),
    "megatron-full+chameleon": ("full", True, True),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """A model of the benchmark: a profile of ``configs/models/`` and the layers one device holds."""

    name: str
    profile: str
    num_layers: int | None  # None: all of the profile's
    pre_process: bool = True  # with the embedding
    post_process: bool = True  # with the final norm and the output layer

    def describe(self, seq_length: int) -> str:
        layers = "all layers" if self.num_layers is None else f"{self.num_layers} layers"
        parts = [layers] + (["embedding"] if self.pre_process else []) + (["head"] if self.post_process else [])
        return f"{self.profile} ({', '.join(parts)}), seq {seq_length}"


CASES = {
    "llama2-7b": Case("llama2-7b", "llama2-7b", None),
    "llama2-70b-stage": Case("llama2-70b-stage", "llama2-70b", 10, pre_process=True, post_process=False),
    "mixtral-8x7b-stage": Case("mixtral-8x7b-stage", "mixtral-8x7b", 4, pre_process=True, post_process=False),
}


@dataclasses.dataclass
class VariantRun:
    """What one variant's last iteration measured (simulated)."""

    variant: str
    budget_bytes: int  # the device's memory for this run (the reference and Megatron alone: unbounded)
    iteration_s: float = 0.0
    peak_bytes: int = 0
    stall_s: float = 0.0
    swap_out_bytes: int = 0
    recomputed_bytes: int = 0
    saved_bytes: int = 0  # what autograd saved (the last detailed trace; the reference: counted by its hooks)
    model_state_bytes: int = 0  # parameters on the device at the start
    stages: str = ""  # one letter per iteration: W(armUp), G(enPolicy), S(table), M(easured only)
    oom_retries: int = 0
    figure_lag: int = 0  # iterations the reported time lags the last one (IterationReport.iteration_s_lag)
    passive_swaps: int = 0
    error: str = ""
    wall_s: float = 0.0
    trace: Any = None  # the last detailed StepTrace (not serialised)
    saved_segments: list | None = None  # the reference: SavedBytesByLayer.segments of its last iteration

    @property
    def completed(self) -> bool:
        return not self.error


def settings_of(variant: str) -> tuple[str | None, bool, bool]:
    if variant not in _SETTINGS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return _SETTINGS[variant]


def _build(case: Case, seq_length: int, micro_batch_size: int = 1, recompute: str | None = None):
    from chameleon_dist.integrations.megatron import build_meta_gpt

    return build_meta_gpt(load_model(case.profile), num_layers=case.num_layers, pre_process=case.pre_process,
                          post_process=case.post_process, seq_length=seq_length, micro_batch_size=micro_batch_size,
                          recompute=recompute)


def model_state_bytes(case: Case, seq_length: int) -> int:
    """What the device holds whatever the policy: the stage's parameters and their gradients (same dtype)."""
    model = _build(case, seq_length)
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters())


def schedule_step(integration, model, device, *, micro_batches: int, seq_length: int, micro_batch_size: int = 1):
    """One iteration's closure: Megatron's schedule over ``micro_batches`` meta micro-batches, followed by
    ``integration``'s micro-batch tracker (a ``MegatronChameleon``'s), ending with the host waiting for ``device`` once
    (a training loop's ``loss.item()``: without it the host runs iterations ahead of the device, and a Stable
    report shows an older iteration's time, NOTE [Stable iterations never wait for their own figures])."""
    from chameleon_dist.integrations.megatron import meta_schedule_step
    from megatron.core.pipeline_parallel import get_forward_backward_func

    schedule = get_forward_backward_func()

    def step():
        integration.tracker.begin()
        try:
            return meta_schedule_step(model, micro_batches=micro_batches, seq_length=seq_length,
                                      micro_batch_size=micro_batch_size, forward_backward_func=schedule)
        finally:
            integration.tracker.end()
            device.backend.synchronize()

    return step


def run_variant(case: Case, variant: str, budget_bytes: int | None, *, preset: str, seq_length: int,
                micro_batches: int, micro_batch_size: int = 1, max_iterations: int = 14, stable_iterations: int = 2,
                min_swap_bytes: int = 1 << 20) -> VariantRun:
    """Run ``variant`` of ``case`` on a device of ``budget_bytes`` (None: unbounded) until ``stable_iterations``
    Stable iterations (Chameleon) or 2 measured ones (alone), at most ``max_iterations``. Inside a
    ``megatron_meta_session``."""
    from chameleon_dist.integrations.megatron.install import install

    recompute, chameleon_on, may_recompute = settings_of(variant)
    capacity_bytes = UNBOUNDED_BYTES if budget_bytes is None or not chameleon_on else int(budget_bytes)
    run = VariantRun(variant, capacity_bytes)
    started_s = time.perf_counter()
    model = _build(case, seq_length, micro_batch_size, recompute)
    device = EmulatedDevice(capacity_bytes, preset=preset, host_op_s=HOST_OP_S, meta_tensors=True)
    config: dict[str, Any] = {"enabled": chameleon_on, "min_swap_bytes": min_swap_bytes,
                              "executor": {"allow_recompute": may_recompute}}
    if chameleon_on:
        config["memory_budget"] = capacity_bytes
    integration = install(model, config, device=device)
    runtime = integration.runtime
    run.model_state_bytes = device.live_bytes()
    step = schedule_step(integration, model, device, micro_batches=micro_batches, seq_length=seq_length,
                         micro_batch_size=micro_batch_size)
    wanted = stable_iterations if chameleon_on else 2
    done = 0
    try:
        for _ in range(max_iterations):
            for parameter in model.parameters():
                parameter.grad = None
            counting = SavedBytesByLayer(model, list(model.decoder.layers)) if variant == "reference" \
                else contextlib.nullcontext()
            try:
                with counting:
                    runtime.run_iteration(step)
            except torch.OutOfMemoryError as error:
                run.error = str(error).splitlines()[0]
                run.stages += "X"
                break
            report = runtime.last_report
            run.error = ""
            run.stages += {"warmup": "W", "gen_policy": "G", "stable": "S"}.get(report.stage, "?") if chameleon_on \
                else "M"
            # (a Stable iteration reports the newest iteration the device had finished when it ended: with the
            # host waiting once per step that is the previous one, NOTE [Stable iterations never wait for their
            # own figures]; so only the second Stable iteration's figure is a Stable iteration's own)
            run.iteration_s, run.peak_bytes, run.stall_s = report.iteration_s, report.peak_device_bytes, report.stall_s
            run.figure_lag = report.iteration_s_lag
            run.swap_out_bytes, run.recomputed_bytes = report.swaps.swap_out_bytes, report.swaps.recomputed_bytes
            run.oom_retries += report.oom_retries
            run.passive_swaps = report.swaps.passive_swaps
            if runtime.last_trace is not None:
                run.trace = runtime.last_trace
            if isinstance(counting, SavedBytesByLayer):
                run.saved_segments = counting.segments
            if not chameleon_on or report.stage == "stable":
                done += 1
                if done >= wanted:
                    break
    finally:
        integration.close()
    run.saved_bytes = (0 if run.trace is None else run.trace.saved_bytes()) if run.saved_segments is None else \
        sum(nbytes for segment in run.saved_segments for _, nbytes in segment)
    run.wall_s = time.perf_counter() - started_s
    logger.info("%s %s: %s, %.1f ms, peak %.2f GiB, %.1f s", case.name, variant, run.stages, run.iteration_s * 1e3,
                run.peak_bytes / 2**30, run.wall_s)
    return run


def profiled_iteration(case: Case, *, preset: str, seq_length: int, micro_batches: int, micro_batch_size: int = 1):
    """``(trace, op_times_s)`` of one profiled iteration of ``case`` through Megatron's schedule on an unbounded
    device, nothing swapped and nothing recomputed: each trace op's kernel seconds on the device clock
    (``launch.experiments.op_times.profile_iteration``). Inside a ``megatron_meta_session``."""
    from chameleon_dist.integrations.megatron.install import install

    model = _build(case, seq_length, micro_batch_size)
    device = EmulatedDevice(UNBOUNDED_BYTES, preset=preset, host_op_s=HOST_OP_S, meta_tensors=True)
    integration = install(model, {"min_swap_bytes": 1 << 60}, device=device)  # profiled, nothing swapped
    step = schedule_step(integration, model, device, micro_batches=micro_batches, seq_length=seq_length,
                         micro_batch_size=micro_batch_size)
    try:
        return profile_iteration(integration.runtime, step)
    finally:
        integration.close()
