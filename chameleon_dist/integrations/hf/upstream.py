"""Everything of transformers that ``ChameleonCallback`` relies on beyond the callback API, declared in one place
and checked when training begins (``on_train_begin``), before the callback touches the Trainer.

A ``TrainerCallback`` is given the unwrapped model (``trainer.model``), the optimizer, the scheduler and the data
loaders, but neither the ``Trainer`` nor the DeepSpeed engine it built (``trainer.model_wrapped``), and no event
reports an exception. So the callback finds the Trainer whose ``_inner_training_loop`` called ``on_train_begin``
among the calling frames (``calling_trainer`` in ``callback.py``), reads the engine from it, and wraps that
Trainer's ``_run_epoch`` for the one ``train()`` call, so that an exception anywhere in a step closes the step's
iteration as failed. Each is an :class:`~chameleon_dist.patching.InstanceChange`: the code it relies on is
fingerprinted, and a transformers release outside ``VERSIONS`` or with changed code is refused with one
``PatchRefused`` naming what to re-review.

Importing this module imports no transformers (the records are data).

To update after a transformers release: read the new code of each record's ``relies_on``, adjust ``callback.py``
if needed, widen ``VERSIONS``, and set ``fingerprint`` to ``fingerprint_of_all(relied_on_code(record))``.
"""

from __future__ import annotations

from chameleon_dist.patching import InstanceChange, verify_instance_changes

VERSIONS = ">=5,<6"
"""The transformers releases the records below were reviewed for (the fingerprints are of 5.24.0)."""

_TRAINER = "transformers.trainer:Trainer"
_CALLBACK_PY = "chameleon_dist.integrations.hf.callback"

TRAINER_FOUND_FROM_CALLBACK = InstanceChange(
    name="hf-trainer-found-by-its-callback", owner=_TRAINER,
    attributes=("callback_handler", "model_wrapped", "is_deepspeed_enabled"), how="reads",
    relies_on=(f"{_TRAINER}._inner_training_loop", f"{_TRAINER}._prepare_for_training"),
    package="transformers", versions=VERSIONS,
    why="Callbacks are given trainer.model (the unwrapped model), not the DeepSpeed engine the Trainer built: "
        "on_train_begin finds the Trainer whose _inner_training_loop called it (self.callback_handler."
        "on_train_begin, after _prepare_for_training set model_wrapped) among the calling frames, and installs "
        "on trainer.model_wrapped when is_deepspeed_enabled.",
    remove_when="transformers passes the Trainer (or the wrapped model) to callbacks",
    fingerprint="b8a62bec807a36ae", defined_in=_CALLBACK_PY)

TRAINER_EPOCH_GUARDED = InstanceChange(
    name="hf-trainer-epoch-closes-a-failed-step", owner=_TRAINER, attributes=("_run_epoch",), how="wraps",
    relies_on=(f"{_TRAINER}._inner_training_loop", f"{_TRAINER}._run_epoch"),
    package="transformers", versions=VERSIONS,
    why="No callback event reports an exception: _inner_training_loop calls self._run_epoch after on_train_begin, "
        "and the wrapper (an instance attribute for one train() call; the class is untouched) closes the open "
        "step's iteration as failed when anything in the epoch raises, then re-raises.",
    remove_when="transformers offers an on-exception callback event",
    fingerprint="4f53a96de11b2cb3", defined_in=_CALLBACK_PY)

INSTANCE_CHANGES: tuple[InstanceChange, ...] = (TRAINER_FOUND_FROM_CALLBACK, TRAINER_EPOCH_GUARDED)


def verify_transformers() -> None:
    """Raise ``PatchRefused`` listing every record the installed transformers does not match."""
    verify_instance_changes(INSTANCE_CHANGES)
