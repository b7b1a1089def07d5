"""host_memory_budget "auto" inside a container (issue 37 item 7): the share is of the smaller of the RAM and the
cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), and a rank that page-locks (the CUDA
device) takes at most ``RLIMIT_MEMLOCK``; the start log line names the bound that applied. Fake cgroup files
and a fake ``getrlimit`` stand in for the machine's."""

from __future__ import annotations

import logging
import resource

import pytest

from chameleon_dist import Chameleon, ChameleonConfig
from chameleon_dist.config import host_limits
from chameleon_dist.config.host_limits import HostLimits, read_cgroup_limit, read_host_limits, read_memlock_bytes
from chameleon_dist.device.factory import make_device
from tests.test_cuda_device import fake_cuda  # noqa: F401 - the fixture

GiB = 2**30
MiB = 2**20
PAGE_BYTES = 4096
V1_NO_LIMIT = "9223372036854771712"  # what cgroup v1 writes for "no limit"


def _file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text + "\n")
    return str(path)


def test_cgroup_readers_take_v2_then_v1_and_know_their_no_limit_values(tmp_path):
    missing = str(tmp_path / "absent")
    assert read_cgroup_limit(_file(tmp_path, "v2", "max"), missing) == (None, "cgroup memory.max")
    assert read_cgroup_limit(_file(tmp_path, "v2b", str(8 * GiB)), missing) == (8 * GiB, "cgroup memory.max")
    v1 = _file(tmp_path, "v1", str(6 * GiB))
    assert read_cgroup_limit(_file(tmp_path, "v2c", str(8 * GiB)), v1) == (8 * GiB, "cgroup memory.max")  # v2 first
    assert read_cgroup_limit(missing, v1) == (6 * GiB, "cgroup memory.limit_in_bytes")
    assert read_cgroup_limit(missing, _file(tmp_path, "v1b", V1_NO_LIMIT))[0] is None
    assert read_cgroup_limit(missing, missing)[0] is None


def test_the_memlock_reader_takes_the_soft_limit_and_unlimited_is_none():
    assert read_memlock_bytes(lambda which: (8 * MiB, 16 * MiB)) == 8 * MiB
    assert read_memlock_bytes(lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)) is None


@pytest.mark.parametrize(
    ("limits", "pinned", "budget_bytes", "bound"),
    [
        (HostLimits(128 * GiB), True, 16 * GiB, "host RAM"),
        (HostLimits(128 * GiB, 16 * GiB, "cgroup memory.max"), False, 2 * GiB, "cgroup memory.max"),
        (HostLimits(128 * GiB, 16 * GiB, "cgroup memory.limit_in_bytes"), False, 2 * GiB,
         "cgroup memory.limit_in_bytes"),
        (HostLimits(8 * GiB, 16 * GiB, "cgroup memory.max"), False, GiB, "host RAM"),  # the RAM is smaller
        (HostLimits(128 * GiB, 16 * GiB, "cgroup memory.max", memlock_bytes=64 * MiB), True, 64 * MiB,
         "RLIMIT_MEMLOCK"),
        (HostLimits(128 * GiB, 16 * GiB, "cgroup memory.max", memlock_bytes=64 * MiB), False, 2 * GiB,
         "cgroup memory.max"),  # pageable host buffers (the emulated device): memlock does not bound them
        (HostLimits(128 * GiB, memlock_bytes=64 * GiB), True, 16 * GiB, "host RAM"),  # above the share
    ],
)
def test_auto_is_the_smallest_bound_and_names_it(limits, pinned, budget_bytes, bound):
    share = ChameleonConfig().host_share(local_ranks=4, pinned=pinned, limits=limits)
    assert share.per_rank_bytes == budget_bytes and share.bound == bound
    assert f"bound: {bound}" in share.describe()
    assert ChameleonConfig().host_memory_budget_bytes(local_ranks=4, pinned=pinned, limits=limits) == budget_bytes


def test_a_byte_budget_stays_as_written():
    limits = HostLimits(128 * GiB, 16 * GiB, "cgroup memory.max", memlock_bytes=64 * MiB)
    share = ChameleonConfig(host_memory_budget="4GiB").host_share(local_ranks=4, pinned=True, limits=limits)
    assert share.per_rank_bytes == 4 * GiB


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A 128 GiB machine, one rank, in a container whose cgroup v2 ``memory.max`` is ``machine(text)``; memlock
    ``machine.memlock_bytes`` (None: unlimited)."""
    pages = 128 * GiB // PAGE_BYTES
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PHYS_PAGES": pages, "SC_PAGE_SIZE": PAGE_BYTES}[name])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(host_limits, "CGROUP_V1_LIMIT_PATH", str(tmp_path / "absent"))
    state = {"memlock": None}

    def getrlimit(which):
        limit = resource.RLIM_INFINITY if state["memlock"] is None else state["memlock"]
        return limit, limit

    monkeypatch.setattr(resource, "getrlimit", getrlimit)

    def cgroup(memory_max: str, memlock_bytes: int | None = None) -> None:
        monkeypatch.setattr(host_limits, "CGROUP_V2_MEMORY_MAX_PATH", _file(tmp_path, "memory.max", memory_max))
        state["memlock"] = memlock_bytes

    return cgroup


def _start_line(caplog) -> str:
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chameleon enabled")]
    return line


def test_the_runtime_reads_the_cgroup_and_its_start_line_names_the_bound(machine, caplog):
    machine(str(16 * GiB))
    assert read_host_limits().shared_bytes() == (16 * GiB, "cgroup memory.max")
    with caplog.at_level(logging.INFO, logger="chameleon_dist"):
        chameleon = Chameleon({"device": {"kind": "emulated"}})
    assert chameleon.device.host_pool.budget_bytes == 8 * GiB  # half the container's 16 GiB, not the RAM's
    line = _start_line(caplog)
    assert "host memory budget 8GiB per rank" in line and "bound: cgroup memory.max" in line, line
    caplog.clear()
    machine("max")
    with caplog.at_level(logging.INFO, logger="chameleon_dist"):
        chameleon = Chameleon({"device": {"kind": "emulated"}})
    assert chameleon.device.host_pool.budget_bytes == 64 * GiB
    assert "bound: host RAM" in _start_line(caplog)


def test_the_cuda_device_pins_at_most_the_memlock_limit(machine, fake_cuda, caplog):  # noqa: F811
    machine("max", memlock_bytes=256 * MiB)
    config = ChameleonConfig.model_validate({"device": {"kind": "cuda"}})
    with caplog.at_level(logging.INFO, logger="chameleon_dist"):
        device = make_device(config)
        assert device.host_pool.budget_bytes == 256 * MiB
        Chameleon(config, device=device)
        emulated = Chameleon({"device": {"kind": "emulated"}})  # pageable host buffers: not bound by memlock
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chameleon enabled")][0]
    assert "host memory budget 256MiB per rank" in line and "bound: RLIMIT_MEMLOCK" in line, line
    assert "ulimit -l" in line
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "RLIMIT_MEMLOCK" in warnings[0] and "host_memory_budget" in warnings[0], warnings
    assert emulated.device.host_pool.budget_bytes == 64 * GiB
