"""Cluster profiles: the nodes a job runs on, as data (``configs/clusters/*.yaml``, ``kind: cluster``).

A cluster names its accelerator (a hardware profile: ``hardware: h100-80gb`` or a path to a .yaml file,
relative to the cluster file) and says what the hardware profile cannot: how many nodes, how many devices
each, the collective bus bandwidths inside and between its nodes, the host link per device where it differs
from the accelerator profile's, and the host RAM per node, which all ranks of a node share (see
``host_memory``). ``device_profile()`` is the accelerator with the cluster's node values in place: the
planner prices a layout with it as with any hardware profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt, ValidationError

from chameleon_dist.config import ConfigError
from chameleon_dist.planner.profiles import (
    CLUSTER_KIND,
    CLUSTERS_DIR,
    Bytes,
    BytesPerS,
    HardwareProfile,
    _load_named,
    _Profile,
    load_hardware,
)

PROFILE_SUFFIXES = (".yaml", ".yml", ".json")


class ClusterProfile(_Profile):
    """Nodes of one accelerator type, and what links them."""

    kind: Literal["cluster"] = CLUSTER_KIND
    hardware: str  # the accelerator: a shipped hardware profile's name, or a path to one
    nodes: PositiveInt
    devices_per_node: PositiveInt
    intra_node_bus_bytes_per_s: BytesPerS  # collective bus bandwidth inside a node (nccl-tests busbw)
    inter_node_bus_bytes_per_s: BytesPerS  # collective bus bandwidth per device across nodes
    h2d_bytes_per_s: BytesPerS | None = None  # host link per device; None: the hardware profile's
    d2h_bytes_per_s: BytesPerS | None = None
    h2d_concurrent_bytes_per_s: BytesPerS | None = None  # H2D while D2H also runs; None: see device_profile
    host_memory_bytes: Bytes  # host RAM per node
    host_swap_fraction: float | None = Field(None, gt=0, le=1)  # None: the hardware profile's
    # the cluster's own inputs with no source at hand: field -> [low, high], as a hardware profile's ``assumed``
    assumed: dict[str, tuple[float | str, float | str]] = Field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def accelerator(self) -> HardwareProfile:
        """The hardware profile as shipped (or as its file says), before the cluster's node values."""
        try:
            return load_hardware(self.hardware)
        except ConfigError as exc:
            if exc.source is not None:  # the profile file's own problems, with its path
                raise
            # no such shipped profile: the loader's words, for this file's field
            problems = [f"hardware: {p.removeprefix('--hardware: ')} (relative to the cluster file)" for p in exc.problems]
            raise ConfigError(problems, source=f"cluster {self.name}") from None

    def device_profile(self) -> HardwareProfile:
        """The accelerator with this cluster's devices per node, bus bandwidths, host link and host RAM. The
        H2D rate while D2H runs is the cluster's, else the accelerator's capped at the cluster's H2D rate."""
        base = self.accelerator()
        values = base.model_dump()
        h2d = self.h2d_bytes_per_s or base.h2d_bytes_per_s
        concurrent = self.h2d_concurrent_bytes_per_s or base.h2d_concurrent_bytes_per_s
        values.update(
            description=f"{base.description} (node values of cluster {self.name})",
            devices_per_node=self.devices_per_node, intra_node_bus_bytes_per_s=self.intra_node_bus_bytes_per_s,
            inter_node_bus_bytes_per_s=self.inter_node_bus_bytes_per_s, h2d_bytes_per_s=h2d,
            d2h_bytes_per_s=self.d2h_bytes_per_s or base.d2h_bytes_per_s,
            h2d_concurrent_bytes_per_s=None if concurrent is None else min(concurrent, h2d),
            host_memory_bytes=self.host_memory_bytes,
            host_swap_fraction=self.host_swap_fraction or base.host_swap_fraction,
        )
        # a value the cluster sets is the cluster's: the accelerator's range for it goes, the cluster's own applies
        base_values = base.model_dump()
        assumed = {k: v for k, v in base.assumed.items() if values[k] == base_values[k]}
        values["assumed"] = {**assumed, **self.assumed}
        try:
            return HardwareProfile.model_validate(values)
        except ValidationError as exc:
            raise ConfigError.from_validation_error(exc, source=f"cluster {self.name}", model=HardwareProfile) from None

    def check_devices(self, devices: int) -> None:
        """``devices`` must be the whole cluster, whole nodes of it, or devices within one node."""
        n = self.devices_per_node
        if 1 <= devices <= self.world_size and (devices % n == 0 or devices < n):
            return
        raise ConfigError([f"--devices {devices}: cluster {self.name} has {self.nodes} nodes x {n} devices "
                           f"({self.world_size}); ask for at most {self.world_size}, in whole nodes (a multiple of "
                           f"{n}) or fewer than {n} devices of one node, or leave --devices out to use all of it"])

    def nodes_used(self, devices: int) -> int:
        return -(-devices // self.devices_per_node)

    def describe(self, devices: int | None = None) -> str:
        used = self.world_size if devices is None else devices
        gb = 1e9
        return (f"cluster {self.name}: {self.nodes_used(used)} of {self.nodes} nodes x {self.devices_per_node}, "
                f"host RAM {self.host_memory_bytes / gb:.0f} GB per node, inter-node "
                f"{self.inter_node_bus_bytes_per_s / gb:.0f} GB/s per device")


def load_cluster(name_or_path: str | Path) -> ClusterProfile:
    """A shipped cluster (``dgx-h100-8x8``) or a cluster file. A relative ``hardware`` path is read from the
    cluster file's folder; the accelerator is loaded (and the node values checked) here."""
    cluster = _load_named(name_or_path, CLUSTER_KIND)
    assert isinstance(cluster, ClusterProfile)
    path = Path(name_or_path)
    folder = path.parent if path.suffix.lower() in PROFILE_SUFFIXES else CLUSTERS_DIR
    hardware = Path(cluster.hardware)
    if hardware.suffix.lower() in PROFILE_SUFFIXES and not hardware.is_absolute():
        cluster = cluster.model_copy(update={"hardware": str(folder / hardware)})
    cluster.device_profile()
    return cluster


__all__ = ["ClusterProfile", "load_cluster"]
