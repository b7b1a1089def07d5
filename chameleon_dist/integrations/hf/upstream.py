"""Everything of transformers that ``ChameleonCallback`` relies on beyond the callback API, declared in one place
and checked when training begins (``on_train_begin``), before the callback touches the Trainer.

A ``TrainerCallback`` is given the unwrapped model (``trainer.model``), the optimizer, the scheduler and the data
loaders, but neither the ``Trainer`` nor the DeepSpeed engine it built (``trainer.model_wrapped``), and no event
reports an exception. So the callback finds the Trainer whose ``_inner_training_loop`` called ``on_train_begin``
among the calling frames (``calling_trainer`` in ``callback.py``), reads the engine from it, and wraps that
Trainer's ``_run_epoch`` for the one ``train()`` call, so that an exception anywhere in a step closes the step's
iteration as failed. Each is an :class:`~chameleon_dist.patching.InstanceChange`: the code it relies on is
fingerprinted, and a transformers release outside the reviewed ones or with changed code is refused with one
``PatchRefused`` naming what to re-review.

The relied-on code changes between releases for reasons that do not touch what the callback needs, so each change
is reviewed per release group: each :class:`ReviewedChange` holds the groups (a version range each) whose code was
read and the fingerprint of that code there. ``INSTANCE_CHANGES`` holds one record per change, the one of the group the
installed transformers falls in (found from its metadata; importing this module imports no transformers). A
release in no group gets a record over the whole reviewed range, so the refusal names that range.

Reviewed (every 5.x release from 5.17.0 to 5.25.0, read from the wheels): ``_inner_training_loop`` calls
``_prepare_for_training`` (which sets ``model_wrapped``, the DeepSpeed engine under DeepSpeed), then
``callback_handler.on_train_begin``, then ``self._run_epoch`` once per epoch (looked up on the instance, so the
wrapper is the one called), and ``_run_epoch`` raises what a step raises. What differs between the groups: 5.19
records ``_initial_global_step`` in the loop and adds a branch for models distributed at load time to
``_prepare_for_training``; 5.23 adds an FSDP gradient-reduction context to ``_run_epoch``; 5.24 reshards FSDP2
modules before creating the optimizer; 5.25 refuses DeepSpeed sequence parallelism with ZeRO-3 on old DeepSpeed and
resumes data loaders through ``get_resumed_dataloader``. None moves the calls, the attributes or the order above.

To update after a transformers release: read the new code of each record's ``relies_on``, adjust ``callback.py``
if needed, and add a group to its ``ReviewedChange`` whose fingerprint is ``fingerprint_of_all(relied_on_code(record))`` on
that release (``tests/test_hf_upstream.py`` checks the groups are contiguous and disjoint).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from chameleon_dist.patching import InstanceChange, verify_instance_changes

PACKAGE = "transformers"
REVIEWED_RANGE = ">=5.17,<6"
"""Every transformers release some group below was reviewed for (the newest group is open up to 6: a later 5.x
whose relied-on code is unchanged passes, one whose code changed is refused by its fingerprint)."""

_TRAINER = "transformers.trainer:Trainer"
_CALLBACK_PY = "chameleon_dist.integrations.hf.callback"


@dataclasses.dataclass(frozen=True)
class ReviewedChange:
    """One change on Trainer objects and the release groups it was reviewed for: ``groups`` holds (version range,
    ``fingerprint_of_all`` of the ``relies_on`` code in that range), oldest first."""

    name: str
    attributes: tuple[str, ...]
    how: str
    relies_on: tuple[str, ...]
    why: str
    remove_when: str
    groups: tuple[tuple[str, str], ...]

    def record(self, versions: str, fingerprint: str) -> InstanceChange:
        return InstanceChange(name=self.name, owner=_TRAINER, attributes=self.attributes, how=self.how,
                              relies_on=self.relies_on, package=PACKAGE, versions=versions, why=self.why,
                              remove_when=self.remove_when, fingerprint=fingerprint, defined_in=_CALLBACK_PY)

    def records(self) -> tuple[InstanceChange, ...]:
        """One record per reviewed release group."""
        return tuple(self.record(versions, fingerprint) for versions, fingerprint in self.groups)

    def for_version(self, version: str | None) -> InstanceChange:
        """The record for transformers ``version``: its group's, or (a version in no group, or none installed) one
        over ``REVIEWED_RANGE`` with the newest group's fingerprint, which the version check refuses."""
        try:
            parsed = Version(version) if version is not None else None
        except InvalidVersion:
            parsed = None
        for versions, fingerprint in self.groups:
            if parsed is not None and SpecifierSet(versions).contains(parsed, prereleases=True):
                return self.record(versions, fingerprint)
        return self.record(REVIEWED_RANGE, self.groups[-1][1])


FOUND_FROM_CALLBACK = ReviewedChange(
    name="hf-trainer-found-by-its-callback",
    attributes=("callback_handler", "model_wrapped", "is_deepspeed_enabled"), how="reads",
    relies_on=(f"{_TRAINER}._inner_training_loop", f"{_TRAINER}._prepare_for_training"),
    why="Callbacks are given trainer.model (the unwrapped model), not the DeepSpeed engine the Trainer built: "
        "on_train_begin finds the Trainer whose _inner_training_loop called it (self.callback_handler."
        "on_train_begin, after _prepare_for_training set model_wrapped) among the calling frames, and installs "
        "on trainer.model_wrapped when is_deepspeed_enabled.",
    remove_when="transformers passes the Trainer (or the wrapped model) to callbacks",
    groups=((">=5.17,<5.19", "6a3b3a4fb7afa2cb"),  # 5.17.0, 5.18.0
            (">=5.19,<5.24", "b57757ad67c888bb"),  # 5.19.0 to 5.23.0
            (">=5.24,<5.25", "b8a62bec807a36ae"),  # 5.24.0
            (">=5.25,<6", "885d07a9169a80a6")))  # 5.25.0

EPOCH_GUARDED = ReviewedChange(
    name="hf-trainer-epoch-closes-a-failed-step", attributes=("_run_epoch",), how="wraps",
    relies_on=(f"{_TRAINER}._inner_training_loop", f"{_TRAINER}._run_epoch"),
    why="No callback event reports an exception: _inner_training_loop calls self._run_epoch after on_train_begin, "
        "and the wrapper (an instance attribute for one train() call; the class is untouched) closes the open "
        "step's iteration as failed when anything in the epoch raises, then re-raises.",
    remove_when="transformers offers an on-exception callback event",
    groups=((">=5.17,<5.19", "80e6f54a901ca3e7"),  # 5.17.0, 5.18.0
            (">=5.19,<5.23", "d1494aa1e5a7e0b1"),  # 5.19.0 to 5.22.2
            (">=5.23,<5.25", "4f53a96de11b2cb3"),  # 5.23.0, 5.24.0
            (">=5.25,<6", "2005a3d84f1491c5")))  # 5.25.0

REVIEWED_CHANGES: tuple[ReviewedChange, ...] = (FOUND_FROM_CALLBACK, EPOCH_GUARDED)


def records_for(version: str | None) -> tuple[InstanceChange, ...]:
    """The record of each change for transformers ``version``."""
    return tuple(change.for_version(version) for change in REVIEWED_CHANGES)


def installed_transformers() -> str | None:
    """The installed transformers' version (from its metadata: nothing is imported), or None."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


INSTANCE_CHANGES: tuple[InstanceChange, ...] = records_for(installed_transformers())
"""The records for the installed transformers (what ``verify_transformers`` checks)."""
TRAINER_FOUND_FROM_CALLBACK, TRAINER_EPOCH_GUARDED = INSTANCE_CHANGES


def verify_transformers() -> None:
    """Raise ``PatchRefused`` listing every record the installed transformers does not match."""
    verify_instance_changes(INSTANCE_CHANGES)
