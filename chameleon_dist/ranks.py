"""``RankCoordinates``: where one rank sits in a distributed job (tensor, pipeline, data and virtual-pipeline
ranks and sizes); ``RankLogPrefix``, which puts them in front of every chameleon-dist log line; and
``RankOutOfMemoryError``, what a rank of a multi-rank job raises when it cannot go on.

The engine integrations read the coordinates from the engine's process groups (Megatron's
``ProcessGroupCollection`` or ``parallel_state``, DeepSpeed's topology); the runtime only carries them into its
reports and logs. Imports nothing of the frameworks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class RankCoordinates:
    """One rank's place: its global ``rank`` among ``world_size`` and its rank and size in each dimension
    (``vpp_size``: model chunks per pipeline stage; 1 without interleaving)."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    vpp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank {rank} is not within {name}_size {size}")
        if self.tp_size * self.pp_size * self.dp_size > self.world_size:
            raise ValueError(f"tp_size {self.tp_size} x pp_size {self.pp_size} x dp_size {self.dp_size} is more than "
                             f"world_size {self.world_size}")
        if self.vpp_size < 1:
            raise ValueError(f"vpp_size must be >= 1, got {self.vpp_size}")

    @property
    def label(self) -> str:
        """``rank 3/4 tp 1/2 pp 1/2 dp 0/1`` (plus ``vpp 2`` with interleaving): what log lines and errors show."""
        parts = [f"rank {self.rank}/{self.world_size}", f"tp {self.tp_rank}/{self.tp_size}",
                 f"pp {self.pp_rank}/{self.pp_size}", f"dp {self.dp_rank}/{self.dp_size}"]
        if self.vpp_size > 1:
            parts.append(f"vpp {self.vpp_size}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RankOutOfMemoryError(torch.OutOfMemoryError):
    """One rank of a multi-rank job ran out of device memory and cannot retry alone (its peers wait on its
    sends and collectives); the message names the rank's coordinates and the setting to change."""


class RankLogPrefix(logging.Filter):
    """Prefixes the records of chameleon-dist's loggers with ``[<coordinates>]``.

    Python applies a logger's filters only to records made on that very logger (not its children), so
    ``install`` adds this filter to every ``chameleon_dist`` logger that exists then (each module makes its
    logger when it is imported) and ``remove`` takes it off again."""

    def __init__(self, coordinates: RankCoordinates, root: str = "chameleon_dist") -> None:
        super().__init__()
        self.prefix = f"[{coordinates.label}] "
        self.root = root
        self._loggers: list[logging.Logger] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(self.prefix):
            record.msg = self.prefix + record.msg
        return True

    def install(self) -> "RankLogPrefix":
        names = [self.root] + [name for name in logging.Logger.manager.loggerDict if name.startswith(self.root + ".")]
        for name in names:
            logger = logging.getLogger(name)
            if self not in logger.filters:
                logger.addFilter(self)
                self._loggers.append(logger)
        return self

    def remove(self) -> None:
        for logger in self._loggers:
            logger.removeFilter(self)
        self._loggers.clear()
