"""``OnlineProfiler``: one per runtime. Every iteration it takes the cheap signature; in WarmUp it also
records a detailed ``StepTrace``; after each iteration it compares the signature with the reference and
advances the stage machine."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Iterable, Iterator

from torch import nn

from chameleon_dist.device.base import DeviceTimer, HostTimer
from chameleon_dist.profiler.recorder import TraceRecorder
from chameleon_dist.profiler.scope import LayerClock, MicroBatchClock, TrainingScope
from chameleon_dist.profiler.signature import Comparison, OpListener, OpVocabulary, Signature, SignatureMode, compare
from chameleon_dist.profiler.stages import StageMachine
from chameleon_dist.trace.stages import Stage, Transition, Verdict
from chameleon_dist.trace.step_trace import StepTrace

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Observation:
    """One iteration being observed: its signature ids, and the detailed recorder in WarmUp.
    ``failed_attempts`` counts out-of-memory retries (see ``OnlineProfiler.new_attempt``) and
    ``failed_attempt_passive_swaps`` the passive swaps their attempts needed."""

    stage: Stage
    ids: list[int]
    recorder: TraceRecorder | None
    failed_attempts: int = 0
    failed_attempt_passive_swaps: int = 0


@dataclasses.dataclass(frozen=True)
class IterationProfile:
    stage: Stage  # the stage the iteration ran in
    signature: Signature
    comparison: Comparison
    transition: Transition | None


class OnlineProfiler:
    """``timer`` makes the ``DeviceTimer`` of each detailed trace's layer times: pass the device's ``timer``
    (on a GPU a host clock would time kernel launches, not kernels); default: the host clock."""

    def __init__(
        self,
        warmup_iterations: int,
        policy_trials: int,
        length_change: float,
        cosine_threshold: float,
        live_bytes: Callable[[], int],
        emulated: bool,
        timer: Callable[[], DeviceTimer] = HostTimer,
    ) -> None:
        self.vocabulary = OpVocabulary()
        self.scope = TrainingScope()
        self.layers = LayerClock()
        self.micro_batches = MicroBatchClock()  # set by an engine integration's schedule hooks
        self.stages = StageMachine(warmup_iterations, policy_trials)
        self.length_change = length_change
        self.cosine_threshold = cosine_threshold
        self._live_bytes = live_bytes
        self._emulated = emulated
        self.timer = timer
        self.reference: Signature | None = None
        self.last_trace: StepTrace | None = None

    @property
    def stage(self) -> Stage:
        return self.stages.stage

    def watch(self, model: nn.Module) -> None:
        """Follow ``model``: whether its forward runs under autograd, and which of its layers runs."""
        self.scope.watch(model)
        self.layers.watch(model)

    def site_clock(self, observation: Observation) -> Callable[[], str]:
        """Where the iteration is now, for the executor's save sites: the running layer and the last op
        recorded (NOTE [Save-site matching] in executor/matching.py)."""
        ids, names, layers = observation.ids, self.vocabulary.names, self.layers

        def site() -> str:
            last = ids[-1] if ids else None
            name = "start" if last is None else names[last if last >= 0 else ~last]
            return f"{layers.site}:{name}"

        return site

    @contextlib.contextmanager
    def observe(
        self,
        iteration: int,
        models: Iterable[nn.Module],
        parameter_keys: Callable[[], set[int]],
        on_write: Callable[[list], None] | None = None,
        listener: OpListener | None = None,
    ) -> Iterator[Observation]:
        """Signature always; a detailed recorder in WarmUp, which then takes the signature too (one
        dispatch mode instead of two). Enter after the device's metering. ``on_write`` hears of every
        tensor an op writes in place and ``listener`` the op clock (the swap executor must know both; no
        second dispatch mode needed)."""
        stage = self.stages.stage
        self.layers.reset()
        self.micro_batches.clear()
        self.scope.reset()
        ids: list[int] = []
        if stage == Stage.WARMUP:
            recorder = TraceRecorder(self.vocabulary, self._live_bytes, parameter_keys(), iteration, self._emulated,
                                     self.scope, timer=self.timer(), micro_batches=self.micro_batches,
                                     signature_ids=ids, on_write=on_write, listener=listener)
            for model in models:
                recorder.watch_modules(model)
            mode = recorder
        else:
            recorder = None
            mode = SignatureMode(self.vocabulary, self.scope, ids, on_write, listener)
        observation = Observation(stage, ids, recorder)
        completed = False
        try:
            with mode:
                yield observation
            completed = True
        finally:
            if recorder is not None:
                trace = recorder.finish()
                if completed:  # the trace of an iteration that raised is partial: never a policy's basis
                    self.last_trace = trace

    def new_attempt(self, observation: Observation, passive_swaps: int = 0) -> None:
        """An out-of-memory retry starts the iteration over (call it after the failed attempt's graph
        was collected): the signature ids are emptied in place (the executor's op clock reads that list)
        and the detailed recorder forgets the failed attempt, so signature and trace describe only the
        attempt that completes. ``passive_swaps`` (those of the failed attempt) are counted in
        ``observation.failed_attempt_passive_swaps``, for the policy controller: they still mean the policy
        did not hold."""
        observation.ids.clear()
        self.layers.reset()
        self.scope.reset()
        if observation.recorder is not None:
            observation.recorder.new_attempt()
        observation.failed_attempts += 1
        observation.failed_attempt_passive_swaps += passive_swaps
        logger.debug("iteration observation restarted for retry %d", observation.failed_attempts)

    def conclude(
        self, observation: Observation, saved_bytes: list[int], verdict: Verdict = Verdict(),
        saved_layers: Iterable[int] = (),
    ) -> IterationProfile:
        """``saved_bytes`` are those of the attempt that completed, ``saved_layers`` the layers that saved in it
        (the executor's ``saved_bytes_by_layer``: a layer the reference never ran is a new code path); ``verdict``
        the policy controller's on the iteration (``PolicyController.record``), which the stage machine takes."""
        signature = Signature.of(observation.ids, saved_bytes, saved_layers)
        comparison = compare(signature, self.reference, self.length_change, self.cosine_threshold)
        if comparison.changed:
            logger.info("operator sequence: %s (%d ops vs %d)", comparison.reason, comparison.num_ops, comparison.reference_num_ops)
        transition = self.stages.advance(comparison.major, verdict, comparison.reason)
        # The reference is the sequence the current (or upcoming) policy is built from: renewed in every
        # profiled iteration and whenever the runtime goes back to WarmUp.
        if self.reference is None or observation.recorder is not None or self.stages.stage == Stage.WARMUP:
            self.reference = signature
        return IterationProfile(observation.stage, signature, comparison, transition)
