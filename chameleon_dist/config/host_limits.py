"""What bounds the host memory a rank can pin: the machine's RAM, its container's cgroup, ``RLIMIT_MEMLOCK``.

``host_memory_budget: auto`` (and a fraction) is a share of the host memory the node's ranks have between
them: the machine's RAM, or, inside a container, the cgroup's memory limit when that is smaller (cgroup v2
``memory.max``: a number of bytes or ``max``; v1 ``memory.limit_in_bytes``, whose "no limit" is a huge
number near 2**63). The container's own cgroup is the one mounted at ``/sys/fs/cgroup`` (cgroup namespaces,
the default of Docker and Kubernetes). ``RLIMIT_MEMLOCK`` is per process: page-locked memory beyond it
cannot be registered, so a rank that pins (the CUDA device) takes at most that much, whatever its share.
``HostShare`` (``config/node.py``) applies them; its ``describe()`` names the bound that applied ("host
RAM", "cgroup memory.max", "cgroup memory.limit_in_bytes" or "RLIMIT_MEMLOCK") in the start log line.

Each reader takes its source as a parameter (file paths, a ``getrlimit``), so tests feed fake ones.
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

HOST_RAM = "host RAM"
CGROUP_V2 = "cgroup memory.max"
CGROUP_V1 = "cgroup memory.limit_in_bytes"
RLIMIT_MEMLOCK = "RLIMIT_MEMLOCK"

CGROUP_V2_MEMORY_MAX_PATH = "/sys/fs/cgroup/memory.max"
CGROUP_V1_LIMIT_PATH = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
CGROUP_V1_NO_LIMIT_BYTES = 2**62
"""A v1 limit at or above this is "no limit" (the kernel writes its page counter maximum, about 2**63)."""


@dataclasses.dataclass(frozen=True)
class HostLimits:
    """The bounds read at start: ``ram_bytes`` (None: unknown), the cgroup's limit and which file said so
    (None: none), and ``RLIMIT_MEMLOCK``'s soft limit (None: unlimited or unknown)."""

    ram_bytes: int | None
    cgroup_bytes: int | None = None
    cgroup_bound: str = CGROUP_V2
    memlock_bytes: int | None = None

    def shared_bytes(self) -> tuple[int | None, str]:
        """The host memory the node's (or container's) ranks share, and its bound: the smaller of the RAM and
        the cgroup's limit."""
        if self.cgroup_bytes is not None and (self.ram_bytes is None or self.cgroup_bytes < self.ram_bytes):
            return self.cgroup_bytes, self.cgroup_bound
        return self.ram_bytes, HOST_RAM


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_cgroup_limit(v2_path: str | None = None, v1_path: str | None = None) -> tuple[int | None, str]:
    """The cgroup's memory limit in bytes and the bound's name: v2 ``memory.max`` when that file exists
    ("max": no limit), else v1 ``memory.limit_in_bytes`` (its huge "no limit" value: none). (None, name)
    when there is no limit or nothing readable."""
    text = _read_text(CGROUP_V2_MEMORY_MAX_PATH if v2_path is None else v2_path)
    if text is not None:
        return (None if text == "max" else _positive(text)), CGROUP_V2
    text = _read_text(CGROUP_V1_LIMIT_PATH if v1_path is None else v1_path)
    limit_bytes = None if text is None else _positive(text)
    if limit_bytes is not None and limit_bytes >= CGROUP_V1_NO_LIMIT_BYTES:
        limit_bytes = None
    return limit_bytes, CGROUP_V1


def _positive(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


def read_memlock_bytes(getrlimit: Callable[[int], tuple[int, int]] | None = None) -> int | None:
    """``RLIMIT_MEMLOCK``'s soft limit in bytes (what this process may page-lock); None when unlimited or
    unknown. ``getrlimit`` defaults to ``resource.getrlimit``."""
    try:
        import resource
    except ImportError:  # (not on this platform)
        return None
    soft_bytes, _hard_bytes = (resource.getrlimit if getrlimit is None else getrlimit)(resource.RLIMIT_MEMLOCK)
    if soft_bytes == resource.RLIM_INFINITY or soft_bytes < 0:
        return None
    return int(soft_bytes)


def physical_memory_bytes() -> int | None:
    """This machine's physical RAM in bytes, or None where the OS does not say."""
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page_bytes = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page_bytes if pages > 0 and page_bytes > 0 else None


def read_host_limits(ram_bytes: int | None = None, *, v2_path: str | None = None, v1_path: str | None = None,
                     getrlimit: Callable[[int], tuple[int, int]] | None = None) -> HostLimits:
    """Every bound, read now: ``ram_bytes`` (default: ``physical_memory_bytes()``), the cgroup's limit, the
    memlock limit."""
    cgroup_bytes, cgroup_bound = read_cgroup_limit(v2_path, v1_path)
    return HostLimits(
        ram_bytes=physical_memory_bytes() if ram_bytes is None else ram_bytes,
        cgroup_bytes=cgroup_bytes, cgroup_bound=cgroup_bound, memlock_bytes=read_memlock_bytes(getrlimit),
    )
