"""One node's host memory, shared among the ranks that run on it.

Every rank of a job pins its own host buffers, so ``host_memory_budget: auto`` and fractions are shares of
the node's RAM divided among the node's ranks (``LOCAL_WORLD_SIZE``, which torchrun and the deepspeed
launcher set; 1 without it): eight ranks at ``auto`` pin half the node in all, not four times its memory.
An explicit byte budget is per rank, as written; ``HostShare.node_problem`` says when the ranks together
would pin more than half the node's RAM (the runtime warns once).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from chameleon_dist.config import sizes
from chameleon_dist.config.errors import ConfigError

LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
NODE_PINNED_FRACTION = 0.5
"""The ranks of a node together should not pin more than this share of its RAM."""


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks on this node: ``LOCAL_WORLD_SIZE`` (default ``os.environ``), 1 when unset.

    Raises:
        ConfigError: a value that is not a whole number >= 1.
    """
    text = (os.environ if environ is None else environ).get(LOCAL_WORLD_SIZE_ENV, "").strip()
    if not text:
        return 1
    try:
        ranks = int(text)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ConfigError([
            f"{LOCAL_WORLD_SIZE_ENV}: {text!r} is not a whole number of ranks >= 1; set it to the number of ranks "
            f"started on this node (host_memory_budget \"auto\" and fractions are shared among them), or unset it"
        ])
    return ranks


@dataclasses.dataclass(frozen=True)
class HostShare:
    """A rank's host budget and where it came from: ``budget`` as configured, the node's RAM (None:
    unknown) and the ranks on the node. ``per_rank_bytes`` is None when a share of an unknown RAM was asked."""

    budget: sizes.Budget
    node_ram_bytes: int | None
    local_ranks: int
    auto_fraction: float

    @property
    def is_share(self) -> bool:
        """True for "auto" and fractions (shares of the node), False for a byte budget (per rank)."""
        return not isinstance(self.budget, int)

    @property
    def per_rank_bytes(self) -> int | None:
        if not self.is_share:
            return int(self.budget)
        if self.node_ram_bytes is None:
            return None
        return sizes.resolve_budget_bytes(self.budget, self.node_ram_bytes, self.auto_fraction,
                                          shares=self.local_ranks)

    @property
    def node_pinned_bytes(self) -> int | None:
        """What the node's ranks may pin together (every rank with this budget)."""
        per_rank = self.per_rank_bytes
        return None if per_rank is None else per_rank * self.local_ranks

    def describe(self) -> str:
        """For the log line: ``host memory budget 8GiB per rank (auto: 50% of the node's 128GiB RAM / 8 ranks)``."""
        per_rank = self.per_rank_bytes
        if per_rank is None:
            return f"host memory budget {self.budget!r} not enforced (the node's RAM is unknown)"
        if not self.is_share:
            source = f"host_memory_budget {sizes.format_size(per_rank)}, per rank, {self.local_ranks} on the node"
        else:
            fraction = self.auto_fraction if self.budget == sizes.AUTO else self.budget
            name = "auto" if self.budget == sizes.AUTO else "host_memory_budget"
            source = (f"{name}: {fraction:.0%} of the node's {sizes.format_size(self.node_ram_bytes)} RAM / "
                      f"{self.local_ranks} rank{'s' if self.local_ranks != 1 else ''} ({LOCAL_WORLD_SIZE_ENV})")
        return f"host memory budget {sizes.format_size(per_rank)} per rank ({source})"

    def node_problem(self) -> str | None:
        """The warning when the node's ranks together would pin more than half its RAM, else None."""
        total = self.node_pinned_bytes
        if total is None or self.node_ram_bytes is None or total <= NODE_PINNED_FRACTION * self.node_ram_bytes:
            return None
        return (f"host_memory_budget: {sizes.format_size(self.per_rank_bytes)} per rank x {self.local_ranks} "
                f"rank{'s' if self.local_ranks != 1 else ''} on this node ({LOCAL_WORLD_SIZE_ENV}) may pin "
                f"{sizes.format_size(total)}, more than half of the node's {sizes.format_size(self.node_ram_bytes)} "
                f"RAM; lower host_memory_budget (\"auto\" shares half the node's RAM among its ranks)")
