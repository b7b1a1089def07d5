"""Adapt a Megatron-LM training script (``pretrain_gpt.py`` and its siblings) with one call at its top::

    from chameleon_dist.integrations.megatron.lm_adaptor import adapt
    adapt()

``adapt()`` checks the Megatron-LM it finds against the one reviewed (``REVIEWED_TAG``), then applies three
patches to Megatron-LM's ``megatron.training`` (``LM_PATCHES``) for the life of the process (or until
``close()`` on what it returns): the ``--chameleon-*`` arguments are chained to whatever ``extra_args_provider``
the script passes to ``pretrain``; after ``setup_model_and_optimizer`` has built the model chunks and the
optimizer (and loaded a checkpoint), the rank's runtime is installed on them (``install``); every
``forward_backward_func`` that ``train`` and ``evaluate`` get is wrapped (evaluation calls, ``forward_only=True``,
pass through). Without any ``--chameleon-*`` flag, or with ``--no-chameleon``, nothing is installed and the
functions Megatron-LM gets are its own. Importing this module patches nothing and imports no Megatron.

NOTE [Why these patch points]
``pretrain`` is not patched: ``pretrain_gpt.py`` imports it by name from ``megatron.training`` (and may wrap it for
in-process restart) before ``adapt()`` could run, so a patch of it would depend on where the script puts the call.
The three targets are names that Megatron-LM's own functions look up in their module's globals *when they run*, so
``adapt()`` works anywhere before ``pretrain(...)`` is called:
- ``megatron.training.initialize:parse_args`` (the name ``initialize_megatron`` calls first, before it touches
  ``torch.distributed``): the wrapper chains ``add_megatron_args`` after the script's provider and checks the parsed
  flags at once, so a bad ``--chameleon-*`` value or an unsupported combination (CUDA graphs) is an error before any
  process group exists. ``initialize_megatron`` itself is not patched: it parses and then initialises distributed in
  one call, too late for the check.
- ``megatron.training.training:setup_model_and_optimizer``: its result is the model chunks (DDP-wrapped), the
  optimizer and the scheduler, after a checkpoint was loaded; ``pretrain`` calls it once, before ``train``. Patching
  ``get_model`` would come before the optimizer exists; ``train_step`` would come after ``train`` already took its
  ``forward_backward_func``.
- ``megatron.training.training:get_forward_backward_func`` (megatron-core's function, imported into training.py):
  ``train`` calls it once and ``evaluate`` once per evaluation; the wrapper returns ``MegatronChameleon.wrap`` of its
  result. Wrapping ``train_step``'s ``forward_backward_func`` argument would cover training only; the one name that
  both ``train`` and ``evaluate`` read is this one, so evaluation passes through the same ``wrap``.
The installed runtime wraps ``optimizer.step`` on the optimizer object (``watch_step``): declared as an
``InstanceChange`` (``LM_INSTANCE_CHANGES``) whose fingerprint covers the callers the adaptor relies on (``pretrain``
calls setup then ``train``; ``train_step`` calls the schedule then ``optimizer.step()`` once; ``evaluate`` passes
``forward_only=True``; ``initialize_megatron`` parses before it initialises distributed).

Megatron-LM is not on the package registry; its version is that of the ``megatron.core`` beside its
``megatron.training`` (``megatron/core/package_info.py``, the file Megatron-LM's own build reads).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from chameleon_dist.config import ChameleonConfig
from chameleon_dist.config.errors import ConfigError
from chameleon_dist.integrations.rank_agreement import agree_on_settings
from chameleon_dist.config.megatron_args import CONFIG_DEST, OVERRIDES, add_megatron_args, chain_extra_args, \
    config_from_megatron_args
from chameleon_dist.patching import InstanceChange, Patch, PatchRefused, PatchSet, apply_patches, upstream_original, \
    unbound_replacement, verify_instance_changes, verify_patches

logger = logging.getLogger(__name__)

_NEEDS = "an adaptor: use adapt() (or MegatronLMAdaptor(...).apply())"
"""What this module's Patch records need before they apply (``unbound_replacement``)."""

REVIEWED_TAG = "core_v0.16.1"
REVIEWED_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"
REVIEWED_VERSION = "0.16.1"
ALSO_REVIEWED = "core_v0.16.0 (3bec9aa97dda898d16ff5a89bac0ed2b6682b172), whose megatron/training is identical"
VERSIONS = ">=0.16,<0.17"
VERSION_MODULE = "megatron.core.package_info"
TRAINING_MODULE = "megatron.training.training"
_REVIEWED = f"Megatron-LM {REVIEWED_TAG} (commit {REVIEWED_COMMIT[:12]}, megatron-core {REVIEWED_VERSION})"
_REMOVE_WHEN = ("Megatron-LM's pretrain() takes a callback after the model and optimizer are built and a schedule "
                "wrapper")


PARSE_ARGS_ADDS_FLAGS = Patch(
    name="megatron-lm-parse-args-adds-chameleon-flags",
    target="megatron.training.initialize:parse_args",
    package="megatron-core",
    versions=VERSIONS,
    why=(f"Reviewed against {_REVIEWED}. initialize_megatron parses the arguments through this name before it "
         "initialises torch.distributed; the wrapper chains add_megatron_args after the script's extra_args_provider "
         "and checks the --chameleon-* flags (values, CUDA graphs) before any process group exists."),
    remove_when=_REMOVE_WHEN,
    fingerprint="81ee542d990f51d2",
    make_replacement=unbound_replacement("megatron-lm-parse-args-adds-chameleon-flags", _NEEDS),
)

SETUP_INSTALLS_RUNTIME = Patch(
    name="megatron-lm-setup-installs-chameleon",
    target="megatron.training.training:setup_model_and_optimizer",
    package="megatron-core",
    versions=VERSIONS,
    why=(f"Reviewed against {_REVIEWED}. pretrain calls it once, before train; it returns the DDP-wrapped model "
         "chunks, the optimizer and the scheduler after a checkpoint was loaded. When the flags ask for Chameleon, "
         "the wrapper installs the rank's runtime on the chunks with the optimizer; else it returns untouched."),
    remove_when=_REMOVE_WHEN,
    fingerprint="60833c248314e8ad",
    make_replacement=unbound_replacement("megatron-lm-setup-installs-chameleon", _NEEDS),
)

FORWARD_BACKWARD_WRAPPED = Patch(
    name="megatron-lm-forward-backward-wrapped",
    target="megatron.training.training:get_forward_backward_func",
    package="megatron-core",
    versions=VERSIONS,
    why=(f"Reviewed against {_REVIEWED}. train and evaluate take their schedule from this name (megatron-core's "
         "function imported into training.py); with a runtime installed the wrapper returns MegatronChameleon.wrap "
         "of it (forward_only calls pass through), else the schedule itself."),
    remove_when=_REMOVE_WHEN,
    fingerprint="107cdfb6f221dc4f",
    make_replacement=unbound_replacement("megatron-lm-forward-backward-wrapped", _NEEDS),
)

LM_PATCHES: tuple[Patch, ...] = (PARSE_ARGS_ADDS_FLAGS, SETUP_INSTALLS_RUNTIME, FORWARD_BACKWARD_WRAPPED)

OPTIMIZER_STEP_CLOSES_ITERATION = InstanceChange(
    name="megatron-lm-optimizer-step-closes-iteration",
    owner="megatron.core.optimizer.optimizer:MegatronOptimizer",
    attributes=("step",),
    how="wraps",
    relies_on=("megatron.training.training:pretrain", "megatron.training.training:train",
               "megatron.training.training:train_step", "megatron.training.training:evaluate",
               "megatron.training.initialize:initialize_megatron"),
    package="megatron-core",
    versions=VERSIONS,
    why=(f"Reviewed against {_REVIEWED}. install(optimizer=...) wraps step on the optimizer setup_model_and_optimizer "
         "built (MegatronChameleon.watch_step): one train_step (the schedule call, then optimizer.step() once) is one "
         "iteration. Relies on pretrain calling setup then train, train and evaluate taking "
         "get_forward_backward_func(), evaluate passing forward_only=True, and initialize_megatron parsing before it "
         "initialises distributed."),
    remove_when=_REMOVE_WHEN,
    fingerprint="8f50d50c4fac5611",
    defined_in="chameleon_dist/integrations/megatron/install.py",
)

LM_INSTANCE_CHANGES: tuple[InstanceChange, ...] = (OPTIMIZER_STEP_CLOSES_ITERATION,)

CUDA_GRAPH_FLAGS = (("cuda_graph_impl", "--cuda-graph-impl"), ("enable_cuda_graph", "--enable-cuda-graph"),
                    ("external_cuda_graph", "--external-cuda-graph"))


def requested_config(args: argparse.Namespace) -> ChameleonConfig | None:
    """The Chameleon config the parsed arguments ask for, or None: no ``--chameleon-*`` flag was given, or the result
    is disabled (``--no-chameleon``, or ``enabled: false`` in the file). Bad values raise ``ConfigError``."""
    dests = (CONFIG_DEST, *(dest for _flag, dest, _setting in OVERRIDES))
    if all(getattr(args, dest, None) is None for dest in dests):
        return None
    config = config_from_megatron_args(args)
    return config if config.enabled else None


def _cuda_graph_flags(args: argparse.Namespace) -> list[str]:
    found = []
    for dest, flag in CUDA_GRAPH_FLAGS:
        value = getattr(args, dest, None)
        if value not in (None, False, "none"):
            found.append(flag if value is True else f"{flag} {value}")
    return found


def megatron_lm_version() -> tuple[str | None, str]:
    """(version, where): Megatron-LM's version from ``megatron/core/package_info.py``, or None and why not."""
    try:
        info = importlib.import_module(VERSION_MODULE)
    except ImportError as exc:
        return None, f"{VERSION_MODULE} cannot be imported ({type(exc).__name__}: {exc})"
    return getattr(info, "__version__", None), getattr(info, "__file__", VERSION_MODULE)


def version_problem() -> str | None:
    """Why the Megatron-LM found is not the one reviewed (naming both), or None when it is."""
    found, where = megatron_lm_version()
    try:
        inside = found is not None and SpecifierSet(VERSIONS).contains(Version(found), prereleases=True)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (f"Megatron-LM {found or '(no version found)'} ({where}) is not the version the chameleon-dist adaptor was "
            f"reviewed for: {_REVIEWED}; also {ALSO_REVIEWED}; supported {VERSIONS}. Run a Megatron-LM checkout of "
            f"{REVIEWED_TAG} (git checkout {REVIEWED_TAG}), or re-review the patches in {__name__} against {found} and "
            "update REVIEWED_TAG, VERSIONS and the fingerprints")


def _parse_args_replacement(original: Any, adaptor: MegatronLMAdaptor) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def parse_args(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = chain_extra_args(bound.arguments.get("extra_args_provider"),
                                                                  add_megatron_args)
        parsed = original(*bound.args, **bound.kwargs)
        adaptor.check_arguments(parsed)
        return parsed

    return parse_args


def _setup_replacement(original: Any, adaptor: MegatronLMAdaptor) -> Any:
    get_args = original.__globals__["get_args"]  # training.py's own accessor of the parsed arguments

    @functools.wraps(original)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, opt_param_scheduler = original(*args, **kwargs)
        adaptor.install_on(model, optimizer, get_args())
        return model, optimizer, opt_param_scheduler

    return setup_model_and_optimizer


def _forward_backward_replacement(original: Any, adaptor: MegatronLMAdaptor) -> Any:
    @functools.wraps(original)
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return adaptor.schedule(original(*args, **kwargs))

    return get_forward_backward_func


_REPLACEMENTS = {
    PARSE_ARGS_ADDS_FLAGS.name: _parse_args_replacement,
    SETUP_INSTALLS_RUNTIME.name: _setup_replacement,
    FORWARD_BACKWARD_WRAPPED.name: _forward_backward_replacement,
}


class MegatronLMAdaptor:
    """The patches of one adapted Megatron-LM process and the runtime they installed (``chameleon``, a
    ``MegatronChameleon``, or None while nothing is installed). Made and applied by :func:`adapt`.

    ``patches``/``changes`` default to the reviewed records; pass re-fingerprinted copies only to adapt code that
    was reviewed again (the tests do so for their stand-in Megatron-LM).
    """

    def __init__(self, patches: Sequence[Patch] = LM_PATCHES,
                 changes: Sequence[InstanceChange] = LM_INSTANCE_CHANGES) -> None:
        self.chameleon: Any = None
        self.changes = tuple(changes)
        self.patches = tuple(dataclasses.replace(patch, make_replacement=self._bound(patch)) for patch in patches)
        self._patch_set: PatchSet = apply_patches(self.patches)

    def _bound(self, patch: Patch) -> Callable[[Any], Any]:
        replace = _REPLACEMENTS[patch.name]
        return lambda original: replace(original, self)

    @property
    def active(self) -> bool:
        return self._patch_set.active

    def apply(self) -> MegatronLMAdaptor:
        """Check the Megatron-LM found (version, every fingerprint), then patch it; raises ``PatchRefused`` naming
        every problem and changes nothing when it is not the one reviewed."""
        problem = version_problem()
        if problem is not None:
            raise PatchRefused([problem])
        try:
            importlib.import_module(TRAINING_MODULE)
        except ImportError as exc:
            raise PatchRefused([f"Megatron-LM's {TRAINING_MODULE} cannot be imported ({type(exc).__name__}: {exc}); "
                                "adapt() is for Megatron-LM training scripts (pretrain_gpt.py) run from a Megatron-LM "
                                f"checkout of {REVIEWED_TAG}"]) from exc
        problems = []
        for checks in (lambda: verify_patches(self.patches), lambda: verify_instance_changes(self.changes)):
            try:
                checks()
            except PatchRefused as refused:
                problems += refused.problems
        if not problems:
            problems = self._already_adapted()
        if problems:
            raise PatchRefused(problems)
        self._patch_set.apply()
        logger.info("Megatron-LM adapted (%s): --chameleon-* flags chained, install after setup_model_and_optimizer",
                    REVIEWED_TAG)
        return self

    def _already_adapted(self) -> list[str]:
        problems = []
        for patch in self.patches:
            module, _, attr = patch.target.partition(":")
            value = getattr(importlib.import_module(module), attr)
            if upstream_original(value) is not value:
                problems.append(f"{patch.target} is already patched (adapt() was called before): close() the adaptor "
                                "adapt() returned before adapting again")
        return problems

    def close(self) -> None:
        """Close the runtime (if one was installed) and take the patches off (idempotent)."""
        if self.chameleon is not None:
            self.chameleon.close()
            self.chameleon = None
        if self._patch_set.active:
            self._patch_set.restore()

    # ---- called by the patched functions ---------------------------------------------------------------------
    def check_arguments(self, args: argparse.Namespace) -> None:
        """Refuse what the parsed flags cannot mean (before ``initialize_megatron`` starts torch.distributed)."""
        if requested_config(args) is None:
            return
        graphs = _cuda_graph_flags(args)
        if graphs:
            raise ConfigError([f"{', '.join(graphs)}: Chameleon cannot swap activations inside a captured CUDA graph "
                               "(the graph would replay copies and releases planned for one iteration); drop the "
                               "CUDA-graph flag or pass --no-chameleon"])

    def install_on(self, model: Any, optimizer: Any, args: argparse.Namespace) -> None:
        """Install the rank's runtime on ``model`` with ``optimizer`` when the flags ask for it."""
        config = requested_config(args)
        if config is None:
            agree_on_settings(ChameleonConfig(enabled=False))  # (ranks with Chameleon on must not wait for this one)
            logger.info("no --chameleon-* flag (or --no-chameleon): Megatron-LM runs untouched")
            return
        if optimizer is None:
            logger.info("--skip-train built no optimizer: Chameleon is not installed (evaluation only)")
            return
        self.check_arguments(args)
        if self.chameleon is not None:  # a second setup in one process (in-process restart): start afresh
            self.chameleon.close()
            self.chameleon = None
        from chameleon_dist.integrations.megatron.install import install  # imports megatron.core

        self.chameleon = install(model, config, optimizer=optimizer)

    def schedule(self, forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_backward_func`` wrapped by the installed runtime, or itself while none is installed."""
        return forward_backward_func if self.chameleon is None else self.chameleon.wrap(forward_backward_func)


def adapt() -> MegatronLMAdaptor:
    """Adapt this process's Megatron-LM (call it at the top of the training script, before ``pretrain``).

    Raises ``PatchRefused`` naming the Megatron-LM found and the one reviewed, or every fingerprint that differs,
    before anything is patched (and before any process group exists)."""
    return MegatronLMAdaptor().apply()
