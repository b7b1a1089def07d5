"""``OpenIteration``: one iteration of a rank's runtime that a framework call opens and a later call closes.

Megatron's ``forward_backward_func`` opens an iteration that its optimizer step closes; DeepSpeed's first
forward of an accumulation window opens one that the boundary ``engine.step()`` closes (``train_batch`` opens
and closes its own). Between the two calls the iteration stays open (``Chameleon.iteration()`` entered by
hand). When a call inside fails, ``fail`` closes the iteration as failed (the runtime's ``last_report`` says
so) and raises; an out-of-memory error of a multi-rank job becomes a ``RankOutOfMemoryError`` naming the rank
and the settings to change (NOTE [One rank cannot retry alone] in ``megatron/install.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import NoReturn

import torch

from chameleon_dist.ranks import RankOutOfMemoryError
from chameleon_dist.runtime import Chameleon

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SettingNames:
    """How the user spells the settings an out-of-memory error tells them to change (a launch flag, a key of
    a DeepSpeed config)."""

    capacity: str = "device.capacity"
    budget: str = "memory_budget"
    min_swap: str = "min_swap_bytes"
    enable: str = "enabled: true"


class OpenIteration:
    """The runtime's iteration between the call that opens it and the call that closes it."""

    def __init__(self, runtime: Chameleon, names: SettingNames = SettingNames()) -> None:
        self._runtime = runtime
        self._names = names
        self._open: contextlib.AbstractContextManager | None = None

    @property
    def active(self) -> bool:
        return self._open is not None

    def begin(self) -> None:
        """Open an iteration (closing one left open: its closing call never came)."""
        self.finish()
        opened = self._runtime.iteration()
        opened.__enter__()
        self._open = opened

    def finish(self) -> None:
        """Close the open iteration, if any, as completed."""
        opened, self._open = self._open, None
        if opened is not None:
            opened.__exit__(None, None, None)

    def close_failed(self, exc: BaseException) -> None:
        """Close the open iteration, if any, as failed by ``exc`` (not raised here)."""
        opened, self._open = self._open, None
        if opened is not None:
            opened.__exit__(type(exc), exc, exc.__traceback__)  # the runtime records the failed iteration

    def fail(self, exc: BaseException, window: str = "an iteration") -> NoReturn:
        """Close the open iteration as failed and raise: for an out-of-memory error a ``RankOutOfMemoryError``
        naming the rank and what to change, else ``exc`` itself; logged either way (the rank's log prefix names
        it). ``window``: what cannot be retried ("an accumulation window"). Callers that can replay on a single
        rank do so before they call this."""
        self.close_failed(exc)
        runtime = self._runtime
        iteration = runtime.last_report.iteration if runtime.last_report is not None else 0
        if not isinstance(exc, torch.OutOfMemoryError):
            logger.error("iteration %d failed: %s: %s", iteration, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            raise exc
        names = self._names
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        remedy = (f"passive swap could not make room either; raise the device capacity ({names.capacity}), lower "
                  f"{names.budget}, or lower {names.min_swap}" if runtime.config.enabled else
                  f"Chameleon is disabled on this rank; turn it on ({names.enable}) or raise the device capacity "
                  f"({names.capacity})")
        message = (f"out of memory in iteration {iteration} ({detail}). A rank of a multi-rank job cannot retry "
                   f"{window} alone (its peers already wait on its sends and collectives): this rank stops and the "
                   f"launcher ends the others. {remedy}.")
        logger.error("%s", message)
        raise RankOutOfMemoryError(f"{runtime.coordinates.label}: {message}") from exc
