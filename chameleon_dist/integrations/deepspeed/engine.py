"""``initialize``: ``deepspeed.initialize`` with Chameleon installed on the rank, from the config's
``"chameleon"`` block.

A DeepSpeed user changes one call::

    engine, optimizer, loader, scheduler = chameleon_dist.integrations.deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")

and keeps calling ``engine(batch)``, ``engine.backward(loss)`` and ``engine.step()`` as DeepSpeed documents.
One iteration of the rank's runtime (``engine.chameleon``) is one optimizer step: it opens at the first
forward of a gradient-accumulation window and closes when ``engine.step()`` returns at the window's
boundary (``engine.is_gradient_accumulation_boundary()`` before the step). The k-th forward and the k-th
backward of the window are micro-batch k. A config without the block, or with ``"enabled": false``, gets
DeepSpeed exactly as before: nothing is installed.

Errors in the block are raised before DeepSpeed builds anything, naming the key inside the DeepSpeed config
(``chameleon.memory_budget``).

Out of memory on one rank (``replay.py`` says what a replay resets): a ``PipelineEngine.train_batch`` that runs
out of memory is replayed from its start on the same micro-batches, up to ``executor.max_oom_retries`` times,
within the same iteration (``last_report.oom_retries``). A plain engine's window is replayed when the loop hands
it over::

    def window():
        for tokens, labels in micro_batches:  # fetched before, never inside
            engine.backward(engine(tokens, labels))
            engine.step()

    engine.chameleon.run_window(window)

When the user's own loop runs out of memory instead, the window is discarded (nothing half-accumulated is ever
stepped; the next window starts clean) and ``WindowDiscardedOutOfMemoryError`` says so. Out of memory inside
the boundary's optimizer step is not replayed (``OptimizerStepOutOfMemoryError``). With several ranks no rank
replays alone: ``RankOutOfMemoryError`` names the rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from chameleon_dist.config import ChameleonConfig
from chameleon_dist.config.loaders import config_from_deepspeed
from chameleon_dist.integrations.deepspeed.buffers import track_engine_buffers
from chameleon_dist.integrations.deepspeed.protect import protect_engine_buffers, protect_gathered_parameters
from chameleon_dist.integrations.deepspeed.upstream import verify_deepspeed
from chameleon_dist.integrations.deepspeed.replay import (
    ReplayIterator, WindowDiscardedOutOfMemoryError, WindowStart, reset_window,
)
from chameleon_dist.integrations.held_runtime import HeldRuntime
from chameleon_dist.integrations.open_iteration import SettingNames
from chameleon_dist.integrations.rank_agreement import Peers, agree_on_settings
from chameleon_dist.ranks import RankCoordinates, RankLogPrefix
from chameleon_dist.retry import OptimizerStepOutOfMemoryError
from chameleon_dist.runtime import Chameleon

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEEPSPEED_SETTINGS = SettingNames(capacity="chameleon.device.capacity", budget="chameleon.memory_budget",
                                  min_swap="chameleon.min_swap_bytes", enable='"enabled": true in the "chameleon" block')


def deepspeed_config_of(args: Any = None, config: Any = None, config_params: Any = None) -> Any:
    """The DeepSpeed config ``deepspeed.initialize`` will read: ``config``, else ``config_params``, else
    ``args.deepspeed_config`` (a dict or a path to its JSON); None when there is none."""
    for candidate in (config, config_params, getattr(args, "deepspeed_config", None) if args is not None else None):
        if candidate is not None:
            return candidate
    return None


class DeepSpeedChameleon(HeldRuntime):
    """The rank's runtime (``runtime``, a ``Chameleon``) and the hooks on one ``DeepSpeedEngine``
    (``engine.chameleon``): each accumulation window is one iteration of the runtime (``open_iteration``)."""

    def __init__(self, config: ChameleonConfig, coordinates: RankCoordinates, peers: Peers | None = None) -> None:
        super().__init__(Chameleon(config, coordinates=coordinates), DEEPSPEED_SETTINGS)
        self.peers = peers  # where the job's ranks run (``agree_on_settings``): a failure names a dead peer
        self._log_prefix = RankLogPrefix(coordinates).install()
        self._engine: Any = None  # the engine followed (``follow``, ``follow_pipeline``)
        self._replaying = False  # inside run_window or train_batch: an out-of-memory error is replayed, not raised
        self._window_start: WindowStart | None = None
        self._forwards = 0
        self._backwards = 0

    def follow(self, engine: Any) -> Any:
        """Wrap ``engine.forward``, ``engine.backward`` and ``engine.step`` (instance attributes; the class is
        untouched) so that each accumulation window is one iteration."""
        forward, backward, step = engine.forward, engine.backward, engine.step
        clock = self.profiler.micro_batches
        window = self.open_iteration
        self._engine = engine

        @functools.wraps(forward)
        def forwarding(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)  # evaluation: not part of an iteration
            if not window.active:
                self._begin()
            clock.enter(self._forwards)
            self._forwards += 1
            return self._guarded(forward, *args, **kwargs)

        @functools.wraps(backward)
        def backwarding(*args: Any, **kwargs: Any) -> Any:
            if not window.active:
                return backward(*args, **kwargs)
            clock.enter(self._backwards)
            self._backwards += 1
            return self._guarded(backward, *args, **kwargs)

        def boundary_step(*args: Any, **kwargs: Any) -> Any:
            with self._boundary_step():
                return step(*args, **kwargs)

        @functools.wraps(step)
        def stepping(*args: Any, **kwargs: Any) -> Any:
            if not window.active:
                return step(*args, **kwargs)
            if not engine.is_gradient_accumulation_boundary():
                return self._guarded(step, *args, **kwargs)  # (a window's inner step: little work, still guarded)
            result = self._guarded(boundary_step, *args, **kwargs)
            window.finish()
            return result

        engine.forward, engine.backward, engine.step = forwarding, backwarding, stepping
        return engine

    def follow_pipeline(self, engine: Any) -> Any:
        """For a ``PipelineEngine``: one ``train_batch`` is one iteration. ``_exec_schedule`` runs each instruction
        through the class-level ``_INSTRUCTION_MAP``; the engine gets its own copy (an instance attribute, the
        class is untouched) in which the k-th ``ForwardPass`` and the k-th ``BackwardPass`` of the batch name
        micro-batch k (its ``buffer_id`` is a reused buffer, not the micro-batch) and ``OptimizerStep`` runs as
        the optimizer's ops. ``eval_batch`` runs untouched."""
        from deepspeed.runtime.pipe import schedule

        clock = self.profiler.micro_batches
        window = self.open_iteration

        def counted(original: Any, backward: bool) -> Any:
            def run(engine_self: Any, *args: Any, **kwargs: Any) -> Any:
                if window.active:
                    slot = self._backwards if backward else self._forwards
                    clock.enter(slot)
                    if backward:
                        self._backwards += 1
                    else:
                        self._forwards += 1
                return original(engine_self, *args, **kwargs)

            return run

        def stepping(original: Any) -> Any:
            def run(engine_self: Any, *args: Any, **kwargs: Any) -> Any:
                with self._boundary_step():
                    return original(engine_self, *args, **kwargs)

            return run

        instructions = dict(type(engine)._INSTRUCTION_MAP)
        instructions[schedule.ForwardPass] = counted(instructions[schedule.ForwardPass], backward=False)
        instructions[schedule.BackwardPass] = counted(instructions[schedule.BackwardPass], backward=True)
        instructions[schedule.OptimizerStep] = stepping(instructions[schedule.OptimizerStep])
        protect_engine_buffers(self.executor, engine, instructions, schedule)
        engine._INSTRUCTION_MAP = instructions
        train_batch = engine.train_batch
        self._engine = engine

        @functools.wraps(train_batch)
        def training(*args: Any, **kwargs: Any) -> Any:
            # the micro-batches this batch takes are recorded, so that a replay trains on the same ones
            given = args[0] if args else kwargs.get("data_iter")
            source = given if given is not None else engine.data_iterator
            data = ReplayIterator(source) if source is not None else None
            if given is not None:
                args, kwargs = ((data, *args[1:]), kwargs) if args else (args, {**kwargs, "data_iter": data})
            elif data is not None:
                engine.data_iterator = data
            self._begin()
            try:
                result = self._replay(lambda: self._guarded(train_batch, *args, **kwargs),
                                      on_retry=data.rewind if data is not None else None)
            finally:
                if data is not None and engine.data_iterator is data:
                    engine.data_iterator = source  # what later batches read on from
            window.finish()
            return result

        engine.train_batch = training
        return engine

    def _begin(self) -> None:
        self.open_iteration.begin()
        self._forwards = self._backwards = 0

    def _replays_alone(self) -> bool:
        """Whether an out-of-memory error can be handled on this rank: one rank, inside an open window."""
        return self.open_iteration.active and self.coordinates.world_size == 1

    def _guarded(self, call: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``call`` inside the open window: an out-of-memory error of a single rank is replayed (inside
        ``run_window`` / ``train_batch``) or discards the window; any other error of an open window closes it as
        failed (``OpenIteration.fail``: several ranks raise ``RankOutOfMemoryError``). An error that already
        closed the window propagates as it is."""
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            if not self.open_iteration.active:
                raise
            if isinstance(exc, torch.OutOfMemoryError) and self._replays_alone():
                if self._replaying:
                    raise  # run_window / train_batch reset the window and run it again
                raise self._discard_window(exc) from exc
            gone = self.peers.describe_gone() if self.peers is not None else None
            if gone is not None:
                logger.error("%s", gone)  # (a survivor of a killed rank sees only a closed connection)
            self.open_iteration.fail(exc, "an accumulation window")  # (several ranks: no rank replays alone)

    @contextlib.contextmanager
    def _boundary_step(self) -> Iterator[None]:
        """The boundary's optimizer step, run as the optimizer's ops; an out-of-memory error inside it is not
        replayed (the step may already have changed parameters): the window is discarded and
        ``OptimizerStepOutOfMemoryError`` raised (one rank; several ranks: ``_guarded`` fails the window)."""
        with self.runtime.optimizer_phase():
            try:
                yield
            except torch.OutOfMemoryError as exc:
                if not self._replays_alone():
                    raise
                raise self._discard_window(exc, in_step=True) from exc

    def run_window(self, closure: Callable[[], T]) -> T:
        """Run one whole gradient-accumulation window of a plain ``DeepSpeedEngine``, replaying it from its start
        on an out-of-memory error (one rank).

        ``closure`` runs the window's ``gradient_accumulation_steps`` micro-batches, each ``engine(batch)``,
        ``engine.backward(loss)``, ``engine.step()``; its result is returned. On out of memory before the
        boundary's ``engine.step()`` completes, the window is reset (``replay.reset_window``: every accumulated
        gradient and ZeRO partition, ``engine.micro_steps``, the random state), swapping is tightened, and the
        closure runs again, up to ``executor.max_oom_retries`` times, within the same iteration. Fetch the
        micro-batches before the closure: it is re-run as it is.

        Raises:
            torch.OutOfMemoryError: the last retry failed too (the window was discarded; the message says why).
            OptimizerStepOutOfMemoryError: out of memory inside the boundary's optimizer step (not replayed).
            RankOutOfMemoryError: out of memory with several ranks (no rank replays alone).
            RuntimeError: a window is already open (a forward ran outside ``run_window``), or the engine is a
                ``PipelineEngine`` (its ``train_batch`` replays by itself).
        """
        from deepspeed.runtime.pipe.engine import PipelineEngine

        engine = self._engine
        if isinstance(engine, PipelineEngine):
            raise RuntimeError("run_window is for a plain DeepSpeedEngine: PipelineEngine.train_batch replays a "
                               "batch that runs out of memory by itself")
        managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
        if self.open_iteration.active or (managed and engine.micro_steps % engine.gradient_accumulation_steps()):
            raise RuntimeError(f"run_window must start at an accumulation window's start: engine.micro_steps is "
                               f"{engine.micro_steps} with gradient_accumulation_steps "
                               f"{engine.gradient_accumulation_steps()} (a forward ran outside run_window)")
        self._begin()
        result = self._replay(closure)
        if self.open_iteration.active:
            logger.warning("run_window: the closure returned before the window's boundary engine.step(); the "
                           "window stays open and only its part inside run_window could be replayed")
        return result

    def _replay(self, attempt: Callable[[], T], on_retry: Callable[[], None] | None = None) -> T:
        """Run ``attempt`` (a whole window, inside the open iteration) through the runtime's retry loop
        (``Chameleon.retry_out_of_memory``): on out of memory the window is reset to its start and run again."""
        window = self.open_iteration
        self._window_start = WindowStart(self._engine, self.device)

        def reset() -> None:
            reset_window(self._engine, self._window_start)
            self._forwards = self._backwards = 0
            self.profiler.micro_batches.clear()
            if on_retry is not None:
                on_retry()

        self._replaying = True
        try:
            return self.runtime.retry_out_of_memory(
                attempt, reset, on_last=lambda error: self._discard_window(error, final=True))
        except BaseException as exc:
            window.close_failed(exc)  # (nothing to do when the attempt or the last retry closed it already)
            raise
        finally:
            self._replaying, self._window_start = False, None

    def _discard_window(self, exc: torch.OutOfMemoryError, in_step: bool = False,
                        final: bool = False) -> torch.OutOfMemoryError:
        """Reset the window (nothing it accumulated is ever stepped), close its iteration as failed, and return
        the error to raise: ``exc`` after the last replay, else one that says what happened."""
        engine = self._engine
        reset_window(engine, self._window_start)
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if final:
            error = exc
        elif in_step:
            error = OptimizerStepOutOfMemoryError(
                f"{self.coordinates.label}: out of memory in the optimizer step at the accumulation window's "
                f"boundary ({first_line}). The step is not replayed (it may already have changed some "
                "parameters); the window's gradients were discarded. Leave room for the optimizer state: lower "
                "chameleon.memory_budget or raise chameleon.device.capacity.")
        else:
            error = WindowDiscardedOutOfMemoryError(
                f"{self.coordinates.label}: out of memory in micro-batch {max(self._forwards, 1) - 1} of an "
                f"accumulation window ({first_line}). The window was discarded: its gradients were zeroed and "
                f"engine.micro_steps is back at the window's start ({getattr(engine, 'micro_steps', '?')}); the "
                "optimizer did not step and the next window starts clean. Chameleon can replay a window only "
                "when it runs it: call engine.chameleon.run_window(closure) with a closure that runs the "
                "window's micro-batches (forward, engine.backward, engine.step) on batches fetched before it.")
        self.open_iteration.close_failed(error)
        logger.warning("accumulation window discarded after out of memory: %s", str(error).splitlines()[0])
        return error

    def close(self) -> None:
        self.open_iteration.finish()
        self._log_prefix.remove()


def _coordinates(engine: Any) -> RankCoordinates:
    """The rank's place: pipeline stage and data-parallel rank from a ``PipelineEngine``'s grid, else the
    data-parallel rank among ``dp_world_size`` ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    grid = getattr(engine, "grid", None)
    if grid is not None and hasattr(engine, "num_stages"):
        return RankCoordinates(rank=rank, world_size=world_size, pp_rank=int(engine.stage_id),
                               pp_size=int(engine.num_stages), dp_rank=int(grid.get_data_parallel_rank()),
                               dp_size=int(grid.get_data_parallel_world_size()))
    dp_size = int(getattr(engine, "dp_world_size", world_size) or world_size)
    dp_rank = rank % dp_size if dp_size else 0
    return RankCoordinates(rank=rank, world_size=world_size, dp_rank=dp_rank, dp_size=dp_size)


def initialize(*args: Any, **kwargs: Any) -> tuple:
    """``deepspeed.initialize`` with the same arguments and return tuple, plus ``engine.chameleon`` (the rank's
    runtime, or None without an enabled ``"chameleon"`` block).

    Every rank of a multi-rank job must call it, with the same ``"chameleon"`` block (or none on every rank):
    after DeepSpeed's own initialize, each rank compares its settings with every other rank's
    (``rank_agreement``), with Chameleon enabled or not.

    Raises:
        ConfigError: the ``"chameleon"`` block is wrong, naming every key (``chameleon.<setting>``), before
            DeepSpeed builds anything; or the ranks' settings differ (naming each key and the ranks), or some
            rank did not come to the check.
    """
    import deepspeed

    ds_config = deepspeed_config_of(args[0] if args else kwargs.get("args"), kwargs.get("config"),
                                    kwargs.get("config_params"))
    config = config_from_deepspeed(ds_config) if ds_config is not None else ChameleonConfig(enabled=False)
    result = deepspeed.initialize(*args, **kwargs)
    engine = result[0]
    peers = agree_on_settings(config, prefix="chameleon.")  # (every rank: Chameleon on or off alike)
    if not config.enabled:
        engine.chameleon = None
        return result
    install(engine, config, peers=peers)
    return result


def install(engine: Any, config: ChameleonConfig, peers: Peers | None = None) -> DeepSpeedChameleon:
    """Install a runtime with ``config`` on a built engine (``initialize`` does this for an enabled block);
    returns it, also as ``engine.chameleon``. The installed DeepSpeed is checked first (``upstream.py``): outside
    the reviewed version range, or with changed upstream code, ``PatchRefused`` says so and nothing is touched. With ``enabled`` false the runtime only measures: nothing is
    swapped, the device meters every byte and runs out of memory at its capacity (the launchers' runs
    without Chameleon). ``peers``: where the job's ranks run, from ``initialize``'s settings check; without it
    (``install`` called by hand, on every rank) the ranks' settings are compared here (``rank_agreement``), so that
    a failure names a dead peer."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    verify_deepspeed()  # (upstream.py: every DeepSpeed attribute changed below, checked before any is)
    if peers is None:
        peers = agree_on_settings(config, prefix="chameleon.")
    integration = DeepSpeedChameleon(config, _coordinates(engine), peers)
    integration.runtime.attach(engine.module)
    track_engine_buffers(integration.device, engine)  # (what initialize made: a GPU's allocator counts it)
    if engine.zero_optimization_stage() == 3:
        protect_gathered_parameters(integration.executor, engine.module)
    if isinstance(engine, PipelineEngine):
        integration.follow_pipeline(engine)
    else:
        integration.follow(engine)
    engine.chameleon = integration
    logger.info("installed on %s%s", integration.coordinates.label, "" if config.enabled else " (measuring only)")
    return integration
