"""One node's host memory, shared among the ranks that run on it.

Every rank of a job pins its own host buffers, so ``host_memory_budget: auto`` and fractions are shares of
the node's RAM divided among the node's ranks (``LOCAL_WORLD_SIZE``, which torchrun and the deepspeed
launcher set; 1 without it): eight ranks at ``auto`` pin half the node in all, not four times its memory.
An explicit byte budget is per rank, as written; ``HostShare.node_problem`` says when the ranks together
would pin more than half the node's RAM (the runtime warns once). Inside a container the share is of the
cgroup's memory limit when that is smaller, and a rank that page-locks its buffers takes at most
``RLIMIT_MEMLOCK`` (``config/host_limits.py``); the start log line names the bound that applied.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from chameleon_dist.config import sizes
from chameleon_dist.config.errors import ConfigError
from chameleon_dist.config.host_limits import HOST_RAM, RLIMIT_MEMLOCK

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
    """A rank's host budget and where it came from: ``budget`` as configured, the host memory the node's ranks
    share (``node_ram_bytes``, None: unknown; the RAM, or the cgroup's limit: ``total_bound`` says which) and
    the ranks on the node; ``memlock_bytes``: the most a rank may page-lock where it pins (None: no bound).
    ``per_rank_bytes`` is None when a share of an unknown RAM was asked."""

    budget: sizes.Budget
    node_ram_bytes: int | None
    local_ranks: int
    auto_fraction: float
    total_bound: str = HOST_RAM
    memlock_bytes: int | None = None

    @property
    def bound(self) -> str:
        """What bounded this rank's budget: "RLIMIT_MEMLOCK" when it cut the share, else ``total_bound``
        (a byte budget: "host_memory_budget")."""
        if not self.is_share:
            return "host_memory_budget"
        share = self._share_bytes()
        if share is not None and self.memlock_bytes is not None and self.memlock_bytes < share:
            return RLIMIT_MEMLOCK
        return self.total_bound

    @property
    def is_share(self) -> bool:
        """True for "auto" and fractions (shares of the node), False for a byte budget (per rank)."""
        return not isinstance(self.budget, int)

    def _share_bytes(self) -> int | None:
        if self.node_ram_bytes is None:
            return None
        return sizes.resolve_budget_bytes(self.budget, self.node_ram_bytes, self.auto_fraction,
                                          shares=self.local_ranks)

    @property
    def per_rank_bytes(self) -> int | None:
        if not self.is_share:
            return int(self.budget)
        share = self._share_bytes()
        if share is None or self.memlock_bytes is None:
            return share
        return min(share, self.memlock_bytes)

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
            source = (f"{name}: {fraction:.0%} of {self._total_text()} {sizes.format_size(self.node_ram_bytes)} / "
                      f"{self.local_ranks} rank{'s' if self.local_ranks != 1 else ''} ({LOCAL_WORLD_SIZE_ENV})")
            if self.bound == RLIMIT_MEMLOCK:
                source += (f", cut to {RLIMIT_MEMLOCK} {sizes.format_size(self.memlock_bytes)} (raise it with "
                           "ulimit -l to pin more)")
            source += f"; bound: {self.bound}"
        return f"host memory budget {sizes.format_size(per_rank)} per rank ({source})"

    def _total_text(self) -> str:
        return "the node's RAM" if self.total_bound == HOST_RAM else f"the {self.total_bound} limit"

    def node_problem(self) -> str | None:
        """The warning when the node's ranks together would pin more than half its RAM, or when
        ``RLIMIT_MEMLOCK`` cut this rank's share (swapping may then barely work), else None."""
        if self.bound == RLIMIT_MEMLOCK:
            return (f"host_memory_budget: {self.budget!r} is {sizes.format_size(self._share_bytes())} per rank, cut "
                    f"to {sizes.format_size(self.memlock_bytes)} by {RLIMIT_MEMLOCK} (what this process may "
                    "page-lock); raise it (ulimit -l, docker --ulimit memlock=-1) to swap more to the host")
        total = self.node_pinned_bytes
        if total is None or self.node_ram_bytes is None or total <= NODE_PINNED_FRACTION * self.node_ram_bytes:
            return None
        return (f"host_memory_budget: {sizes.format_size(self.per_rank_bytes)} per rank x {self.local_ranks} "
                f"rank{'s' if self.local_ranks != 1 else ''} on this node ({LOCAL_WORLD_SIZE_ENV}) may pin "
                f"{sizes.format_size(total)}, more than half of {self._total_text()} "
                f"{sizes.format_size(self.node_ram_bytes)}; lower host_memory_budget (\"auto\" shares half the node's RAM among its ranks)")
