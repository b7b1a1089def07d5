"""host_memory_budget is one node's RAM shared among the node's ranks (LOCAL_WORLD_SIZE); bytes stay per rank."""

from __future__ import annotations

import logging

import pytest

from chameleon_dist import Chameleon, ChameleonConfig, ConfigError

GiB = 2**30
PAGE_BYTES = 4096


@pytest.fixture
def node(monkeypatch, tmp_path):
    """A node of 128 GiB RAM (no cgroup memory limit, whatever this machine's); ``node(ranks)`` sets
    LOCAL_WORLD_SIZE."""
    from chameleon_dist.config import host_limits

    pages = 128 * GiB // PAGE_BYTES
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PHYS_PAGES": pages, "SC_PAGE_SIZE": PAGE_BYTES}[name])
    for name in ("CGROUP_V2_MEMORY_MAX_PATH", "CGROUP_V1_LIMIT_PATH"):
        monkeypatch.setattr(host_limits, name, str(tmp_path / "absent"))

    def ranks(count: int | str | None) -> None:
        if count is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(count))

    return ranks


def test_auto_is_half_the_node_divided_among_its_ranks(node):
    node(8)
    assert ChameleonConfig().host_memory_budget_bytes() == 8 * GiB  # 64 GiB for the node, 8 ranks
    node(None)
    assert ChameleonConfig().host_memory_budget_bytes() == 64 * GiB  # one rank: half the node


def test_a_fraction_is_of_the_node_and_divided_too_but_bytes_stay_per_rank(node):
    node(4)
    assert ChameleonConfig(host_memory_budget=0.25).host_memory_budget_bytes() == 8 * GiB
    assert ChameleonConfig(host_memory_budget=0.1).host_memory_budget_bytes(1000, local_ranks=3) == 33
    assert ChameleonConfig(host_memory_budget="4GiB").host_memory_budget_bytes() == 4 * GiB


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_local_world_size_names_it(value):
    from chameleon_dist.config.node import local_world_size

    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE") as info:
        local_world_size({"LOCAL_WORLD_SIZE": value})
    assert "host_memory_budget" in str(info.value)
    assert local_world_size({}) == 1 and local_world_size({"LOCAL_WORLD_SIZE": " 8 "}) == 8


def test_the_report_and_log_line_carry_the_per_rank_figure(node, caplog):
    node(8)
    with caplog.at_level(logging.INFO, logger="chameleon_dist"):
        chameleon = Chameleon({"device": {"kind": "emulated"}})
    assert chameleon.device.host_pool.budget_bytes == 8 * GiB
    with chameleon.iteration():
        pass
    assert chameleon.last_report.host_memory_budget_bytes == 8 * GiB
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chameleon enabled")]
    assert "host memory budget 8GiB per rank" in line and "8 ranks" in line and "128GiB" in line, line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # auto: half the node in all


def test_byte_budgets_pinning_more_than_half_the_node_warn_once_naming_the_setting(node, caplog):
    node(8)
    with caplog.at_level(logging.WARNING, logger="chameleon_dist"):
        chameleon = Chameleon({"host_memory_budget": "10GiB", "device": {"kind": "emulated"}})
        for _ in range(3):
            with chameleon.iteration():
                pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "host_memory_budget" in warnings[0] and "80GiB" in warnings[0] and "8 ranks" in warnings[0]
    assert chameleon.device.host_pool.budget_bytes == 10 * GiB  # an explicit byte budget stays per rank
