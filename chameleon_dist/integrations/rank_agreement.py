"""``agree_on_settings``: every rank of a job starts with the same Chameleon settings, or none starts.

Ranks with different settings (another memory budget, other policy thresholds, Chameleon on some ranks
only) swap, retry and fail in different places: one rank's passive swap or out-of-memory error leaves its
peers waiting in a collective. So at install, before any collective of the integration, each rank writes a
canonical form of its settings (the config as the rank parsed it, ``enabled`` included) into the default
process group's key-value store and waits for every other rank's; all ranks compare the same records and,
when they differ, every rank raises the same ``ConfigError`` naming each differing setting (its field path)
and the ranks on each value.

Only the store is used, never a collective: a rank that never reaches the check (started through plain
``deepspeed.initialize`` rather than Chameleon's integration, or one that failed before it) cannot pair a
collective of the check with one of its own. The waiting ranks raise after ``wait_s``, naming the ranks that
did not come. The integrations call the check on every rank whether Chameleon is enabled or not.

Each rank counts its own calls (a counter key per rank in the store), so the n-th check of one rank meets
the n-th check of the others (two installs in one job, one after the other); the keys of a torchrun restart
(``TORCHELASTIC_RESTART_COUNT``) are its own, so an attempt that failed half-way through a check leaves the next
attempt's counts alike. Nothing is kept in the module.

The check also records where each rank runs (host and process id) and returns it as ``Peers``: when a rank's
iteration fails in a multi-rank job, ``Peers.gone`` names the ranks of this host whose process has ended (a
rank killed with SIGKILL writes nothing; its survivors' collectives only see a closed connection), so that a
survivor's error names the dead rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from chameleon_dist.config import ChameleonConfig
from chameleon_dist.config.errors import ConfigError

logger = logging.getLogger(__name__)

SETTINGS_WAIT_S = 600.0
"""How long a rank waits at the check for the other ranks' settings (ranks reach install at different
times: pipeline stages build different layers)."""

KEY_PREFIX = "chameleon_dist/settings"


def canonical_settings(config: ChameleonConfig) -> dict[str, Any]:
    """The config as flat ``{field path: JSON value}`` (``device.capacity``), ``enabled`` included; sizes are
    compared as the parsed numbers (``"40GB"`` and ``40000000000`` agree)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key in sorted(value):
                walk(f"{prefix}{key}.", value[key])
        else:
            flat[prefix[:-1]] = value

    walk("", config.model_dump(mode="json"))
    return flat


@dataclasses.dataclass(frozen=True)
class Peers:
    """Where the ranks of the job run: ``places[rank] = (host, pid)``; ``rank`` is this rank."""

    rank: int
    places: dict[int, tuple[str, int]]

    def gone(self) -> list[int]:
        """The other ranks on this host whose process has ended (or is a zombie: ended, not yet reaped)."""
        host = socket.gethostname()
        return [r for r, (where, pid) in sorted(self.places.items())
                if r != self.rank and where == host and not _alive(pid)]

    def describe_gone(self, grace_s: float = 1.0) -> str | None:
        """A line naming the ranks that are gone, None when none is (or none can be seen from this host).
        ``grace_s``: how long to look again (a killed process closes its connections a moment before it ends)."""
        deadline = time.monotonic() + grace_s
        gone = self.gone()
        while not gone and time.monotonic() < deadline:
            time.sleep(0.05)
            gone = self.gone()
        if not gone:
            return None
        pids = ", ".join(f"pid {self.places[r][1]}" for r in gone)
        return (f"{_ranks(gone)} of {len(self.places)} {'are' if len(gone) > 1 else 'is'} gone (process ended: "
                f"{pids} on {self.places[gone[0]][0]}): this rank's failure follows from it; read that rank's "
                "log and the launcher's exit codes (-9: killed, e.g. by the host's out-of-memory killer)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def differences(records: Mapping[int, Mapping[str, Any]], prefix: str = "") -> list[str]:
    """One line per setting that is not the same on every rank: its path (after ``prefix``, e.g.
    ``chameleon.``) and the ranks on each value. When ``enabled`` differs it is the only line: the other
    settings of a rank with Chameleon off are not used (a DeepSpeed config without the block has only defaults).
    Empty when the ranks agree."""
    paths = sorted({path for record in records.values() for path in record}, key=lambda p: (p != "enabled", p))
    lines = []
    for path in paths:
        by_value: dict[str, list[int]] = {}
        for rank in sorted(records):
            by_value.setdefault(json.dumps(records[rank].get(path, "<unset>")), []).append(rank)
        if len(by_value) > 1:
            values = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in by_value.items())
            lines.append(f"{prefix}{path} differs between ranks: {values}")
            if path == "enabled":
                break
    return lines


def agree_on_settings(config: ChameleonConfig, *, prefix: str = "", wait_s: float = SETTINGS_WAIT_S,
                      store: Any = None, rank: int | None = None, world_size: int | None = None) -> Peers | None:
    """Check that every rank of the default process group starts with this rank's settings (a no-op without a
    process group or with one rank). ``prefix``: how the user's config spells the settings' root
    (``chameleon.`` in a DeepSpeed config). ``store``, ``rank``, ``world_size``: the default group's unless
    given. Returns where each rank runs (None without a process group or with one rank).

    Raises:
        ConfigError: on every rank, when the settings differ (naming each setting and the ranks on each
            value), or when some ranks did not reach the check within ``wait_s`` (naming them).
    """
    if store is None:
        if not dist.is_available() or not dist.is_initialized():
            return None
        # (no public accessor: the default group's store, which every rank of the group shares)
        get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        if get_store is None:
            logger.warning("this torch has no default process-group store: the ranks' Chameleon settings are not "
                           "compared; start every rank with the same settings")
            return None
        store = get_store()
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    if world_size <= 1:
        return None
    root = f"{KEY_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    call = int(store.add(f"{root}/calls/{rank}", 1))
    keys = [f"{root}/{call}/{r}" for r in range(world_size)]
    store.set(f"{root}/{call}/place/{rank}", json.dumps([socket.gethostname(), os.getpid()]))
    store.set(keys[rank], json.dumps(canonical_settings(config), sort_keys=True))  # (after the place: waited on)
    try:
        store.wait(keys, datetime.timedelta(seconds=wait_s))
    except Exception as exc:  # noqa: BLE001 - the store's timeout (DistStoreError, RuntimeError on older torch)
        missing = [r for r, key in enumerate(keys) if not _present(store, key)]
        if not missing:
            raise
        raise ConfigError([
            f"{_ranks(missing)} of {world_size} did not reach Chameleon's settings check within {wait_s:g} s "
            f"(rank {rank} waited): start every rank through Chameleon's integration (Megatron: install; "
            "DeepSpeed: chameleon_dist.integrations.deepspeed.initialize), with Chameleon enabled or disabled on "
            "all of them alike"]) from exc
    records = {r: json.loads(store.get(key)) for r, key in enumerate(keys)}
    problems = differences(records, prefix)
    if problems:
        raise ConfigError([*problems, f"start every rank with the same Chameleon settings ({world_size} ranks; "
                                      "a rank with other settings would swap or fail where its peers wait in a "
                                      "collective)"])
    logger.debug("settings agree on %d ranks (check %d)", world_size, call)
    places = {r: json.loads(store.get(f"{root}/{call}/place/{r}")) for r in range(world_size)}
    return Peers(rank, {r: (str(host), int(pid)) for r, (host, pid) in places.items()})


def _present(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - a store that is gone: the rank counts as missing
        return False
