"""The per-rank ``Chameleon`` runtime: device, executor and (later) profiler and policy, for one rank.

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
import gc
import logging
import time
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from chameleon_dist.config import ChameleonConfig, ConfigError, load_config, physical_memory_bytes
from chameleon_dist.config.checks import model_fit_problem, runtime_problems
from chameleon_dist.device.base import Device, module_device_bytes
from chameleon_dist.device.factory import make_device
from chameleon_dist.executor.swap import SwapCounters, SwapExecutor
from chameleon_dist.executor.trials import PolicyTrials
from chameleon_dist.policy.generator import PolicySettings
from chameleon_dist.policy.model import Policy
from chameleon_dist.profiler.online import IterationProfile, OnlineProfiler
from chameleon_dist.profiler.stages import GEN_POLICY, STABLE, WARMUP
from chameleon_dist.report import IterationReport
from chameleon_dist.retry import GradientSnapshot, RandomState, optimizer_state_guard
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

T = TypeVar("T")

TIGHTEN_FACTOR = 16
"""After an out-of-memory error, ``min_swap_bytes`` is divided by this (and goes to 0 below 1 KiB)."""

UNKNOWN_LINK_BYTES_PER_S = 25e9
"""Link bandwidth the policy generator assumes when neither the device nor the config gives one."""

INSTANT_LINK_BYTES_PER_S = 1e15
"""What the policy generator is told for an emulated link without a bandwidth (copies are instant)."""


class Chameleon:
    """One per rank. ``process_groups`` is kept for the distributed integrations (never created here)."""

    def __init__(
        self,
        config: ChameleonConfig | dict | str | None = None,
        device: Device | None = None,
        process_groups: Any = None,
    ) -> None:
        self.config = load_config(config)
        self.device = device if device is not None else make_device(self.config)
        problems = runtime_problems(self.config, self.device, device_passed=device is not None,
                                    host_total_bytes=physical_memory_bytes())
        if problems:
            raise ConfigError(problems)
        if device is not None and device.host_pool.budget_bytes is None and "host_memory_budget" in self.config.model_fields_set:
            # a device made without a host budget takes the config's (a different one is an error above)
            device.host_pool.budget_bytes = self.config.host_memory_budget_bytes()
        self.process_groups = process_groups
        self.memory_budget_bytes = self.config.memory_budget_bytes(self.device.capacity_bytes)
        self.executor = SwapExecutor(
            self.device, self.config.min_swap_bytes, prefetch_depth=self.config.executor.prefetch_depth
        )
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._iteration = 0
        self._passive_swaps = 0
        self._oom_retries = 0
        self._in_iteration = False
        self.last_report: IterationReport | None = None
        self._warned_unknown_parameters = False  # run_iteration retried without knowing every parameter
        profiler = self.config.profiler
        self.profiler = OnlineProfiler(
            profiler.warmup_iterations,
            profiler.policy_trials,
            profiler.length_change,
            profiler.cosine_threshold,
            self.device.live_bytes,
            self.device.emulated,
        )
        self._observation = None
        self.executor.quiet = self.profiler.scope.quiet
        self.trials = PolicyTrials()
        self._need_policies = False
        self._pressure_waits = 0
        self._trace_stall_s: dict[int, float] = {}
        self._swap_all_peak_bytes = 0  # peak of the latest WarmUp (swap-everything) iteration
        self._warmup_unsafe = False  # the old policy needed passive swaps or a retry in WarmUp
        self.applied_policy: Policy | None = None
        self.device.set_pressure_handler(self._on_memory_pressure if self.config.enabled else None)
        logger.info(
            "chameleon %s on %s (memory budget %s, min_swap_bytes %s)",
            "enabled" if self.config.enabled else "disabled (measuring only)",
            self.device.name,
            format_bytes(self.memory_budget_bytes),
            format_bytes(self.config.min_swap_bytes),
        )

    @property
    def stage(self) -> str:
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
                                    self.device.live_bytes(), self.device.capacity_bytes)
        if problem is not None:
            raise ConfigError([problem])
        self.executor.protect(model)
        self.profiler.scope.watch(model)
        self._models.add(model)
        return model

    @contextlib.contextmanager
    def iteration(self) -> Iterator[None]:
        """One whole training iteration (all micro-batches and the optimizer step)."""
        if self._in_iteration:
            raise RuntimeError("Chameleon.iteration() is already active: iterations cannot nest")
        stage = self.profiler.stage
        self.applied_policy = self._policy_for(stage) if self.config.enabled else None
        self._in_iteration = True
        self._passive_swaps = 0
        self._oom_retries = 0
        stall_start_s = self._attempt_stall_start_s = self.device.stall_s()
        self.device.reset_peak()
        start_s = time.perf_counter()
        self._pressure_waits = 0
        counters = SwapCounters()
        self.executor.use_policy(self.applied_policy)
        observation = None
        try:
            observing = self.profiler.observe(
                self._iteration + 1, self._models, self.executor.protected_keys, on_write=self.executor.note_writes
            )
            with self.device.active(), observing as observation:
                self._observation = observation
                self.executor.observer = observation.recorder
                self.executor.op_clock = lambda ids=observation.ids: len(ids)
                if self.config.enabled:
                    with self.executor.active(writes_reported=True) as counters:
                        yield
                else:
                    yield
        except Exception as exc:  # the iteration is lost: say so in last_report, then let the caller see it
            self.last_report = self._failure_report(exc, stage, counters, observation, start_s, stall_start_s)
            raise
        finally:
            self._in_iteration = False
            self._observation = None
            self.executor.observer = None
            self.executor.op_clock = lambda: -1
        self._iteration += 1
        iteration_s = time.perf_counter() - start_s
        peak = self.device.peak_bytes()
        # what a policy must stay under: the budget, or, where no swap can meet it (a peak in the optimizer
        # step, a link too slow), the peak of the swap-everything executor it replaces
        allowed = max(self.memory_budget_bytes, self._swap_all_peak_bytes)
        if stage == GEN_POLICY and self.applied_policy is not None:
            held = peak <= allowed and not self._passive_swaps and not self._oom_retries
            stall_s = self.device.stall_s() - stall_start_s
            self.trials.record(self.applied_policy, iteration_s, peak, held, self.memory_budget_bytes, stall_s)
        over_budget = ""
        if stage == STABLE and self.applied_policy is not None and peak > allowed:
            over_budget = (f"peak {format_bytes(peak)} above memory_budget {format_bytes(self.memory_budget_bytes)} "
                           f"under policy {self.applied_policy.name}")
        if stage == WARMUP and self.applied_policy is None and not self._oom_retries:
            self._swap_all_peak_bytes = peak
        if stage == WARMUP:  # the old policy is kept in WarmUp only while it holds without help
            self._warmup_unsafe = bool(self.applied_policy is not None and (self._passive_swaps or self._oom_retries))
        profile = self.profiler.conclude(observation, counters.saved_bytes, self._passive_swaps, over_budget)
        self._follow(profile, stage)
        self.last_report = self._report(counters, profile, iteration_s, stall_start_s)
        if profile.trace is not None:  # the stall of the iteration a policy will be built from
            self._trace_stall_s = {profile.trace.iteration: self.device.stall_s() - self._attempt_stall_start_s}
        logger.debug("%s", self.last_report)

    # ---- policies ---------------------------------------------------------------------------
    def _policy_for(self, stage: str) -> Policy | None:
        """WarmUp applies the last chosen policy to the tensors it matches confidently (the rest stay on
        the device, with passive swap as the safety net), or swaps every eligible tensor when there is
        none yet or the last WarmUp iteration needed passive swaps or a retry; GenPolicy tries the
        generated policies in turn; Stable applies the chosen one."""
        if stage == WARMUP:
            return self.trials.current if self.trials.current is not None and not self._warmup_unsafe else None
        if stage == GEN_POLICY:
            if self._need_policies or self.trials.regenerate:
                if self._need_policies:
                    self.trials.start()
                self._need_policies = False
                trace = self.profiler.last_trace
                if trace is None:
                    return None
                # compute time only: the profiled iteration's stalls were the swap-all executor's waits
                compute_s = max(trace.iteration_s - self._trace_stall_s.get(trace.iteration, 0.0), trace.iteration_s / 20)
                # every time in the trace shrinks alike: measured layer times included (they carry the
                # detailed recorder's cost and the forward pass's share of the stalls too)
                scale = compute_s * self.trials.time_scale / max(trace.iteration_s, 1e-12)
                trace = dataclasses.replace(
                    trace, iteration_s=trace.iteration_s * scale,
                    layer_times_s={layer: t * scale for layer, t in trace.layer_times_s.items()},
                )
                self.trials.generate(trace, self._policy_settings())
            return self.trials.trial_policy()
        if stage == STABLE:
            return self.trials.current
        return None

    def _policy_settings(self) -> PolicySettings:
        link = {}
        for direction in ("d2h", "h2d"):
            emulated_link = getattr(self.device, direction, None)
            if emulated_link is not None:  # the emulated device's link; None = instant copies
                rate = emulated_link.bytes_per_s or INSTANT_LINK_BYTES_PER_S
            else:
                rate = getattr(self.config.device, f"{direction}_bytes_per_s", None) or UNKNOWN_LINK_BYTES_PER_S
            link[f"{direction}_bytes_per_s"] = float(rate)
        return PolicySettings(
            budget_bytes=self.memory_budget_bytes,
            min_swap_bytes=self.executor.min_swap_bytes,
            host_budget_bytes=self.device.host_pool.budget_bytes,
            trials=self.config.profiler.policy_trials,
            allow_recompute=False,  # the executor has no recompute path: recompute decisions would be swaps
            **link,
        )

    def _follow(self, profile: IterationProfile, stage: str) -> None:
        transition = profile.transition
        if transition is None:
            return
        if transition.after == GEN_POLICY:
            self._need_policies = True
        elif transition.after == STABLE:
            self.trials.choose()
        elif transition.after == WARMUP and (self._passive_swaps or "memory_budget" in transition.reason) and stage != WARMUP:
            self.trials.tighten(self.applied_policy)

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
        - Gradients that exist when the iteration begins are copied to host memory so a retry can restore
          them; ``zero_grad(set_to_none=True)`` before each iteration avoids that copy.

        **What is not retried.** Keep the optimizer step out of the closure. An out-of-memory error
        inside ``optimizer.step()`` is raised as ``OptimizerStepOutOfMemoryError`` (the step may already
        have changed parameters); the optimizer state the failed step had just created is discarded, so
        the optimizer stays usable. Any other exception propagates at once. A failed iteration is reported
        in ``last_report`` (``failed``, ``error``)."""
        retries = self.config.executor.max_oom_retries if self.config.enabled else 0
        gradients = GradientSnapshot(self._retry_parameters(optimizer)) if retries else None
        with self.iteration():
            random_state = RandomState(self.device)
            for attempt in range(retries + 1):
                if attempt:
                    random_state.restore()
                try:
                    result = closure()
                except torch.OutOfMemoryError as exc:
                    if attempt == retries:
                        raise self._final_out_of_memory(exc, attempt) from exc
                    reason = str(exc)
                else:
                    if optimizer is not None:
                        with self.optimizer_phase(), optimizer_state_guard(optimizer):
                            optimizer.step()
                    return result
                gradients.restore()
                if optimizer is None and not self._warned_unknown_parameters:
                    self._warned_unknown_parameters = True
                    logger.warning(
                        "retrying an iteration of run_iteration(closure) without optimizer=: gradients of %d "
                        "parameters of attached models were restored; parameters outside them (not attached, "
                        "not known) keep what the failed attempt accumulated. Pass optimizer= to run_iteration "
                        "or attach() every model that gets gradients.", len(gradients),
                    )
                self._recover(reason)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _retry_parameters(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        parameters = [p for model in self._models for p in model.parameters()]
        if optimizer is not None:
            parameters += [p for group in optimizer.param_groups for p in group["params"]]
        return parameters

    def _final_out_of_memory(self, exc: torch.OutOfMemoryError, retries: int) -> torch.OutOfMemoryError:
        """The error after the last retry: why swapping could not make room, and what to change."""
        if not self.config.enabled:
            return exc
        refused_bytes = self.executor.counters.kept_for_host_budget_bytes
        pool = self.device.host_pool
        if refused_bytes:
            return torch.OutOfMemoryError(
                f"{exc}\nhost_memory_budget ({format_bytes(pool.budget_bytes or 0)}) refused "
                f"{format_bytes(refused_bytes)} of swaps in the last of {retries + 1} attempts, which stayed on "
                f"the device: raise host_memory_budget to at least "
                f"{format_bytes(pool.in_use_bytes + refused_bytes)}."
            )
        if self.executor.matcher is None and self.executor.min_swap_bytes == 0:
            return torch.OutOfMemoryError(
                f"{exc}\nChameleon already swaps every saved activation and the step still does not fit after "
                f"{retries} retries: raise device.capacity / memory_budget, lower the micro-batch size, or add "
                "recomputation."
            )
        return exc

    @contextlib.contextmanager
    def optimizer_phase(self) -> Iterator[None]:
        """Marks the ops inside as the optimizer step in detailed traces (``run_iteration`` does this)."""
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
        recorder = self._observation.recorder if self._observation is not None else None
        if recorder is not None:
            recorder.optimizer_active = active

    def _recover(self, reason: str) -> None:
        self._oom_retries += 1  # (run_iteration already gave every parameter its gradient back)
        refused_bytes = self.executor.counters.kept_for_host_budget_bytes
        gc.collect()  # the failed attempt's graph and its swapped entries go now
        # The retry starts the iteration over: the executor's counters and save numbering, the signature,
        # the detailed trace and the runtime's per-attempt counters describe only the attempt that
        # completes. The failed attempt still counts as "the policy did not hold": ``_oom_retries`` for the
        # trials and WarmUp, and its passive swaps reach the stage machine through the profiler.
        self.executor.new_attempt()
        if self._observation is not None:
            self.profiler.new_attempt(self._observation, self._passive_swaps)
        self._passive_swaps = 0
        self._pressure_waits = 0
        self._attempt_stall_start_s = self.device.stall_s()  # the trace's stall: the completed attempt's
        if self.executor.matcher is not None:  # the policy did not hold: the retry swaps every eligible tensor
            self.executor.use_policy(None)
            self.trials.tighten(self.applied_policy)
            logger.warning("out of memory under policy %s (%s); retrying the iteration swapping every eligible "
                           "tensor", self.applied_policy.name if self.applied_policy else "?", reason.splitlines()[0])
            return
        if refused_bytes:  # swapping more cannot help while the host pool is full
            logger.warning("out of memory (%s) with %s kept on the device because host_memory_budget (%s) was "
                           "full; retrying (raise host_memory_budget)", reason.splitlines()[0],
                           format_bytes(refused_bytes), format_bytes(self.device.host_pool.budget_bytes or 0))
            return
        if self.executor.min_swap_bytes == 0:  # a transient shortage (another tenant, fragmentation) may pass
            logger.warning("out of memory (%s) with every saved activation swapped; retrying", reason.splitlines()[0])
            return
        self.executor.min_swap_bytes //= TIGHTEN_FACTOR
        if self.executor.min_swap_bytes < 1024:
            self.executor.min_swap_bytes = 0
        logger.warning(
            "out of memory (%s); retrying the iteration with min_swap_bytes lowered to %s",
            reason.splitlines()[0],
            format_bytes(self.executor.min_swap_bytes),
        )

    def _on_memory_pressure(self, short_bytes: int) -> int:
        before = self.executor.counters.passive_swaps
        freed_bytes = self.executor.relieve_pressure(short_bytes)
        if self.executor.counters.passive_swaps > before:
            self._passive_swaps += self.executor.counters.passive_swaps - before
        elif freed_bytes > 0:
            self._pressure_waits += 1
        return freed_bytes

    def _failure_report(
        self, exc: Exception, stage: str, counters: SwapCounters, observation, start_s: float, stall_start_s: float
    ) -> IterationReport:
        """The report of an iteration that raised: what it did until then, and the error. The iteration
        counter and the stage machine do not advance (the step did not happen)."""
        return IterationReport(
            iteration=self._iteration + 1,
            stage=stage,
            iteration_s=time.perf_counter() - start_s,
            num_ops=len(observation.ids) if observation is not None else 0,
            sequence_changed=False,
            sequence_change_major=False,
            sequence_cosine=1.0,
            sequence_length_change=0.0,
            saved_bytes_change=0.0,
            stage_transition=None,
            failed=True,
            error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            **self._measured_fields(counters, stall_start_s),
        )

    def _report(self, counters: SwapCounters, profile: IterationProfile, iteration_s: float, stall_start_s: float) -> IterationReport:
        transition = profile.transition
        return IterationReport(
            iteration=self._iteration,
            stage=profile.stage,
            iteration_s=iteration_s,
            num_ops=profile.signature.num_ops,
            sequence_changed=profile.comparison.changed,
            sequence_change_major=profile.comparison.changed,  # older name, same value
            sequence_differs=profile.comparison.differs,  # any difference, absorbed or not
            sequence_cosine=profile.comparison.cosine,
            sequence_length_change=profile.comparison.length_change,
            saved_bytes_change=profile.comparison.saved_bytes_change,
            stage_transition=None if transition is None else f"{transition.before} -> {transition.after}: {transition.reason}",
            **self._measured_fields(counters, stall_start_s),
        )

    def _measured_fields(self, counters: SwapCounters, stall_start_s: float) -> dict:
        """The report fields a completed and a failed iteration fill alike."""
        return dict(
            enabled=self.config.enabled,
            peak_device_bytes=self.device.peak_bytes(),
            capacity_bytes=self.device.capacity_bytes,
            memory_budget_bytes=self.memory_budget_bytes,
            swap_out_bytes=counters.swap_out_bytes,
            swap_in_bytes=counters.swap_in_bytes,
            swapped_storages=counters.swapped_storages,
            prefetched=counters.prefetched,
            kept_on_device_bytes=counters.kept_for_host_budget_bytes,
            host_pool_bytes=self.device.host_pool.reserved_bytes,
            stall_s=self.device.stall_s() - stall_start_s,
            policy_version=self.trials.version if self.applied_policy is self.trials.current else 0,
            passive_swaps=self._passive_swaps,
            oom_retries=self._oom_retries,
            emulated=self.device.emulated,
            pressure_waits=self._pressure_waits,
            policy="" if self.applied_policy is None else self.applied_policy.name,
            matched_exact=counters.matches.exact,
            matched_fuzzy=counters.matches.fuzzy,
            unmatched=counters.matches.unmatched,
            on_demand_fetches=counters.on_demand,
            reused_original_bytes=counters.reused_original_bytes,
        )
