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
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist

from chameleon_dist.config import ChameleonConfig
from chameleon_dist.config.loaders import config_from_deepspeed
from chameleon_dist.ranks import RankCoordinates, RankLogPrefix, RankOutOfMemoryError
from chameleon_dist.runtime import Chameleon

logger = logging.getLogger(__name__)


def deepspeed_config_of(args: Any = None, config: Any = None, config_params: Any = None) -> Any:
    """The DeepSpeed config ``deepspeed.initialize`` will read: ``config``, else ``config_params``, else
    ``args.deepspeed_config`` (a dict or a path to its JSON); None when there is none."""
    for candidate in (config, config_params, getattr(args, "deepspeed_config", None) if args is not None else None):
        if candidate is not None:
            return candidate
    return None


class DeepSpeedChameleon(Chameleon):
    """The rank's runtime plus the hooks on one ``DeepSpeedEngine`` (``engine.chameleon``)."""

    def __init__(self, config: ChameleonConfig, coordinates: RankCoordinates) -> None:
        super().__init__(config, coordinates=coordinates)
        self._log_prefix = RankLogPrefix(coordinates).install()
        self._open = None  # the iteration of the current accumulation window
        self._forwards = 0
        self._backwards = 0

    def follow(self, engine: Any) -> Any:
        """Wrap ``engine.forward``, ``engine.backward`` and ``engine.step`` (instance attributes; the class is
        untouched) so that each accumulation window is one iteration."""
        forward, backward, step = engine.forward, engine.backward, engine.step
        clock = self.profiler.micro_batches

        @functools.wraps(forward)
        def forwarding(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)  # evaluation: not part of an iteration
            if self._open is None:
                self._begin()
            clock.enter(self._forwards)
            self._forwards += 1
            return self._guarded(forward, args, kwargs)

        @functools.wraps(backward)
        def backwarding(*args: Any, **kwargs: Any) -> Any:
            if self._open is None:
                return backward(*args, **kwargs)
            clock.enter(self._backwards)
            self._backwards += 1
            return self._guarded(backward, args, kwargs)

        @functools.wraps(step)
        def stepping(*args: Any, **kwargs: Any) -> Any:
            if self._open is None or not engine.is_gradient_accumulation_boundary():
                return step(*args, **kwargs)
            with self.optimizer_phase():
                result = self._guarded(step, args, kwargs)
            self._finish()
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

        def counted(original: Any, backward: bool) -> Any:
            def run(engine_self: Any, *args: Any, **kwargs: Any) -> Any:
                if self._open is not None:
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
                with self.optimizer_phase():
                    return original(engine_self, *args, **kwargs)

            return run

        instructions = dict(type(engine)._INSTRUCTION_MAP)
        instructions[schedule.ForwardPass] = counted(instructions[schedule.ForwardPass], backward=False)
        instructions[schedule.BackwardPass] = counted(instructions[schedule.BackwardPass], backward=True)
        instructions[schedule.OptimizerStep] = stepping(instructions[schedule.OptimizerStep])
        engine._INSTRUCTION_MAP = instructions
        train_batch = engine.train_batch

        @functools.wraps(train_batch)
        def training(*args: Any, **kwargs: Any) -> Any:
            self._begin()
            result = self._guarded(train_batch, args, kwargs)
            self._finish()
            return result

        engine.train_batch = training
        return engine

    def _begin(self) -> None:
        opened = self.iteration()
        opened.__enter__()
        self._open, self._forwards, self._backwards = opened, 0, 0

    def _finish(self) -> None:
        opened, self._open = self._open, None
        if opened is not None:
            opened.__exit__(None, None, None)

    def _guarded(self, call: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            opened, self._open = self._open, None
            if opened is not None:
                opened.__exit__(type(exc), exc, exc.__traceback__)
            if isinstance(exc, torch.OutOfMemoryError) and self.coordinates.world_size > 1:
                raise RankOutOfMemoryError(
                    f"{self.coordinates.label}: out of memory ({str(exc).splitlines()[0]}). A rank of a multi-rank job "
                    "cannot replay its accumulation window alone: this rank stops and the launcher ends the others. "
                    "Raise the device capacity (chameleon.device.capacity) or lower chameleon.memory_budget."
                ) from exc
            raise

    def close(self) -> None:
        self._finish()
        self._log_prefix.remove()


def _coordinates(engine: Any) -> RankCoordinates:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    dp_size = int(getattr(engine, "dp_world_size", world_size) or world_size)
    dp_rank = rank % dp_size if dp_size else 0
    return RankCoordinates(rank=rank, world_size=world_size, dp_rank=dp_rank, dp_size=dp_size)


def initialize(*args: Any, **kwargs: Any) -> tuple:
    """``deepspeed.initialize`` with the same arguments and return tuple, plus ``engine.chameleon`` (the rank's
    runtime, or None without an enabled ``"chameleon"`` block).

    Raises:
        ConfigError: the ``"chameleon"`` block is wrong, naming every key (``chameleon.<setting>``), before
            DeepSpeed builds anything.
    """
    import deepspeed

    ds_config = deepspeed_config_of(args[0] if args else kwargs.get("args"), kwargs.get("config"),
                                    kwargs.get("config_params"))
    config = config_from_deepspeed(ds_config) if ds_config is not None else ChameleonConfig(enabled=False)
    result = deepspeed.initialize(*args, **kwargs)
    engine = result[0]
    if not config.enabled:
        engine.chameleon = None
        return result
    install(engine, config)
    return result


def install(engine: Any, config: ChameleonConfig) -> DeepSpeedChameleon:
    """Install a runtime with ``config`` on a built engine (``initialize`` does this for an enabled block);
    returns it, also as ``engine.chameleon``. With ``enabled`` false the runtime only measures: nothing is
    swapped, the device meters every byte and runs out of memory at its capacity (the launchers' runs
    without Chameleon)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    runtime = DeepSpeedChameleon(config, _coordinates(engine))
    runtime.attach(engine.module)
    runtime.follow_pipeline(engine) if isinstance(engine, PipelineEngine) else runtime.follow(engine)
    engine.chameleon = runtime
    logger.info("installed on %s%s", runtime.coordinates.label, "" if config.enabled else " (measuring only)")
    return runtime
