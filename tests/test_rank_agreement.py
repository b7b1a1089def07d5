"""``agree_on_settings`` (issue 37 item 12): ranks that start with different Chameleon settings, or with Chameleon
on some ranks only, are refused at start on every rank, naming the settings and the ranks; a rank that never
reaches the check is named after the wait. The ranks here are threads sharing one key-value store (what the
default process group's store is to processes); ``tests/test_rank_faults.py`` runs the launchers' ranks."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from chameleon_dist.config import ChameleonConfig
from chameleon_dist.config.errors import ConfigError
from chameleon_dist.integrations.rank_agreement import agree_on_settings, canonical_settings, differences


def _ranks(configs, store=None, wait_s=30.0, absent=()):
    """Run the check on one thread per config (rank = index; ranks in ``absent`` never call it); each rank's
    outcome: None or the error it raised."""
    store = dist.HashStore() if store is None else store
    outcomes: dict[int, BaseException | None] = {}

    def rank(r):
        try:
            agree_on_settings(configs[r], store=store, rank=r, world_size=len(configs), wait_s=wait_s)
            outcomes[r] = None
        except BaseException as exc:  # noqa: BLE001 - the test reads every rank's outcome
            outcomes[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(configs)) if r not in absent]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


def test_ranks_with_the_same_settings_start():
    config = ChameleonConfig(memory_budget="5MB", device={"capacity": "10MB"})
    same = ChameleonConfig(memory_budget=5 * 10**6, device={"capacity": "10MB"})  # the same size, written otherwise
    assert _ranks([config, same, config]) == {0: None, 1: None, 2: None}


def test_a_different_budget_is_refused_on_every_rank_naming_the_setting_and_the_ranks():
    outcomes = _ranks([ChameleonConfig(memory_budget="5MB"), ChameleonConfig(memory_budget="5MB"),
                       ChameleonConfig(memory_budget="4MB")])
    assert set(outcomes) == {0, 1, 2}
    messages = {str(exc) for exc in outcomes.values()}
    assert all(isinstance(exc, ConfigError) for exc in outcomes.values()), outcomes
    assert len(messages) == 1, messages  # every rank says the same
    message = messages.pop()
    assert "memory_budget differs between ranks: 5000000 on ranks 0, 1; 4000000 on rank 2" in message, message
    assert "device.capacity" not in message


def test_chameleon_on_one_rank_only_is_named_alone():
    on = ChameleonConfig(profiler={"cosine_threshold": 0.9})
    off = ChameleonConfig(enabled=False)
    outcomes = _ranks([on, off])
    message = str(outcomes[0])
    assert str(outcomes[1]) == message
    lines = [line.strip(" -") for line in message.splitlines()]
    assert lines[1] == "enabled differs between ranks: true on rank 0; false on rank 1", lines
    assert not any("cosine_threshold" in line for line in lines), lines  # (not used on the rank with Chameleon off)


def test_a_rank_that_never_comes_is_named_after_the_wait():
    config = ChameleonConfig()
    outcomes = _ranks([config, config, config], wait_s=0.5, absent=(1,))
    assert set(outcomes) == {0, 2}
    for exc in outcomes.values():
        assert isinstance(exc, ConfigError), outcomes
        assert "rank 1 of 3 did not reach Chameleon's settings check within 0.5 s" in str(exc), exc


def test_a_policy_knob_is_named():
    outcomes = _ranks([ChameleonConfig(), ChameleonConfig(profiler={"cosine_threshold": 0.9})])
    assert "profiler.cosine_threshold differs between ranks: 0.95 on rank 0; 0.9 on rank 1" in str(outcomes[1])


def test_the_nth_check_of_each_rank_meets_the_nth_of_the_others():
    """Two installs one after the other in one job: the second check compares the second settings (not the
    records the first check left in the store)."""
    store = dist.HashStore()
    assert _ranks([ChameleonConfig(), ChameleonConfig()], store=store) == {0: None, 1: None}
    outcomes = _ranks([ChameleonConfig(min_swap_bytes=1024), ChameleonConfig(min_swap_bytes=2048)], store=store)
    assert "min_swap_bytes differs between ranks: 1024 on rank 0; 2048 on rank 1" in str(outcomes[0])


def test_one_rank_or_no_process_group_checks_nothing():
    agree_on_settings(ChameleonConfig())  # no process group in this test process
    agree_on_settings(ChameleonConfig(), store=dist.HashStore(), rank=0, world_size=1)


def test_differences_name_the_prefix_and_a_setting_one_rank_lacks():
    records = {0: canonical_settings(ChameleonConfig()), 1: {**canonical_settings(ChameleonConfig()), "extra": 1}}
    assert differences(records, "chameleon.") == [
        'chameleon.extra differs between ranks: "<unset>" on rank 0; 1 on rank 1']
    assert differences({0: records[0], 1: records[0]}) == []


def test_a_torchrun_restart_starts_its_own_count(monkeypatch):
    """Attempt 0 failed after rank 0 came to the check and before rank 1 did; torchrun restarts the ranks with
    the same store: attempt 1's ranks must meet (not rank 0's second check against rank 1's first)."""
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _ranks([ChameleonConfig(), ChameleonConfig()], store=store, wait_s=0.3, absent=(1,)).keys() == {0}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _ranks([ChameleonConfig(), ChameleonConfig()], store=store, wait_s=30) == {0: None, 1: None}


def test_a_survivor_names_the_peer_whose_process_ended():
    import os
    import socket
    import subprocess

    from chameleon_dist.integrations.rank_agreement import Peers

    ended = subprocess.Popen(["true"])
    ended.wait()
    here = socket.gethostname()
    peers = Peers(0, {0: (here, os.getpid()), 1: (here, ended.pid), 2: ("another-host", ended.pid)})
    assert peers.gone() == [1]  # (another host's processes cannot be seen from here)
    assert peers.describe_gone().startswith(f"rank 1 of 3 is gone (process ended: pid {ended.pid} on {here})")
    assert Peers(0, {0: (here, os.getpid()), 1: (here, os.getppid())}).describe_gone(grace_s=0) is None
