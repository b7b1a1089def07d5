"""The per-rank ``Chameleon`` runtime: it sequences the device, the profiler, the policy controller and the
swap executor through each training iteration, and decides nothing itself (policies are chosen in
``policy/selection.py``, what an out-of-memory retry changes too). It holds the one retry loop
(``retry_out_of_memory``) that ``run_iteration`` and the integrations' replays run; the integrations hold a
``Chameleon`` and use only its public methods.

Usage from a plain PyTorch loop::

    chameleon = Chameleon(config)              # a ChameleonConfig, a dict, a YAML/JSON path, or None
    model = chameleon.attach(model)
    for batch in data:
        loss = chameleon.run_iteration(lambda: train_step(model, batch), optimizer=optimizer)
        report = chameleon.last_report  # an IterationReport
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import time
import traceback
import types
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from chameleon_dist.config import ChameleonConfig, ConfigError, load_config
from chameleon_dist.config.budgets import ResolvedBudgets, read_node, resolve_budgets
from chameleon_dist.config.checks import model_fit_problem, runtime_problems
from chameleon_dist.device.base import Device, module_device_bytes
from chameleon_dist.device.factory import make_device
from chameleon_dist.device.iteration_times import IterationTimes
from chameleon_dist.executor import IterationContext, SwapCounters, SwapExecutor
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.ranking import TrialRanking
from chameleon_dist.policy.selection import IterationOutcome, PolicyController
from chameleon_dist.profiler.online import Observation, OnlineProfiler
from chameleon_dist.ranks import RankCoordinates
from chameleon_dist.report import IterationReport
from chameleon_dist.retry_buffers import BufferSnapshot
from chameleon_dist.retry import GradientSnapshot, RandomState, final_out_of_memory, optimizer_state_guard
from chameleon_dist.trace.stages import RetryCause, Stage
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

T = TypeVar("T")

UNKNOWN_LINK_BYTES_PER_S = 25e9
"""Link bandwidth the policy generator assumes when neither the device nor the config gives one."""

INSTANT_LINK_BYTES_PER_S = 1e15
"""What the policy generator is told for an emulated link without a bandwidth (copies are instant)."""


@dataclasses.dataclass
class _Running:
    """The iteration in progress: what it started with, and what its attempts did so far."""

    stage: Stage
    policy: Policy | None
    start_s: float  # host clock, for a failed iteration's report
    timer: Any  # the device's timer: the iteration's time is device time (``iteration_start``)
    iteration_start: Any
    stall_start_s: float  # the device's stall counter when the iteration began
    attempt_stall_start_s: float  # ... when the current attempt began (after an out-of-memory retry)
    observation: Observation | None = None
    counters: SwapCounters = dataclasses.field(default_factory=SwapCounters)
    oom_retries: int = 0


def drop_failed_frames(exc: BaseException) -> None:
    """Let go of what the failed attempt's frames hold (its loss, activations, autograd graph). An error
    raised inside backward can stay referenced from C++ after the ``except`` block, out of the garbage
    collector's sight, and its frames with it: on the MoE case of launch/bench_dynamic.py they kept
    0.6 MB of the failed attempt's activations through the retry. (The executor lets go of the saved
    tensors themselves: ``SwapExecutor.new_attempt``.)"""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _planning_rate(device_bytes_per_s: float | None, configured_bytes_per_s: float | None) -> float:
    """The link rate the policy generator plans with: the device's (``Device.d2h_bytes_per_s``; an
    instant link is a very fast one), else the configured one, else an assumption."""
    if device_bytes_per_s is None:
        return float(configured_bytes_per_s or UNKNOWN_LINK_BYTES_PER_S)
    return INSTANT_LINK_BYTES_PER_S if math.isinf(device_bytes_per_s) else float(device_bytes_per_s)


class Chameleon:
    """Swaps a training job's saved activations to host memory and back, one rank at a time.

    Each iteration the profiler takes the operator sequence's signature (and, in WarmUp, a detailed
    trace), the policy controller says which swap policy applies, and the executor carries it out through
    saved-tensor hooks, overlapping copies with compute. When the sequence changes or a policy stops
    holding the memory budget, the runtime profiles again and finds a new policy (the paper's stages
    WarmUp -> GenPolicy -> Stable). Losses and gradients stay bit-identical to a run without it.

    Args:
        config: a ``ChameleonConfig``, a dict, a YAML/JSON path, or None for the defaults. With
            ``enabled: false`` the runtime only measures (reports, traces) and swaps nothing.
        device: the device to meter and swap on; default: made from ``config.device`` (the emulated
            device on a machine without CUDA). A device passed without a host budget takes
            ``config.host_memory_budget``.
        coordinates: the rank's place in a distributed job, shown in every report (``rank``); the engine
            integrations read it from the process groups. None: a job of one rank.

    Raises:
        ConfigError: when the config cannot be meant as written (a budget above the capacity, a host
            budget above RAM, a device that contradicts ``config.device``), naming every setting to change.

    Example::

        chameleon = Chameleon({"memory_budget": "40GB"})
        model = chameleon.attach(model)
        for batch in data:
            optimizer.zero_grad(set_to_none=True)
            loss = chameleon.run_iteration(lambda: step(model, batch), optimizer=optimizer)
            logger.info("peak %d bytes", chameleon.last_report.peak_device_bytes)

    Read API: ``stage`` (the next iteration's), ``last_report``, ``last_trace``, ``controller`` (the
    policies tried and chosen), ``executor``, ``profiler``, ``device``.
    """

    def __init__(
        self,
        config: ChameleonConfig | dict | str | None = None,
        device: Device | None = None,
        coordinates: RankCoordinates | None = None,
    ) -> None:
        self.config = load_config(config)
        self.coordinates = coordinates
        node = read_node()  # (the one read of the host's RAM, limits and LOCAL_WORLD_SIZE: config/budgets.py)
        self.device = device if device is not None else make_device(self.config, node)
        passed = device is not None
        self.budgets: ResolvedBudgets = resolve_budgets(self.config, self.device, node, device_passed=passed)
        problems = runtime_problems(self.config, self.device, self.budgets, device_passed=passed)
        if problems:
            raise ConfigError(problems)
        # a device made without a host budget takes the config's (a different one is an error above)
        self.device.host_pool.adopt_budget(self.budgets.host_budget_bytes)
        self.memory_budget_bytes = self.budgets.memory_budget_bytes
        self.executor = SwapExecutor(
            self.device, self.config.min_swap_bytes, prefetch_depth=self.config.executor.prefetch_depth,
            prefetch_limit_bytes=self.memory_budget_bytes,
        )
        profiler = self.config.profiler
        self.profiler = OnlineProfiler(
            profiler.warmup_iterations,
            profiler.policy_trials,
            profiler.length_change,
            profiler.cosine_threshold,
            self.device.live_bytes,
            self.device.emulated,
            timer=functools.partial(self.device.timer, keep_waits=True),  # (layer times without copy waits)
        )
        # with a fixed host cost per op the emulated device's times repeat exactly: no noise to allow for, and a
        # close pair tried again would measure the same (``policy.ranking``): the fastest wins, as measured
        exact_times = self.device.emulated and getattr(getattr(self.device, "model", None), "host_op_s", None) is not None
        ranking = TrialRanking(0.0, 0) if exact_times else TrialRanking(profiler.trial_margin, profiler.trial_repeats)
        self.controller = PolicyController(self._policy_settings(), capacity_bytes=self.budgets.capacity_bytes,
                                           ranking=ranking)
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._iteration = 0
        self._running: _Running | None = None
        # device times from marks at each iteration's start and end on the compute stream: on a GPU the host
        # only queues kernels, so a host clock would rank trials by how fast their kernels were queued
        self._times = IterationTimes()
        self.last_report: IterationReport | None = None
        self._warned_unknown_parameters = False  # run_iteration retried without knowing every parameter
        self.device.set_pressure_handler(self.executor.relieve_pressure if self.config.enabled else None)
        host_share = self.budgets.described_host()
        logger.info(
            "chameleon %s on %s (memory budget %s, min_swap_bytes %s, %s)",
            "enabled" if self.config.enabled else "disabled (measuring only)",
            self.device.name,
            format_bytes(self.memory_budget_bytes),
            format_bytes(self.config.min_swap_bytes),
            host_share.describe(),
        )
        node_problem = host_share.node_problem()
        if node_problem is not None and self.config.enabled:
            logger.warning("%s", node_problem)

    @property
    def stage(self) -> Stage:
        """The stage the next iteration runs in: "warmup", "gen_policy" or "stable"."""
        return self.profiler.stage

    @property
    def last_trace(self):
        """The latest detailed ``StepTrace`` (recorded in WarmUp iterations), or None."""
        return self.profiler.last_trace

    def attach(self, model: nn.Module) -> nn.Module:
        """Count ``model``'s parameters as device memory and keep them out of the swap path. Attaching
        a model again does nothing. A model whose parameters and buffers leave no room on the device is
        refused with a ConfigError naming device.capacity (the emulated device keeps counting it until
        it is freed)."""
        if model in self._models:
            return model
        self.device.track_module(model)
        problem = model_fit_problem(type(model).__name__, module_device_bytes(model, self.device),
                                    self.device.live_bytes(), self.budgets.capacity_bytes)
        if problem is not None:
            raise ConfigError([problem])
        self.executor.protect(model)
        self.profiler.watch(model)
        self._models.add(model)
        return model

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        """One whole training iteration: every micro-batch's forward and backward, and the optimizer step.

        On entry the controller picks the policy for the current stage; inside, the device meters memory,
        the profiler observes and the executor swaps; on exit the stage machine advances and
        ``last_report`` describes the iteration.

        If the body raises, the exception propagates unchanged, the iteration is not counted (the
        iteration number, the stage machine and the policy trials stay where they were, and its partial
        trace is never used for a policy), and ``last_report`` is a report with ``failed=True`` and
        ``error`` naming the exception. An out-of-memory error here is not retried: ``run_iteration``
        retries.

        Raises:
            RuntimeError: when an iteration is already active (iterations cannot nest).
        """
        if self._running is not None:
            raise RuntimeError("Chameleon.iteration() is already active: iterations cannot nest")
        stage = self.profiler.stage
        policy = self.controller.policy_for(stage, self.profiler.last_trace, self.executor.min_swap_bytes) \
            if self.config.enabled else None
        stall_start_s = self.device.stall_s()
        self.device.reset_peak()
        timer = self.device.timer()
        running = self._running = _Running(stage, policy, time.perf_counter(), timer, timer.mark(), stall_start_s,
                                           stall_start_s)
        try:
            observing = self.profiler.observe(
                self._iteration + 1, self._models, self.executor.protected_keys, on_write=self.executor.note_writes,
                listener=self.executor if self.config.enabled else None,
            )
            with self.device.active(), observing as observation:
                running.observation = observation
                if self.config.enabled:
                    context = IterationContext(
                        policy=policy, op_clock=lambda ids=observation.ids: len(ids), observer=observation.recorder,
                        hide_own_ops=self.profiler.scope.quiet, writes_reported=True,
                        site_clock=self.profiler.site_clock(observation),
                        micro_batch=lambda clock=self.profiler.micro_batches: clock.current,
                        layer_clock=lambda layers=self.profiler.layers: layers.layer,
                    )
                    with self.executor.active(context) as running.counters:
                        yield
                else:
                    yield
        except Exception as exc:  # the iteration is lost: say so in last_report, then let the caller see it
            observation = running.observation
            self.last_report = IterationReport.failed_with(
                exc, self._iteration + 1, running.stage, time.perf_counter() - running.start_s,
                len(observation.ids) if observation is not None else 0, **self._measured_fields(running),
            )
            raise
        finally:
            self._running = None
        self._conclude(running)


    def _conclude(self, running: _Running) -> None:
        """After a completed iteration: count it, tell the controller and the profiler what it did, and write
        ``last_report``."""
        stage, policy, observation = running.stage, running.policy, running.observation
        self._iteration += 1
        # (NOTE [Stable iterations never wait for their own figures] in device/iteration_times.py)
        iteration_s, iteration_s_lag = self._times.finish(self._iteration, running.timer, running.iteration_start,
                                                          wait=stage != Stage.STABLE)
        counters = running.counters
        outcome = IterationOutcome(
            iteration=self._iteration, stage=stage, policy=policy, peak_device_bytes=self.device.peak_bytes(),
            iteration_s=iteration_s, stall_s=self.device.stall_s() - running.stall_start_s,
            attempt_stall_s=self.device.stall_s() - running.attempt_stall_start_s,
            swaps=counters.figures(), oom_retries=running.oom_retries,
            profiled=observation.recorder is not None, saved_bytes=sum(counters.saved_bytes),
            saved_bytes_by_layer=types.MappingProxyType(dict(counters.saved_bytes_by_layer)),
            passive_swap_bytes=counters.passive_swap_bytes,
            failed_attempt_passive_swaps=observation.failed_attempt_passive_swaps,
        )
        verdict = self.controller.record(outcome)
        profile = self.profiler.conclude(observation, counters.saved_bytes, verdict,
                                         saved_layers=counters.saved_bytes_by_layer.keys())
        self.controller.follow(profile.transition, outcome)
        self.last_report = IterationReport.completed(
            self._iteration, iteration_s, profile, tightened_in_place=verdict.tightened_in_place,
            verdict_rule=verdict.rule, iteration_s_lag=iteration_s_lag, **self._measured_fields(running),
        )
        logger.debug("%s", self.last_report)
        self.device.host_pool.log_pageable_fallbacks(self._iteration)  # (NOTE [A fragmented arena], host_pool.py)
        if stage == Stage.WARMUP and self.config.enabled and counters.swap_out_bytes:
            # once, outside the save path: page-locked host memory for the most bytes WarmUp held on the host at once
            self.device.host_pool.reserve_arena(self.device.host_pool.peak_in_use_aligned_bytes)

    def _policy_settings(self) -> PolicySettings:
        """What the controller generates policies for: this runtime's budget, device link and host pool."""
        return PolicySettings(
            budget_bytes=self.memory_budget_bytes,
            min_swap_bytes=self.executor.min_swap_bytes,
            host_budget_bytes=self.budgets.host_budget_bytes,  # (the pool's: adopt_budget took it at start)
            trials=self.config.profiler.policy_trials,
            allow_recompute=self.config.executor.allow_recompute,
            d2h_bytes_per_s=_planning_rate(self.device.d2h_bytes_per_s, self.config.device.d2h_bytes_per_s),
            h2d_bytes_per_s=_planning_rate(self.device.h2d_bytes_per_s, self.config.device.h2d_bytes_per_s),
        )

    def run_iteration(self, closure: Callable[[], T], optimizer: torch.optim.Optimizer | None = None) -> T:
        """Run ``closure`` (forward and backward of every micro-batch) inside ``iteration()``, then
        ``optimizer.step()`` when given.

        **What is retried.** On an out-of-memory error in the closure, every parameter of the attached
        models and of ``optimizer``'s param groups gets back the gradient it had when the iteration began,
        the CPU and device random states are restored (the retry draws the same dropout masks), swapping
        is tightened, and **the closure runs again** (up to ``executor.max_oom_retries`` times): the step
        is never lost and the optimizer never sees a half-accumulated gradient.

        - The closure is re-run as it is: **fetch the batch outside it** (a closure that calls
          ``next(data_iter)`` would silently train the retry on a different batch).
        - Without ``optimizer``, gradients of parameters outside attached models cannot be restored: pass
          the optimizer (or ``attach`` every model); the first such retry logs a warning.
        - Gradients that exist when the iteration begins are copied to host memory, just before backward
          first adds to them, so a retry can restore them, except gradients zeroed in place
          (``zero_grad(set_to_none=False)``, framework gradient buffers): those are only checked on their
          device, and zeroed again for a retry. The host never waits for the device to take the snapshot
          (NOTE [A gradient snapshot without host waits] in ``retry.py``).

        **What is not retried.** Keep the optimizer step out of the closure. An out-of-memory error
        inside ``optimizer.step()`` is raised as ``OptimizerStepOutOfMemoryError`` (the step may already
        have changed parameters); the optimizer state the failed step had just created is discarded, so
        the optimizer stays usable. Any other exception propagates at once. A failed iteration is reported
        in ``last_report`` (``failed``, ``error``).

        Args:
            closure: forward and backward of every micro-batch of one iteration; its result is returned.
            optimizer: stepped after the closure succeeded; its param groups' gradients are restored on a
                retry. None: step it yourself after ``run_iteration`` returns.

        Raises:
            torch.OutOfMemoryError: the last retry failed too; the message says why swapping could not
                make room (a full host budget, everything already swapped) and which setting to change.
            OptimizerStepOutOfMemoryError: out of memory inside ``optimizer.step()``.

        Example::

            for batch in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = chameleon.run_iteration(lambda: train_step(model, batch), optimizer=optimizer)
        """
        retries = self._retries()
        gradients = GradientSnapshot(self._retry_parameters(optimizer), self.device,
                                     hide_own_ops=self.profiler.scope.quiet) if retries else None
        with self.iteration(), contextlib.closing(gradients) if retries else contextlib.nullcontext():
            random_state = RandomState(self.device)

            def reset() -> None:
                gradients.restore()
                if optimizer is None and not self._warned_unknown_parameters:
                    self._warned_unknown_parameters = True
                    logger.warning(
                        "retrying an iteration of run_iteration(closure) without optimizer=: gradients of %d "
                        "parameters of attached models were restored; parameters outside them (not attached, "
                        "not known) keep what the failed attempt accumulated. Pass optimizer= to run_iteration "
                        "or attach() every model that gets gradients.", len(gradients),
                    )
                random_state.restore()

            result = self.retry_out_of_memory(closure, reset)
            if optimizer is not None:
                with self.optimizer_phase(), optimizer_state_guard(optimizer):
                    optimizer.step()
            return result

    def retry_out_of_memory(self, attempt: Callable[[], T], reset: Callable[[], None],
                            on_last: Callable[[torch.OutOfMemoryError], None] | None = None) -> T:
        """The one retry loop (``run_iteration``, DeepSpeed's ``run_window`` and ``train_batch`` use it): run
        ``attempt`` inside the open iteration; on an out-of-memory error let go of the failed attempt's frames,
        call ``reset`` (the caller puts back what the attempt changed: gradients, random state, engine
        counters), start the iteration over with what the controller decides for the retry (``RetryAction``,
        applied by the executor), and run ``attempt`` again, up to ``executor.max_oom_retries`` times (never
        when disabled). Other exceptions propagate at once.

        An out-of-memory error after which the iteration is no longer open (the attempt closed it: an
        integration's error that cannot be retried, such as one rank of several) propagates as it is. After
        the last retry, ``on_last`` gets the error that will be raised (it says why swapping could not make
        room and what to change), then it is raised.

        Raises:
            RuntimeError: when no iteration is open (enter ``iteration()`` first).
        """
        if self._running is None:
            raise RuntimeError("Chameleon.retry_out_of_memory runs inside an open iteration: enter iteration() first")
        retries = self._retries()
        buffers = self._buffer_snapshot() if retries else None
        try:
            for attempt_number in range(retries + 1):
                try:
                    return attempt()
                except torch.OutOfMemoryError as exc:
                    if self._running is None:  # the attempt closed the iteration: nothing is left to retry
                        raise
                    if attempt_number == retries:
                        final = self._final_out_of_memory(exc, attempt_number)
                        if on_last is not None:
                            on_last(final)
                        if final is exc:
                            raise
                        raise final from exc
                    reason = str(exc)
                    drop_failed_frames(exc)
                if buffers is not None:
                    buffers.restore()
                reset()
                self._recover(reason)
        finally:
            if buffers is not None:
                self.device.dispatch.before_write = None
                buffers.close()
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _buffer_snapshot(self) -> BufferSnapshot | None:
        """The attached modules' buffers, kept before an attempt first writes each, for a retry to give back
        (NOTE [Buffers a retry gives back] in ``retry_buffers.py``); None when they have none."""
        snapshot = BufferSnapshot(self._models, self.device, hide_own_ops=self.profiler.scope.quiet)
        if not snapshot or getattr(self.device, "dispatch", None) is None:
            return None
        self.device.dispatch.before_write = snapshot.before_write
        return snapshot

    def _retries(self) -> int:
        """How many times an iteration that ran out of memory runs again (never when disabled)."""
        return self.config.executor.max_oom_retries if self.config.enabled else 0

    def _retry_parameters(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        parameters = [p for model in self._models for p in model.parameters()]
        if optimizer is not None:
            parameters += [p for group in optimizer.param_groups for p in group["params"]]
        return parameters

    def _final_out_of_memory(self, exc: torch.OutOfMemoryError, retries: int) -> torch.OutOfMemoryError:
        if not self.config.enabled:
            return exc
        pool = self.device.host_pool
        return final_out_of_memory(
            exc, retries, refused_bytes=self.executor.counters.kept_on_device_bytes, host_budget_bytes=pool.budget_bytes,
            host_in_use_bytes=pool.in_use_bytes,
            swaps_everything=self.executor.policy is None and self.executor.min_swap_bytes == 0,
        )

    @contextlib.contextmanager
    def optimizer_phase(self) -> Iterator[None]:
        """Marks the ops inside as the optimizer step (``run_iteration`` does this): the optimizer's phase in
        detailed traces, and outside the model's program in the op signature (a skipped step is not another
        program)."""
        self._mark_optimizer(True)
        try:
            yield
        finally:
            self._mark_optimizer(False)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """For loops that call ``optimizer.step()`` themselves inside ``iteration()``: mark its ops."""
        optimizer.register_step_pre_hook(lambda *_: self._mark_optimizer(True))
        optimizer.register_step_post_hook(lambda *_: self._mark_optimizer(False))
        return optimizer

    def _mark_optimizer(self, active: bool) -> None:
        if self._running is not None:  # (the profiler's scope: the step's ops are not the model's program)
            self.profiler.scope.optimizer_step(active)

    def _recover(self, reason: str) -> None:
        """Start the running iteration over after an out-of-memory error (``run_iteration`` already gave
        every parameter its gradient back). The executor's counters and save numbering, the signature and
        the detailed trace describe only the attempt that completes; the failed attempt still counts as
        "the policy did not hold" (``oom_retries`` for the controller, its passive swaps for the stage
        machine through the controller's verdict). The controller says what the retry changes
        (``RetryAction``) and the executor applies it."""
        running = self._running
        running.oom_retries += 1
        counters = self.executor.counters
        refused_bytes, passive_swaps, policy = counters.kept_on_device_bytes, counters.passive_swaps, self.executor.policy
        gc.collect()  # the failed attempt's graph goes now, where Python can free it; the executor lets go of the rest
        retry = self.controller.on_out_of_memory(policy, refused_bytes, self.executor.min_swap_bytes)
        self.executor.new_attempt(retry)
        if running.observation is not None:
            self.profiler.new_attempt(running.observation, passive_swaps)
        running.attempt_stall_start_s = self.device.stall_s()  # the trace's stall: the completed attempt's
        first_line = reason.splitlines()[0]
        if retry.cause == RetryCause.POLICY_FAILED:
            logger.warning("out of memory under policy %s (%s); retrying the iteration swapping every eligible "
                           "tensor", policy.name, first_line)
        elif retry.cause == RetryCause.HOST_BUDGET_FULL:
            logger.warning("out of memory (%s) with %s kept on the device because host_memory_budget (%s) was "
                           "full; retrying (raise host_memory_budget)", first_line,
                           format_bytes(refused_bytes), format_bytes(self.device.host_pool.budget_bytes or 0))
        elif retry.cause == RetryCause.EVERYTHING_SWAPPED:
            logger.warning("out of memory (%s) with every saved activation swapped; retrying", first_line)
        else:
            logger.warning("out of memory (%s); retrying the iteration with min_swap_bytes lowered to %s",
                           first_line, format_bytes(retry.min_swap_bytes))

    def _measured_fields(self, running: _Running) -> dict:
        """The report fields a completed and a failed iteration fill alike (the executor's counts as its own
        record, ``SwapFigures``)."""
        policy = running.policy
        return dict(
            enabled=self.config.enabled,
            peak_device_bytes=self.device.peak_bytes(),
            capacity_bytes=self.budgets.capacity_bytes,
            memory_budget_bytes=self.memory_budget_bytes,
            host_pool_bytes=self.device.host_pool.reserved_bytes,
            host_memory_budget_bytes=self.device.host_pool.budget_bytes,
            stall_s=self.device.stall_s() - running.stall_start_s,
            policy_version=self.controller.version_of(policy),
            oom_retries=running.oom_retries,
            emulated=self.device.emulated,
            policy="" if policy is None else policy.name,
            rank=self.coordinates.label if self.coordinates is not None else "",
            swaps=running.counters.figures(),
        )
