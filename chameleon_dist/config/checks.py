"""Checks of budgets against the memory they budget, and of a passed device against the config.

Each function returns a problem line (without the setting's path) or ``None`` / a list of
``"path: problem"`` lines, so that callers report every problem at once in one ``ConfigError``. The
schema runs what it can know from the config alone (a byte budget above ``device.capacity``); the runtime
runs the rest once the device exists (a device passed to ``Chameleon(device=...)``, the real capacity,
this machine's RAM), from the budgets resolved at start (``config/budgets.py``): nothing here reads the
machine. Devices are duck-typed: nothing here imports torch.
"""

from __future__ import annotations

import math

from typing import Any

from chameleon_dist.config.sizes import Budget, format_size

SMALL_BUDGET_MAX = 100
"""A bare integer budget up to this many bytes is taken for a mistake (a percentage or 1 meant as 100%)."""

PASSED_DEVICE = "the device passed to Chameleon(device=...)"


def device_setting_problem(device: Any, emulated_only: tuple[str, ...]) -> tuple[str, str] | None:
    """(field, message) for a ``device`` section whose settings contradict each other, else None: what only the
    emulated device models (meta tensors, the caching allocator, compute figures) asked of a GPU, and
    ``expandable_segments`` without the caching allocator it is an option of."""
    if device.kind == "cuda" and device.meta_tensors:
        return "meta_tensors", ("meta tensors hold no data and run only on the emulated device: remove "
                                "device.meta_tensors or use kind: emulated")
    if device.expandable_segments and not device.caching_allocator:
        return "expandable_segments", ("device.expandable_segments models the caching allocator's option: set "
                                       "device.caching_allocator: true too (on a GPU: "
                                       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    if device.kind == "cuda" and device.caching_allocator:
        return "caching_allocator", ("device.caching_allocator models a GPU's allocator on the emulated device: "
                                     "remove it or use kind: emulated")
    given = [name for name in emulated_only if getattr(device, name) is not None]
    if device.kind == "cuda" and given:
        names = " and ".join(f"device.{name}" for name in given) + ("," if len(given) > 1 else "")
        return given[0], f"only the emulated device models compute; remove {names} or use kind: emulated"
    return None


def _bytes(nbytes: int) -> str:
    return f"{format_size(nbytes)} ({nbytes} bytes)"


def small_budget_problem(value: Any, budget_bytes: int, total: str) -> str:
    """The line for a bare integer budget of ``budget_bytes`` <= SMALL_BUDGET_MAX (``total``: what it shares)."""
    return (f"{value!r} would be {budget_bytes} bytes; for a share of {total} write a fraction such as 0.9 "
            '(or "auto"), for a size write it with a unit such as "40GB"')


def budget_over_total_problem(budget: Budget, total_bytes: int | None, total: str, what: str) -> str | None:
    """A byte budget above ``total_bytes`` (fractions and "auto" always fit). ``total`` names the total
    (e.g. "device.capacity"), ``what`` the setting to change."""
    if total_bytes is None or not isinstance(budget, int) or isinstance(budget, bool) or budget <= total_bytes:
        return None
    return (f"{_bytes(budget)} is above {total} {_bytes(total_bytes)}; lower {what}, or write a fraction "
            f"of it such as 0.9")


def device_conflicts(settings: Any, device: Any, capacity_bytes: int | None = None) -> list[str]:
    """``"device.<field>: ..."`` for each field the user set in the config's ``device`` section (pydantic's
    ``model_fields_set``, values other than null/"auto") that the passed ``device`` contradicts.
    ``capacity_bytes``: the device's capacity as resolved at start (default: asked of the device now)."""
    if capacity_bytes is None:
        capacity_bytes = device.capacity_bytes
    problems = []
    given = {name for name in settings.model_fields_set if getattr(settings, name) not in (None, "auto")}
    emulated = bool(getattr(device, "emulated", False))

    def conflict(name: str, config_text: str, device_text: str) -> None:
        problems.append(
            f"device.{name}: the config sets {config_text} but {PASSED_DEVICE} has {device_text}; remove "
            f"device.{name} from the config or pass a device that matches it"
        )

    if "kind" in given and (settings.kind == "emulated") != emulated:
        conflict("kind", repr(settings.kind), "kind 'emulated'" if emulated else "kind 'cuda'")
    if "capacity" in given and settings.capacity != capacity_bytes:
        conflict("capacity", _bytes(settings.capacity), f"capacity {_bytes(capacity_bytes)}")
    if "enforce_capacity" in given and not emulated:  # the emulated device always enforces its capacity
        enforced = bool(getattr(device, "capacity_enforced", False))
        if enforced != settings.enforce_capacity:
            conflict("enforce_capacity", str(settings.enforce_capacity).lower(),
                     "its capacity enforced" if enforced else "its capacity not enforced")
    for name in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
        if name in given and emulated:  # (only the emulated device's link is its own to compare)
            rate = getattr(device, name)  # Device.h2d_bytes_per_s / d2h_bytes_per_s; inf: an instant link
            if math.isinf(rate) or float(rate) != float(getattr(settings, name)):
                device_rate = "an instant link" if math.isinf(rate) else f"{name} {rate:.6g}"
                conflict(name, f"{getattr(settings, name)} bytes per second", device_rate)
    if "preset" in given and emulated:
        model = getattr(device, "model", None)
        preset = None if model is None else model.preset
        if preset != settings.preset:
            conflict("preset", repr(settings.preset), "no preset" if preset is None else f"preset {preset!r}")
    return problems


def runtime_problems(config: Any, device: Any, budgets: Any, *, device_passed: bool) -> list[str]:
    """Every ``"path: problem"`` the runtime finds once ``device`` exists, from the budgets resolved at start
    (``budgets``: ``config/budgets.py``'s ``ResolvedBudgets``): a byte ``memory_budget`` above the device's
    capacity, a byte ``host_memory_budget`` above this machine's RAM (unknown: no check), and, when
    ``device_passed``, config ``device`` settings that contradict it, and a host budget of the config's that
    differs from the one the device's host pool has."""
    problems = []
    budget = budget_over_total_problem(config.memory_budget, budgets.capacity_bytes, budgets.capacity_source,
                                       "memory_budget")
    if budget is not None:
        problems.append(f"memory_budget: {budget}")
    host = budget_over_total_problem(config.host_memory_budget, budgets.ram_bytes, budgets.ram_source,
                                     "host_memory_budget")
    if host is not None:
        problems.append(f"host_memory_budget: {host}")
    if device_passed:
        problems.extend(device_conflicts(config.device, device, budgets.capacity_bytes))
        has_bytes = budgets.device_host_budget_bytes  # (None: the runtime applies the config's)
        if host is None and has_bytes is not None and "host_memory_budget" in config.model_fields_set:
            wanted = budgets.host.per_rank_bytes
            if wanted is not None and wanted != has_bytes:
                problems.append(
                    f"host_memory_budget: the config sets {_bytes(wanted)} "
                    f"but {PASSED_DEVICE} has a host pool with {_bytes(has_bytes)}; give the device "
                    "host_memory_budget_bytes, or remove host_memory_budget from the config"
                )
    return problems


def model_fit_problem(model_name: str, model_bytes: int, live_bytes: int, capacity_bytes: int) -> str | None:
    """``attach()`` of a model whose parameters and buffers (``model_bytes``; ``live_bytes`` on the
    device in all) leave no room on a device of ``capacity_bytes``: every iteration would fail."""
    if live_bytes <= capacity_bytes and model_bytes <= capacity_bytes:
        return None
    others = f" ({_bytes(live_bytes)} on the device in all)" if live_bytes != model_bytes else ""
    return (f"device.capacity: the parameters and buffers of {model_name} take {_bytes(model_bytes)}{others}, "
            f"more than the device's capacity {_bytes(capacity_bytes)}; raise device.capacity (or pass a "
            "device with more memory), or shard the model")
