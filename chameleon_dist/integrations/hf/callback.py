"""``ChameleonCallback``: Chameleon under the Hugging Face ``Trainer``, one iteration per optimizer step.

A ``Trainer`` user adds three lines::

    from chameleon_dist.integrations.hf import ChameleonCallback
    callback = ChameleonCallback({"memory_budget": 0.9})    # or None: the DeepSpeed config's "chameleon" block
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])

``trainer.train()`` then runs every optimizer step as one iteration of the rank's runtime (``callback.chameleon``,
with ``last_report`` after each step).

- **Plain Trainer.** At ``on_train_begin`` the runtime attaches the model the Trainer trains; each step's
  iteration opens at ``on_step_begin`` (before the first micro-batch of the accumulation window) and closes at
  ``on_step_end`` (after the optimizer step, the scheduler step and ``zero_grad``); the optimizer step
  (``on_pre_optimizer_step`` to ``on_optimizer_step``) runs as the runtime's optimizer phase. A short last window
  of an epoch is one iteration too. ``callback.chameleon`` is a ``TrainerChameleon``.
- **DeepSpeed** (``TrainingArguments(deepspeed=...)``). The runtime is installed on the engine the Trainer built
  (``chameleon_dist.integrations.deepspeed.engine.install``), so each accumulation window is one iteration exactly
  as for ``engine(batch)`` / ``engine.backward`` / ``engine.step`` (which is what the Trainer calls: Accelerate's
  ``backward`` calls the engine's ``backward`` and, at the window's boundary, its ``step``). ``callback.chameleon``
  is the engine's ``DeepSpeedChameleon`` (``engine.chameleon``). ``config=None`` reads the ``"chameleon"`` block of
  the DeepSpeed config the Trainer runs with; without the block (or with ``"enabled": false``) nothing is
  installed and ``callback.chameleon`` stays None.
- Evaluation and prediction (no gradients) run between steps and are no iteration.

**Out of memory is not retried inside the Trainer.** ``Chameleon.run_iteration`` retries an iteration by running
its closure again; the Trainer's loop cannot be run again from a step's start (the step's batches are consumed
and earlier micro-batches' gradients already accumulated). Passive swap still absorbs pressure inside an op; an
out-of-memory error that escapes it closes the step's iteration as failed (``last_report.failed``) and
``train()`` raises ``TrainerStepOutOfMemoryError`` (a ``torch.OutOfMemoryError``) naming the settings to change:
the device capacity, a lower ``memory_budget`` or ``min_swap_bytes``, a smaller ``per_device_train_batch_size``
(with a larger ``gradient_accumulation_steps`` for the same batch), or a loop of your own with
``run_iteration``. Any other exception inside a step closes its iteration as failed too and propagates as it is.

Callbacks are given neither the Trainer nor the engine it built, and no event reports an exception: what the
callback reads of the Trainer and wraps on it for one ``train()`` call is declared in ``upstream.py`` and checked
at ``on_train_begin``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback  # (chameleon_dist.integrations.hf imports this module on first use)

from chameleon_dist.config import ChameleonConfig, load_config
from chameleon_dist.config.loaders import config_from_deepspeed
from chameleon_dist.integrations.held_runtime import HeldRuntime
from chameleon_dist.integrations.hf.upstream import verify_transformers
from chameleon_dist.integrations.open_iteration import SettingNames
from chameleon_dist.runtime import Chameleon

if TYPE_CHECKING:
    from transformers import Trainer

logger = logging.getLogger(__name__)

TRAINER_SETTINGS = SettingNames(enable="enabled: true")
CALLER_FRAMES = 8
"""How far up the stack ``calling_trainer`` looks (on_train_begin is three frames below ``_inner_training_loop``)."""


class TrainerStepOutOfMemoryError(torch.OutOfMemoryError):
    """Out of memory in an optimizer step run by the Trainer: the step's iteration was closed as failed and the
    step is not retried (``train()`` stops)."""


class StepAbandonedError(RuntimeError):
    """Why an iteration was closed as failed when its step ended without an exception and without ``on_step_end``
    (a callback stopped training inside an accumulation window)."""


def calling_trainer() -> Trainer | None:
    """The ``Trainer`` whose training loop is running this callback event, found among the calling frames (callbacks
    are not given it; ``upstream.py``), or None."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(CALLER_FRAMES):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
        return None
    finally:
        del frame


class TrainerChameleon(HeldRuntime):
    """The runtime under a plain ``Trainer`` (``callback.chameleon``) and the iteration of the step in progress."""

    def __init__(self, runtime: Chameleon) -> None:
        super().__init__(runtime, TRAINER_SETTINGS)
        self._optimizer_phase: contextlib.AbstractContextManager | None = None

    def begin_step(self) -> None:
        if self.open_iteration.active:  # (the epoch guard closes a failed step; this is a step that just vanished)
            self.fail(StepAbandonedError("a new optimizer step began before the previous one reached on_step_end"))
        self.open_iteration.begin()

    def begin_optimizer_step(self) -> None:
        if self.open_iteration.active and self._optimizer_phase is None:
            phase = self.runtime.optimizer_phase()
            phase.__enter__()
            self._optimizer_phase = phase

    def end_optimizer_step(self) -> None:
        phase, self._optimizer_phase = self._optimizer_phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def end_step(self) -> None:
        self.end_optimizer_step()
        self.open_iteration.finish()

    def fail(self, exc: BaseException) -> None:
        """Close the step's iteration, if one is open, as failed by ``exc`` (not raised here)."""
        self.end_optimizer_step()
        self.open_iteration.close_failed(exc)


class ChameleonCallback(TrainerCallback):
    """Runs each optimizer step of ``Trainer.train()`` as one Chameleon iteration (module docstring).

    Args:
        config: a ``ChameleonConfig``, a dict, or a YAML/JSON path, as ``Chameleon`` takes it (with ``enabled:
            false`` the runtime only measures: nothing is swapped, the device meters every byte and runs out of
            memory at its capacity); or None: under DeepSpeed the ``"chameleon"`` block of the Trainer's DeepSpeed
            config, else the defaults.

    ``chameleon``: the runtime's holder once training began (``last_report``, ``stage``, ``runtime``, ...): a
    ``TrainerChameleon``, or under DeepSpeed the engine's ``DeepSpeedChameleon``; None before ``train()``, and under
    DeepSpeed when the block is missing or disabled.

    Raises (from ``train()``):
        TrainerStepOutOfMemoryError: out of memory inside a step (not retried; the message says what to change).
        ConfigError: the config or the DeepSpeed config's block is wrong, naming every setting.
        PatchRefused: the installed transformers (or DeepSpeed) is not one the integration was reviewed for.
    """

    def __init__(self, config: ChameleonConfig | dict | str | None = None) -> None:
        self._config = None if config is None else load_config(config)  # errors now, naming every setting
        self.chameleon: Any = None
        self._names = TRAINER_SETTINGS
        self._step = 0  # the optimizer step in progress (numbered as the Trainer's global step), 0 between steps
        self._guarded: tuple[Trainer, bool, Any] | None = None  # (trainer, had its own _run_epoch, that one)

    # -- events -----------------------------------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        ds_config = _deepspeed_config_of(args)
        if self._config is None and ds_config is not None:
            config_from_deepspeed(ds_config)  # a wrong block is an error before training

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        verify_transformers()  # (upstream.py: what is read of the Trainer and wrapped on it, checked first)
        trainer = calling_trainer()
        if trainer is None:
            raise RuntimeError("ChameleonCallback runs under transformers.Trainer.train(): no Trainer was found "
                               "calling on_train_begin (pass the callback to Trainer(callbacks=[...]))")
        if trainer.is_deepspeed_enabled:
            self.chameleon = self._install_on_engine(trainer.model_wrapped, args)
        else:
            if not isinstance(self.chameleon, TrainerChameleon):  # (a later train() keeps the runtime and stage)
                self.chameleon = TrainerChameleon(Chameleon(self._config))
            self.chameleon.runtime.attach(model)
        if self.chameleon is not None:
            self._guard_epochs(trainer)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step + 1
        if isinstance(self.chameleon, TrainerChameleon):
            self.chameleon.begin_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if isinstance(self.chameleon, TrainerChameleon):
            self.chameleon.begin_optimizer_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if isinstance(self.chameleon, TrainerChameleon):
            self.chameleon.end_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        self._step = 0
        if isinstance(self.chameleon, TrainerChameleon):
            self.chameleon.end_step()

    def on_epoch_end(self, args, state, control, **kwargs):
        self._abandon_open_step("training stopped inside an accumulation window (no optimizer step)")

    def on_train_end(self, args, state, control, **kwargs):
        self._abandon_open_step("training ended inside an accumulation window (no optimizer step)")
        self._unguard_epochs()
        self._release_engine_integration()

    # -- helpers ----------------------------------------------------------------------------------------------

    def _install_on_engine(self, engine: Any, args: Any) -> Any:
        from chameleon_dist.integrations.deepspeed.engine import DEEPSPEED_SETTINGS, install

        existing = getattr(engine, "chameleon", None)
        if existing is not None:  # (installed by an earlier train() on this engine)
            return existing
        config = self._config
        if config is None:
            ds_config = _deepspeed_config_of(args)
            config = config_from_deepspeed(ds_config) if ds_config is not None else ChameleonConfig(enabled=False)
            if not config.enabled:
                logger.info("the Trainer's DeepSpeed config has no enabled \"chameleon\" block: nothing installed")
                return None
            self._names = DEEPSPEED_SETTINGS
        return install(engine, config)

    def _guard_epochs(self, trainer: Trainer) -> None:
        """Wrap ``trainer._run_epoch`` for this ``train()`` call: an exception inside a step closes the step's
        iteration as failed (no callback event reports one). A wrapper left by a ``train()`` that raised outside its
        epochs is removed first."""
        self._unguard_epochs()
        own = vars(trainer).get("_run_epoch")
        run_epoch = trainer._run_epoch

        @functools.wraps(run_epoch)
        def guarded_epoch(*args: Any, **kwargs: Any) -> Any:
            try:
                return run_epoch(*args, **kwargs)
            except Exception as exc:
                self._unguard_epochs()
                error = self._step_failed(exc)
                self._release_engine_integration()
                if error is exc:
                    raise
                raise error from exc

        self._guarded = (trainer, own is not None, own)
        trainer._run_epoch = guarded_epoch

    def _release_engine_integration(self) -> None:
        """Under DeepSpeed, when ``train()`` ends (or fails): the engine's integration lets go of what it installed
        for the process (its rank prefix on chameleon-dist's loggers); its hooks and reports stay."""
        if self.chameleon is not None and not isinstance(self.chameleon, TrainerChameleon):
            self.chameleon.close()

    def _unguard_epochs(self) -> None:
        guarded, self._guarded = self._guarded, None
        if guarded is None:
            return
        trainer, had_own, own = guarded
        if had_own:
            trainer._run_epoch = own
        else:
            vars(trainer).pop("_run_epoch", None)

    def _step_failed(self, exc: Exception) -> Exception:
        """Close the failed step's iteration (if the engine integration has not already) and return the error to
        raise: for an out-of-memory error inside a step one that says it is not retried and what to change."""
        step, self._step = self._step, 0
        held = self.chameleon
        if held is None or not step:
            return exc
        if isinstance(held, TrainerChameleon):
            held.fail(exc)
        else:
            held.open_iteration.close_failed(exc)
        if not isinstance(exc, torch.OutOfMemoryError):
            return exc
        names = self._names
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        remedy = (f"Passive swap could not make room either: raise the device capacity ({names.capacity}), lower "
                  f"{names.budget} or {names.min_swap} so that more is swapped, or lower per_device_train_batch_size "
                  "(a larger gradient_accumulation_steps keeps the batch); a loop of your own with "
                  "Chameleon.run_iteration retries an out-of-memory step instead" if held.config.enabled else
                  f"Chameleon only measures here (enabled: false): turn it on ({names.enable}) or raise the device "
                  f"capacity ({names.capacity})")
        where = f"{held.coordinates.label}: " if held.coordinates is not None else ""
        message = (f"{where}out of memory in optimizer step {step} of the Trainer ({detail}). Chameleon does not "
                   "retry a step inside the Trainer (its loop cannot run a step again from the start: the batches are "
                   "consumed and earlier micro-batches' gradients accumulated); the step's iteration was closed as "
                   f"failed. {remedy}.")
        logger.error("%s", message)
        return TrainerStepOutOfMemoryError(message)

    def _abandon_open_step(self, reason: str) -> None:
        self._step = 0
        if isinstance(self.chameleon, TrainerChameleon) and self.chameleon.open_iteration.active:
            logger.warning("%s: the open iteration is closed as failed", reason)
            self.chameleon.fail(StepAbandonedError(reason))


def _deepspeed_config_of(args: Any) -> Any:
    """The DeepSpeed config the Trainer runs with: the one it finalized (``args.hf_deepspeed_config``), else
    ``args.deepspeed`` (a dict or a path), else None."""
    finalized = getattr(args, "hf_deepspeed_config", None)
    if finalized is not None and isinstance(getattr(finalized, "config", None), dict):
        return finalized.config
    return getattr(args, "deepspeed", None) or None
