"""Every budget of one rank, resolved once at start: the one module that reads what the budgets are shares of.

Two steps, because the device is made between them:

1. ``read_node()`` reads the machine once: its RAM, its cgroup's memory limit and ``RLIMIT_MEMLOCK``
   (``config/host_limits.py``), and the node's ranks (``LOCAL_WORLD_SIZE``, ``config/node.py``). The
   ``NodeReading`` it returns gives the host budget of a device that pins or does not (``host_budget_bytes``):
   the factory takes it from there for the device it makes.
2. ``resolve_budgets(config, device, node)`` then reads the device's capacity once and returns
   ``ResolvedBudgets``: the capacity, the device budget (``memory_budget``), this rank's host budget and the
   pool's, each with the name of what it came from for error messages. ``Chameleon.__init__`` runs both; its
   checks (``config/checks.py``), the host pool's ``adopt_budget``, the policy controller, the start log line
   and the reports take their figures from the result.

No other module reads the RAM, ``LOCAL_WORLD_SIZE`` or the limits for a budget, and the runtime never asks its
device for its capacity again (``tests/test_dependency_rules.py``). Nothing here imports torch; devices are
duck-typed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from chameleon_dist.config import sizes
from chameleon_dist.config.host_limits import HostLimits, read_host_limits
from chameleon_dist.config.node import HostShare, local_world_size

if TYPE_CHECKING:
    from chameleon_dist.config.schema import ChameleonConfig

logger = logging.getLogger(__name__)

AUTO_DEVICE_FRACTION = 0.9
"""``memory_budget: auto``: this share of the device's capacity."""
AUTO_HOST_FRACTION = 0.5
"""``host_memory_budget: auto``: this share of the node's host memory, divided among its ranks."""

CAPACITY_SOURCE = "the device's capacity (device.capacity)"
RAM_SOURCE = "this machine's RAM"


def device_budget_bytes(budget: sizes.Budget, capacity_bytes: int) -> int:
    """``memory_budget`` in bytes for a device of ``capacity_bytes`` ("auto": ``AUTO_DEVICE_FRACTION`` of it)."""
    return sizes.resolve_budget_bytes(budget, capacity_bytes, AUTO_DEVICE_FRACTION)


@dataclasses.dataclass(frozen=True)
class NodeReading:
    """What a rank's host budget is a share of, read once (``read_node``): the host's bounds (``limits``: RAM,
    cgroup limit, ``RLIMIT_MEMLOCK``) and the ranks on the node (``local_ranks``)."""

    limits: HostLimits
    local_ranks: int

    @property
    def ram_bytes(self) -> int | None:
        """This machine's RAM (None: unknown): the total a byte host budget is checked against."""
        return self.limits.ram_bytes

    def host_share(self, budget: sizes.Budget, *, pinned: bool) -> HostShare:
        """``host_memory_budget`` (``budget``) for one rank: "auto" and fractions of the smaller of the RAM and
        the cgroup's limit, divided among the node's ranks and, for a device that page-locks its host buffers
        (``pinned``: the CUDA device), at most ``RLIMIT_MEMLOCK``; a byte budget per rank as written."""
        shared_bytes, bound = self.limits.shared_bytes()  # (for a byte budget: the node-wide warning only)
        return HostShare(budget, shared_bytes, self.local_ranks, AUTO_HOST_FRACTION, total_bound=bound,
                         memlock_bytes=self.limits.memlock_bytes if pinned else None)

    def host_budget_bytes(self, budget: sizes.Budget, *, pinned: bool) -> int | None:
        """This rank's host budget in bytes (``host_share``); None, with a warning, when a share of the RAM is
        asked and the RAM cannot be read."""
        per_rank_bytes = self.host_share(budget, pinned=pinned).per_rank_bytes
        if per_rank_bytes is None:
            logger.warning("cannot read the host's RAM size: host_memory_budget %r is not enforced", budget)
        return per_rank_bytes


def read_node(*, ram_bytes: int | None = None, local_ranks: int | None = None, limits: HostLimits | None = None,
              environ: Mapping[str, str] | None = None) -> NodeReading:
    """The one read of the machine for the host budget. Each argument, when given, stands in for what would be
    read: ``local_ranks`` for ``LOCAL_WORLD_SIZE`` (from ``environ``, default ``os.environ``), ``limits`` for
    the host's bounds, ``ram_bytes`` for the RAM (in the given limits too).

    Raises:
        ConfigError: a ``LOCAL_WORLD_SIZE`` that is not a whole number >= 1.
    """
    if local_ranks is None:
        local_ranks = local_world_size(environ)
    if limits is None:
        limits = read_host_limits(ram_bytes)
    elif ram_bytes is not None:
        limits = dataclasses.replace(limits, ram_bytes=ram_bytes)
    return NodeReading(limits, local_ranks)


@dataclasses.dataclass(frozen=True)
class ResolvedBudgets:
    """One rank's budgets, resolved once at start (``resolve_budgets``), with where each came from.

    ``capacity_bytes``: the device's capacity (``capacity_source`` names it in messages);
    ``memory_budget_bytes``: ``memory_budget`` of it. ``host``: the config's ``host_memory_budget`` for this
    rank and its source (the share, its bound, the node's ranks). ``device_host_budget_bytes``: the budget the
    device's host pool had when the runtime got it (None: none). ``host_budget_bytes``: the pool's budget from
    start on: the device's own, else the config's where the runtime hands it to the pool, else None
    (unbounded). ``ram_bytes``: this machine's RAM (``ram_source``; None: unknown). ``pinned``: the device
    page-locks its host buffers (the CUDA device: ``RLIMIT_MEMLOCK`` bounds them)."""

    capacity_bytes: int
    memory_budget_bytes: int
    host: HostShare
    host_budget_bytes: int | None
    device_host_budget_bytes: int | None
    ram_bytes: int | None
    pinned: bool
    capacity_source: str = CAPACITY_SOURCE
    ram_source: str = RAM_SOURCE

    @property
    def local_ranks(self) -> int:
        """The ranks on this node (``LOCAL_WORLD_SIZE``, 1 without it)."""
        return self.host.local_ranks

    @property
    def memlock_bytes(self) -> int | None:
        """The most this rank may page-lock (None: no bound, or a device that does not pin)."""
        return self.host.memlock_bytes

    def described_host(self) -> HostShare:
        """The host budget as the start log line tells it: the config's share, or the device's own byte
        budget (per rank) where the pool holds a different one."""
        budget_bytes = self.device_host_budget_bytes
        if budget_bytes is not None and budget_bytes != self.host.per_rank_bytes:
            return dataclasses.replace(self.host, budget=budget_bytes)
        return self.host


def resolve_budgets(config: "ChameleonConfig", device: Any, node: NodeReading, *,
                    device_passed: bool) -> ResolvedBudgets:
    """Every budget of the rank that runs ``config`` on ``device`` (made from the config, or passed to
    ``Chameleon(device=...)`` when ``device_passed``), from the machine as ``node`` read it. The device is
    asked for its capacity and its host pool's budget here, once.

    A passed device whose pool has no budget takes the config's when the config sets ``host_memory_budget``
    (``host_budget_bytes``); a budget it has stays its own (a different one in the config is an error that
    ``config/checks.py`` reports)."""
    pinned = not bool(getattr(device, "emulated", False))  # (the CUDA device page-locks: RLIMIT_MEMLOCK)
    capacity_bytes = device.capacity_bytes
    device_host_budget_bytes = device.host_pool.budget_bytes
    host_budget_bytes = device_host_budget_bytes
    if device_passed and "host_memory_budget" in config.model_fields_set:
        config_bytes = node.host_budget_bytes(config.host_memory_budget, pinned=pinned)
        if host_budget_bytes is None:
            host_budget_bytes = config_bytes
    return ResolvedBudgets(
        capacity_bytes=capacity_bytes,
        memory_budget_bytes=device_budget_bytes(config.memory_budget, capacity_bytes),
        host=node.host_share(config.host_memory_budget, pinned=pinned),
        host_budget_bytes=host_budget_bytes,
        device_host_budget_bytes=device_host_budget_bytes,
        ram_bytes=node.ram_bytes,
        pinned=pinned,
    )
