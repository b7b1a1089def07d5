"""Every budget of a rank is resolved once at start (issue 38 item 4): ``config/budgets.py`` reads the machine
once (``read_node``) and resolves the capacity, the device budget and the host budget once (``resolve_budgets``);
the runtime, its checks and the host pool take the result."""

from __future__ import annotations

import types

import pytest

from chameleon_dist import Chameleon, ChameleonConfig, EmulatedDevice
from chameleon_dist.config.budgets import CAPACITY_SOURCE, RAM_SOURCE, NodeReading, read_node, resolve_budgets
from chameleon_dist.config.host_limits import HostLimits

GiB = 2**30
MiB = 2**20
PAGE_BYTES = 4096


@pytest.fixture
def ram_reads(monkeypatch, tmp_path):
    """A 128 GiB machine of 8 ranks (no cgroup limit) that counts how often its RAM is read."""
    from chameleon_dist.config import host_limits

    reads = []
    pages = 128 * GiB // PAGE_BYTES

    def sysconf(name):
        reads.append(name)
        return {"SC_PHYS_PAGES": pages, "SC_PAGE_SIZE": PAGE_BYTES}[name]

    monkeypatch.setattr("os.sysconf", sysconf)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for name in ("CGROUP_V2_MEMORY_MAX_PATH", "CGROUP_V1_LIMIT_PATH"):
        monkeypatch.setattr(host_limits, name, str(tmp_path / "absent"))
    return lambda: reads.count("SC_PHYS_PAGES")


@pytest.mark.parametrize("passed", [False, True])
def test_the_runtime_reads_the_machine_once(ram_reads, passed):
    device = EmulatedDevice(64 * MiB) if passed else None
    chameleon = Chameleon({"host_memory_budget": 0.25, "device": {"kind": "emulated"}}, device=device)
    assert ram_reads() == 1  # (the factory, the RAM check, the pool's adoption and the log line read it again before)
    assert chameleon.device.host_pool.budget_bytes == 4 * GiB == chameleon.budgets.host_budget_bytes
    assert chameleon.budgets.local_ranks == 8 and chameleon.budgets.ram_bytes == 128 * GiB


def test_read_node_takes_what_it_is_given_instead_of_reading(ram_reads):
    node = read_node(local_ranks=2, limits=HostLimits(8 * GiB, memlock_bytes=MiB))
    assert ram_reads() == 0 and node == NodeReading(HostLimits(8 * GiB, memlock_bytes=MiB), 2)
    assert read_node(ram_bytes=GiB, local_ranks=1, limits=HostLimits(8 * GiB)).ram_bytes == GiB
    assert read_node(environ={"LOCAL_WORLD_SIZE": "3"}).local_ranks == 3 and ram_reads() == 1


def _device(capacity_bytes, pool_budget_bytes=None, emulated=True):
    return types.SimpleNamespace(capacity_bytes=capacity_bytes, emulated=emulated,
                                 host_pool=types.SimpleNamespace(budget_bytes=pool_budget_bytes))


def test_resolved_budgets_carry_each_figure_and_its_source():
    node = NodeReading(HostLimits(128 * GiB, 16 * GiB, "cgroup memory.max", memlock_bytes=64 * MiB), 4)
    config = ChameleonConfig(memory_budget=0.5)
    budgets = resolve_budgets(config, _device(1000), node, device_passed=False)
    assert (budgets.capacity_bytes, budgets.memory_budget_bytes) == (1000, 500)
    assert (budgets.capacity_source, budgets.ram_source) == (CAPACITY_SOURCE, RAM_SOURCE)
    assert budgets.host.per_rank_bytes == 2 * GiB and budgets.host.bound == "cgroup memory.max"  # auto: 16 GiB / 2 / 4
    assert budgets.ram_bytes == 128 * GiB and budgets.local_ranks == 4
    assert not budgets.pinned and budgets.memlock_bytes is None  # pageable host buffers: memlock does not bound them
    pinned = resolve_budgets(config, _device(1000, emulated=False), node, device_passed=False)
    assert pinned.pinned and pinned.memlock_bytes == 64 * MiB and pinned.host.per_rank_bytes == 64 * MiB


def test_a_passed_pool_keeps_its_budget_or_takes_the_configs_only_when_the_config_sets_one():
    node = NodeReading(HostLimits(128 * GiB), 1)
    unset, given = ChameleonConfig(), ChameleonConfig(host_memory_budget="1GiB")
    assert resolve_budgets(unset, _device(MiB), node, device_passed=True).host_budget_bytes is None  # unbounded
    assert resolve_budgets(given, _device(MiB), node, device_passed=True).host_budget_bytes == GiB
    own = resolve_budgets(unset, _device(MiB, 3 * GiB), node, device_passed=True)
    assert own.host_budget_bytes == own.device_host_budget_bytes == 3 * GiB
    assert own.described_host().per_rank_bytes == 3 * GiB and own.host.per_rank_bytes == 64 * GiB  # the log: its own
    assert resolve_budgets(given, _device(MiB, 3 * GiB), node, device_passed=True).host_budget_bytes == 3 * GiB
