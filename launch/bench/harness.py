"""What every benchmark in launch/ shares: round orders, quartiles, the variant record, a report's
fields, and the frame of the results (header, config, wall time, JSON).

The scripts are modules of the package ``launch`` (namespace packages: no ``__init__.py``, in rooms: README
"``launch/``: the scripts, in rooms") and run as ``python -m launch.bench.<script>`` from the repository root,
which ``-m`` puts on ``sys.path``; they import each other as ``from launch.bench.harness import ...``, as the
tests do (``from launch.bench import bench_executor``; pytest's ``pythonpath`` option puts the root there).
Nothing edits ``sys.path``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from chameleon_dist.schema_version import versioned


# ---- rounds -------------------------------------------------------------------------------------
def balanced_orders(n: int, mirror_odd: bool = True) -> list[tuple[int, ...]]:
    """Williams design: orders of ``n`` variants in which each one comes right before each other equally
    often, so whatever a variant leaves behind (garbage, a cold cache, a profiler's buffers) is charged to
    every other variant alike. ``n`` orders; for odd ``n`` with ``mirror_odd`` the ``n`` reversed ones
    follow (2n orders, the balanced design for odd n). For n = 4: (0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0),
    (3, 0, 2, 1)."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    rows = [tuple((x + i) % n for x in first) for i in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 and mirror_odd else rows


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` rotated by ``round_index``: round r starts with the r-th (mod len) name."""
    return [names[(round_index + k) % len(names)] for k in range(len(names))]


# ---- statistics ---------------------------------------------------------------------------------
def quartiles(values: Sequence[float], method: str = "exclusive") -> list[float]:
    """``[q1, q3]`` of ``values`` (``statistics.quantiles`` with ``method``); a single value is both."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method=method)
    return [q[0], q[2]]


# ---- variants -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VariantSpec:
    """What one variant of a benchmark runs: its ``name``, the Chameleon config (None: no runtime),
    without a runtime how its forward pass keeps its saved activations (``saving``): "device" (on the
    device), "save_on_cpu" (``torch.autograd.graph.save_on_cpu`` semantics) or "checkpoint" (activation
    checkpointing of every layer), and whether it is the ``reference`` the others are compared with (the
    unconstrained run: unbounded memory, nothing swapped). Each benchmark's variant classes take one for
    what they run, and its code asks the spec, never the name, what a variant is."""

    name: str
    config: dict | None = None
    saving: str = "device"
    reference: bool = False

    def __post_init__(self) -> None:
        if self.saving not in ("device", "save_on_cpu", "checkpoint"):
            raise ValueError(f"VariantSpec.saving: {self.saving!r} is not 'device', 'save_on_cpu' or 'checkpoint'")


# ---- reports ------------------------------------------------------------------------------------
def report_fields(report: Any, *names: str) -> dict:
    """The named fields of an ``IterationReport`` (read through ``to_dict()``), in that order; a name
    ``"key=field"`` puts the report's ``field`` under ``key`` (``"peak_bytes=peak_device_bytes"``)."""
    fields = report.to_dict()
    out = {}
    for name in names:
        key, _, field = name.partition("=")
        out[key] = fields[field or key]
    return out


# ---- results ------------------------------------------------------------------------------------
def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def machine(torch_module) -> dict:
    """The machine block of a benchmark's JSON (the load average is taken now, as "before")."""
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch_threads": torch_module.get_num_threads(),
            "torch": torch_module.__version__, "python": platform.python_version(),
            "load_average_before": load_average()}


def header(module: str, argv: list[str], torch_module) -> dict:
    """The opening of a benchmark's results: the command that reproduces it (``module``: the script's module,
    ``"launch.bench.bench_executor"``, run with ``-m``), the date, the machine; first, the JSON's
    ``schema_version``."""
    return versioned({
        "command": shlex.join([".venv/bin/python", "-m", module, *argv]),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(torch_module),
    })


def finish(results: dict, started_s: float) -> None:
    """Close a benchmark's results: its wall time (since ``started_s``, a perf_counter) and the load now."""
    results["wall_s"] = time.perf_counter() - started_s
    results["machine"]["load_average_after"] = load_average()


def write_json(path: Path | None, results: dict) -> None:
    """Write ``results`` to ``path`` (if given) and say so."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(versioned(results), indent=2) + "\n")  # (one without a header gets one too)
    print(f"results written to {path}")


def config_of(args, skip: Iterable[str] = (), as_text: tuple[type, ...] = (Path,)) -> dict:
    """``args`` as the results' config: values of the ``as_text`` types as strings, ``skip`` left out."""
    skip = set(skip)
    return {k: (str(v) if isinstance(v, as_text) else v) for k, v in vars(args).items() if k not in skip}


def run_benchmark(module: str, argv: list[str], args, torch_module, run: Callable[[Any], dict],
                  report: Callable[[dict], None], *, emulated: bool = True, config: dict | bool = True) -> dict:
    """The common frame of a benchmark: ``run(args)`` with ``args.threads`` torch threads (restored after;
    no change without a ``threads`` argument), its results after the header (command, date, machine),
    ``"emulated": True`` (if ``emulated``) and the config (a dict; True: ``config_of(args)``, taken before
    the run; False: none), then the wall time, ``report(results)`` and the JSON at ``args.json``."""
    threads_before = torch_module.get_num_threads()
    if getattr(args, "threads", None):
        torch_module.set_num_threads(args.threads)
    try:
        started = time.perf_counter()
        results = header(module, argv, torch_module)
        if emulated:
            results["emulated"] = True
        if config is not False:
            results["config"] = config_of(args) if config is True else config
        results.update(run(args))
        finish(results, started)
    finally:
        torch_module.set_num_threads(threads_before)
    report(results)
    write_json(args.json, results)
    return results
