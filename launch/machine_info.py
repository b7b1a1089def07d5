"""What the benchmark scripts in launch/ print about the machine they ran on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(torch_module) -> dict:
    """The machine block of a benchmark's JSON (the load average is taken now, as "before")."""
    import os

    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch_threads": torch_module.get_num_threads(),
            "torch": torch_module.__version__, "python": platform.python_version(),
            "load_average_before": os.getloadavg()[0]}


def header(script: str, argv: list[str], torch_module) -> dict:
    """The opening of a benchmark's results: the command that reproduces it, the date, the machine."""
    import datetime as dt
    import shlex

    return {
        "command": shlex.join([".venv/bin/python", f"launch/{script}", *argv]),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(torch_module),
    }


def finish(results: dict, started_s: float) -> None:
    """Close a benchmark's results: its wall time (since ``started_s``, a perf_counter) and the load now."""
    import os
    import time

    results["wall_s"] = time.perf_counter() - started_s
    results["machine"]["load_average_after"] = os.getloadavg()[0]


def write_json(path: Path | None, results: dict) -> None:
    """Write ``results`` to ``path`` (if given) and say so."""
    import json

    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results written to {path}")


def run_benchmark(script: str, argv: list[str], args, torch_module, run, report) -> dict:
    """The common frame of a benchmark: ``run(args)`` with ``args.threads`` torch threads (restored
    after), its results after the header (command, date, machine) and the config, then the wall time,
    ``report(results)`` and the JSON at ``args.json``."""
    import time

    threads_before = torch_module.get_num_threads()
    torch_module.set_num_threads(args.threads)
    try:
        started = time.perf_counter()
        results = {
            **header(script, argv, torch_module),
            "emulated": True,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            **run(args),
        }
        finish(results, started)
    finally:
        torch_module.set_num_threads(threads_before)
    report(results)
    write_json(args.json, results)
    return results
