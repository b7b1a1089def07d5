"""The main job's training runs: a Megatron-core GPT on the emulated device, with and without Chameleon."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, ValidationError

from chameleon_dist.cli.timeline import ModelOpTimeline, sampling
from chameleon_dist.config import ChameleonConfig, ConfigError, DeviceConfig
from chameleon_dist.config.shipped import DEFAULT_JOB
from chameleon_dist.device import EmulatedDevice, EmulatedOutOfMemoryError
from chameleon_dist.device.factory import UNBOUNDED_CAPACITY_BYTES, make_device
from chameleon_dist.device.model import DeviceModel
from chameleon_dist.integrations.megatron.gpt import build_gpt, gpt_loss, megatron_cpu_session, synthetic_batch
from chameleon_dist.models import TransformerShape
from chameleon_dist.trace.stages import Stage
from chameleon_dist.report import IterationReport
from chameleon_dist.runtime import Chameleon

logger = logging.getLogger(__name__)

# The WarmUp curve of the run with Chameleon: iteration 1 also creates Adam's state (more ops), so the
# first iteration with the same ops as every later one is 2, a WarmUp iteration with the default settings.
WARMUP_TIMELINE_ITERATION = 2


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    iterations: PositiveInt = 30
    micro_batches: PositiveInt = 1
    lr: PositiveFloat = 1e-3
    seed: int = 1234
    # the iteration plotted in memory.png; None: the first Stable one (under the chosen policy with Chameleon)
    timeline_iteration: PositiveInt | None = None


class TrainJob(BaseModel):
    """A ``chameleon-train`` job file: the model, the loop, and the ``chameleon`` block."""

    model_config = ConfigDict(extra="forbid")

    model: TransformerShape
    train: TrainSettings = TrainSettings()
    chameleon: ChameleonConfig


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError([f"{path}: no such job file (pass --config PATH to a YAML job file)"])
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: a job file is a mapping with model, train and chameleon sections"])
    return data


def load_job(path: Path | None = None, overrides: dict | None = None) -> TrainJob:
    """The default job, with ``path`` (a YAML job file) and ``overrides`` merged over it."""
    data = _read_yaml(DEFAULT_JOB)
    if path is not None:
        data = _merge(data, _read_yaml(Path(path)))
    data = _merge(data, overrides or {})
    try:
        return TrainJob.model_validate(data)
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, source=str(path or DEFAULT_JOB), model=TrainJob) from None


@dataclasses.dataclass
class OutOfMemory:
    iteration: int
    op_name: str
    op_index: int
    requested_bytes: int
    live_bytes: int
    capacity_bytes: int


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Live device bytes after every op of the model in one iteration (``cli.timeline``)."""

    iteration: int
    stage: str
    policy: str  # "" = no policy (WarmUp swaps every eligible tensor; without Chameleon nothing)
    samples_bytes: list[int]

    @property
    def peak_bytes(self) -> int:
        return max(self.samples_bytes, default=0)


@dataclasses.dataclass
class RunResult:
    label: str
    losses: list[torch.Tensor]
    reports: list[IterationReport]
    out_of_memory: OutOfMemory | None
    final_parameters: list[torch.Tensor]
    wall_s: float
    timeline: Timeline | None = None  # the plotted iteration (``TrainSettings.timeline_iteration``)
    warmup_timeline: Timeline | None = None  # with Chameleon: iteration 2 when it runs in WarmUp

    @property
    def completed(self) -> int:
        return len(self.losses)

    def peak_bytes(self) -> int:
        return max((r.peak_device_bytes for r in self.reports), default=0)

    def mean(self, field: str) -> float:
        return sum(getattr(r, field) for r in self.reports) / max(len(self.reports), 1)


ProgressFn = Callable[[RunResult, IterationReport, torch.Tensor], None]


def unconstrained_device(config: ChameleonConfig | None = None) -> EmulatedDevice:
    """The emulated device ``config.device`` describes (the same simulated GPU: preset, rates, host cost), of
    unbounded capacity: the reference run's times are comparable with the constrained run's."""
    model = DeviceModel.from_config(config.device if config is not None else DeviceConfig())
    return EmulatedDevice(capacity_bytes=UNBOUNDED_CAPACITY_BYTES, model=model)


def for_unconstrained_device(config: ChameleonConfig) -> ChameleonConfig:
    """``config`` without the constrained device's capacity (``Chameleon`` refuses a config whose device
    settings differ from the device it is given); the rest of the device section stays."""
    return config.model_copy(update={"device": config.device.model_copy(update={"capacity": None})})


def constrained_device(config: ChameleonConfig) -> EmulatedDevice:
    """The emulated device ``config.device`` describes (capacity, link, preset, host budget), made by
    ``make_device``; the main job always runs emulated, so ``device.kind`` is taken as "emulated"."""
    if config.device.capacity is None:
        raise ConfigError(["chameleon.device.capacity: the main job needs an emulated capacity (e.g. \"96MiB\")"])
    emulated = config.device.model_copy(update={"kind": "emulated"})
    device = make_device(config.model_copy(update={"device": emulated}))
    assert isinstance(device, EmulatedDevice)
    return device


def train(job: TrainJob, label: str, config: ChameleonConfig, device: EmulatedDevice, progress: ProgressFn | None = None) -> RunResult:
    """Train ``job.train.iterations`` iterations in a fresh Megatron CPU session; stop at an OOM.

    Each run gets its own session so that framework buffers (Megatron's global memory buffer) are made,
    and metered, inside the run that uses them."""
    with megatron_cpu_session(seed=job.train.seed):
        return _train(job, label, config, device, progress)


def _train(job: TrainJob, label: str, config: ChameleonConfig, device: EmulatedDevice, progress: ProgressFn | None) -> RunResult:
    settings = job.train
    model = build_gpt(job.model, seed=settings.seed)
    chameleon = Chameleon(config, device=device)
    chameleon.attach(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    result = RunResult(label, [], [], None, [], 0.0)
    start_s = time.perf_counter()
    for iteration in range(1, settings.iterations + 1):
        host_batches = [  # made on the host, then copied to the device inside the iteration (metered)
            synthetic_batch(job.model, (iteration - 1) * settings.micro_batches + micro, settings.seed)
            for micro in range(settings.micro_batches)
        ]

        def closure() -> torch.Tensor:
            total = torch.zeros(())
            for host_batch in host_batches:
                batch = {name: tensor.clone() for name, tensor in host_batch.items()}
                loss = gpt_loss(model, batch) / settings.micro_batches
                loss.backward()
                total += loss.detach()
            return total

        stage = chameleon.stage  # the stage this iteration runs in
        plotted = result.timeline is None and _may_plot(settings, iteration, stage)
        warmup_curve = config.enabled and iteration == WARMUP_TIMELINE_ITERATION and stage == Stage.WARMUP
        timeline = ModelOpTimeline(device.live_bytes, chameleon.profiler.scope) if plotted or warmup_curve else None
        try:
            if timeline is not None:
                with sampling(timeline, closure, optimizer) as (sampled_closure, sampled_optimizer):
                    loss = chameleon.run_iteration(sampled_closure, optimizer=sampled_optimizer)
            else:
                loss = chameleon.run_iteration(closure, optimizer=optimizer)
        except EmulatedOutOfMemoryError as exc:
            result.out_of_memory = OutOfMemory(
                iteration, exc.op_name, exc.op_index, exc.requested_bytes, exc.live_bytes, exc.capacity_bytes
            )
            break
        finally:
            optimizer.zero_grad(set_to_none=True)
        report = chameleon.last_report
        result.losses.append(loss)
        result.reports.append(report)
        if timeline is not None:
            curve = Timeline(iteration, report.stage, report.policy, list(timeline.samples_bytes))
            if warmup_curve:
                result.warmup_timeline = curve
            if plotted and _plot_this(settings, iteration, report, config.enabled):
                result.timeline = curve
        if progress is not None:
            progress(result, chameleon.last_report, loss)
    result.wall_s = time.perf_counter() - start_s
    result.final_parameters = [p.detach().clone() for p in model.parameters()]
    return result


def _may_plot(settings: TrainSettings, iteration: int, stage: str) -> bool:
    """Whether to sample this iteration for the plot (``_plot_this`` decides after it ran)."""
    if settings.timeline_iteration is not None:
        return iteration == settings.timeline_iteration
    return stage == Stage.STABLE or iteration == settings.iterations  # the last one if none is Stable


def _plot_this(settings: TrainSettings, iteration: int, report: IterationReport, enabled: bool) -> bool:
    """The first Stable iteration (with Chameleon: under a chosen policy), the asked one, or the last."""
    if settings.timeline_iteration is not None or iteration == settings.iterations:
        return True
    return report.stage == Stage.STABLE and (bool(report.policy) or not enabled)


@dataclasses.dataclass(frozen=True)
class Parity:
    losses_equal: int
    losses_compared: int
    parameters_equal: int
    parameters_compared: int

    @property
    def bit_identical(self) -> bool:
        return (
            self.losses_compared > 0
            and self.losses_equal == self.losses_compared
            and self.parameters_equal == self.parameters_compared
        )


def compare(reference: RunResult, candidate: RunResult) -> Parity:
    """torch.equal on every loss and on every final parameter (which integrate every gradient)."""
    pairs = list(zip(reference.losses, candidate.losses))
    params = list(zip(reference.final_parameters, candidate.final_parameters))
    complete = candidate.completed == reference.completed
    return Parity(
        losses_equal=sum(torch.equal(a, b) for a, b in pairs),
        losses_compared=len(pairs),
        parameters_equal=sum(torch.equal(a, b) for a, b in params) if complete else 0,
        parameters_compared=len(params),
    )


def job_summary(job: TrainJob) -> dict[str, Any]:
    return job.model_dump(mode="json")
