"""The GPU check: everything that only a CUDA machine can tell us, in one run of under 8 minutes on one GPU,
written to one JSON (``<out>/gpu_check.json``).

    .venv/bin/python -m launch.gpu_check --out runs/gpu_check            # on a CUDA machine
    .venv/bin/python -m launch.gpu_check --out /tmp/gpu_check --dry-run  # CPU: the same steps, tiny and fast

First, before any device time is spent, the preflight (``launch/gpu_preflight.py``) imports every module each
wanted part needs in a fresh interpreter; a missing one ends the check at once (exit status 2) with one message
naming the distributions to carry (``launch/gpu_wheels.sh``). Then its parts, in this order, each in its own
process (group) with its own time limit (a part that fails or runs out of time is recorded, its processes are
ended, and the next one runs; the JSON is written after every part, so a killed check keeps what it had):

1. ``gpu_tests``: the ``gpu``-marked tests (``pytest -m gpu`` over the test files that have them); on a
   CPU they skip, which the dry run shows.
2. ``probes``: ``launch/bench/gpu_probes.py``: relief with the capacity enforced and no iteration retry (at least one op
   relieved, bit-identical), a side-stream backward + BatchNorm model, no pageable fallback buffers, measured
   D2H/H2D/duplex copy rates beside the preset's, Chameleon's added host time per op.
3. ``gpu_tests_sanitized``: the ``gpu`` tests again under PyTorch's CUDA stream sanitizer
   (``TORCH_CUDA_SANITIZER=1``: an access racing another stream's fails its test).
4. ``megatron_2rank``: ``-m launch.train_megatron --tp 2`` on two ranks, without Chameleon (metered) and with
   it, compared by ``launch/bench/compare_reports.py`` (bit-identical, within capacity, Stable reached).
5. ``deepspeed_2rank``: ``launch/train_deepspeed.py`` on two ranks, ZeRO-2 (ZeRO-0 when the ranks share one GPU,
   see below), without and with Chameleon, compared the same way.
6. ``bench_gpu``: ``launch/bench/bench_gpu.py``, time-boxed to what is left (at most 3 minutes).

Two ranks on a machine with one GPU share it (``launch/cuda_ranks.py``): NCCL refuses that, so they use
gloo, which moves CUDA tensors only by all-reduce and broadcast: tensor parallelism (no pipeline send) and
ZeRO stage 0 (gradients all-reduced). With two GPUs or more, every rank has its own and NCCL.

The dry run (``--dry-run``) runs the same parts on the CPU (emulated devices, 4 iterations, the probes' and
bench_gpu's own dry runs); the test suite runs it (``tests/test_gpu_check.py``: the single-process parts and the
rank parts as two dry runs side by side). Its times mean nothing; its structure and bits do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.bench.compare_reports import compare, stable_window
from launch.gpu_preflight import gpu_test_files, preflight
from launch.bench.harness import header

REPO = Path(__file__).resolve().parents[1]

TAIL_CHARS = 4000
END_GRACE_S = 10.0  # a part past its limit: SIGTERM, then SIGKILL after this
BENCH_MAX_MINUTES = 3.0
MEGATRON_CAPACITY = "8MB"  # the tp2 layout's tested capacity (tests/test_megatron_ranks.py)
DEEPSPEED_CAPACITY = "9MiB"  # zero2's (tests/test_deepspeed_ranks.py)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; torchrun's ranks run in sessions of their own, so a process group
    does not hold them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _end(process: subprocess.Popen) -> int:
    """End ``process`` and everything it started: SIGTERM (torchrun then stops its ranks), SIGKILL after
    ``END_GRACE_S``. Returns how many processes were told to end."""
    pids = [process.pid, *_descendants(process.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=END_GRACE_S)
    for pid in [*pids, *_descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    return len(pids)


def _run(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Run one command; its outcome (exit status, time, whether it timed out, the end of its output). Past
    ``timeout_s`` it is ended with every process it started (``_end``). The output goes to a file, so a process
    that keeps it open cannot hold the check."""
    started = time.monotonic()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as output:
        process = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, **(env or {})}, start_new_session=True)
        ended = 0
        try:
            code, timed_out = process.wait(timeout=max(timeout_s, 1.0)), False
        except subprocess.TimeoutExpired:
            code, timed_out, ended = None, True, _end(process)
        output.seek(0)
        text = output.read()
    return {"command": command, "returncode": code, "timed_out": timed_out, "ended_processes": ended,
            "elapsed_s": round(time.monotonic() - started, 1), "output_tail": text[-TAIL_CHARS:]}


def _junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return {}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def part_gpu_tests(work: Path, timeout_s: float, sanitized: bool = False) -> dict:
    """The gpu-marked tests; ``sanitized``: under PyTorch's CUDA stream sanitizer (``TORCH_CUDA_SANITIZER=1``),
    whose being on in the test process is recorded (``launch/sanitizer_plugin.py``)."""
    name = "gpu_tests_sanitized" if sanitized else "gpu_tests"
    xml, state = work / f"{name}.xml", work / f"{name}-sanitizer.json"
    plugin = ["-p", "launch.sanitizer_plugin"] if sanitized else []
    env = {"TORCH_CUDA_SANITIZER": "1", "GPU_CHECK_SANITIZER_STATE": str(state)} if sanitized else None
    result = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *plugin,
                   f"--junitxml={xml}", *gpu_test_files()], timeout_s, env)
    result["counts"] = _junit_counts(xml)
    result["ok"] = result["returncode"] == 0
    if sanitized:
        result["sanitizer_enabled"] = json.loads(state.read_text())["enabled"] if state.is_file() else False
        result["ok"] = result["ok"] and result["sanitizer_enabled"]
    return result


def part_probes(work: Path, timeout_s: float, dry_run: bool) -> dict:
    out = work / "gpu_probes.json"
    result = _run([sys.executable, "-m", "launch.bench.gpu_probes", "--json", str(out), *(["--dry-run"] if dry_run else [])],
                  timeout_s)
    result["results"] = json.loads(out.read_text()) if out.is_file() else None
    result["ok"] = result["returncode"] == 0 and bool(result["results"] and result["results"].get("ok"))
    return result


def _torchrun(module: str, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", module, *argv]


def _pair(work: Path, name: str, module: str, argv: list[str], capacity: str, timeout_s: float) -> dict:
    """The job without Chameleon (metered, unlimited) and with it at ``capacity``, and their comparison."""
    runs, reports = {}, {}
    env = {"OMP_NUM_THREADS": "1"}
    for variant, extra in (("off", ["--no-chameleon", "--chameleon-device-capacity", "4GB"]),
                           ("on", ["--chameleon-device-capacity", capacity])):
        report = work / f"{name}-{variant}.json"
        runs[variant] = _run(_torchrun(module, [*argv, *extra, "--report", str(report)]), timeout_s / 2, env)
        if report.is_file():
            reports[variant] = json.loads(report.read_text())
    result = {"runs": runs, "ok": False}
    if len(reports) == 2:
        compared = compare(reports["off"], reports["on"])
        stages = [[it["stage"] for it in rank["iterations"]] for rank in reports["on"]["ranks"]]
        result.update(comparison=compared, stages_per_rank=stages, stable_iterations=len(stable_window(reports["on"]["ranks"])),
                      layout=reports["on"].get("layout"), ranks=[
                          {k: rank.get(k) for k in ("rank", "peak_device_bytes", "capacity_bytes")} for rank in reports["on"]["ranks"]])
        result["ok"] = bool(compared["bit_identical"]) and all(r["returncode"] == 0 for r in runs.values())
    return result


def _shared_gpu(dry_run: bool) -> bool:
    """Whether the two ranks share one GPU (a one-GPU machine)."""
    if dry_run:
        return False
    import torch

    return torch.cuda.device_count() < 2


def part_megatron(work: Path, timeout_s: float, iterations: int) -> dict:
    argv = ["--tp", "2", "--iterations", str(iterations), "--chameleon-min-swap-bytes", "16KiB"]
    return _pair(work, "megatron", "launch.train_megatron", argv, MEGATRON_CAPACITY, timeout_s)


def part_deepspeed(work: Path, timeout_s: float, iterations: int, shared_gpu: bool) -> dict:
    config = json.loads((REPO / "configs" / "deepspeed" / "zero2.json").read_text())
    if shared_gpu:  # gloo on CUDA tensors: all-reduce only (no reduce-scatter, no all-gather)
        config["zero_optimization"] = {"stage": 0}
    path = work / "deepspeed.json"
    path.write_text(json.dumps(config))
    argv = ["--deepspeed_config", str(path), "--iterations", str(iterations)]
    result = _pair(work, "deepspeed", "launch.train_deepspeed", argv, DEEPSPEED_CAPACITY, timeout_s)
    result["zero_stage"] = config["zero_optimization"]["stage"]
    return result


def part_bench_gpu(work: Path, timeout_s: float, dry_run: bool) -> dict:
    out = work / "bench_gpu.json"
    minutes = max(min(BENCH_MAX_MINUTES, (timeout_s - 30) / 60), 0.5)
    command = [sys.executable, "-m", "launch.bench.bench_gpu", "--json", str(out), "--max-minutes", f"{minutes:.2f}",
               *(["--dry-run"] if dry_run else [])]
    result = _run(command, timeout_s)
    result["results"] = json.loads(out.read_text()) if out.is_file() else None
    result["ok"] = result["returncode"] == 0 and result["results"] is not None
    return result


PARTS = ("gpu_tests", "probes", "gpu_tests_sanitized", "megatron_2rank", "deepspeed_2rank", "bench_gpu")
SHARES = {"gpu_tests": 0.15, "probes": 0.15, "gpu_tests_sanitized": 0.15, "megatron_2rank": 0.25,
          "deepspeed_2rank": 0.4, "bench_gpu": 1.0}
"""Each part's share of the time left when it starts (bench_gpu takes the rest, at most ``BENCH_MAX_MINUTES``)."""
PREFLIGHT_MAX_S = 120.0
MAX_MINUTES = 8.0
DRY_MAX_MINUTES = 30.0  # the dry run's times mean nothing: a loaded CPU must not time its parts out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="the same parts on the CPU, tiny (the tests run it)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help=f"time box of the whole check (default {MAX_MINUTES:g}; dry {DRY_MAX_MINUTES:g})")
    parser.add_argument("--iterations", type=int, default=None, help="rank jobs' iterations (default 12; dry 4)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of the parts, in their order")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run to exercise the same steps on the CPU")
    wanted = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        parser.error(f"unknown --parts {unknown}: choose from {', '.join(PARTS)}")
    iterations = args.iterations or (4 if args.dry_run else 12)
    args.max_minutes = args.max_minutes or (DRY_MAX_MINUTES if args.dry_run else MAX_MINUTES)
    shared_gpu = _shared_gpu(args.dry_run)
    started = time.monotonic()
    deadline = started + 60 * args.max_minutes
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    results = {**header("launch.gpu_check", sys.argv[1:] if argv is None else argv, torch), "dry_run": args.dry_run,
               "emulated": args.dry_run, "cuda": _cuda_info(torch), "ranks_share_gpu": shared_gpu, "parts": {},
               "ok": True}

    def write() -> None:
        results["elapsed_s"] = round(time.monotonic() - started, 1)
        path.write_text(json.dumps(results, indent=2, default=str) + "\n")

    ordered = [name for name in PARTS if name in wanted]
    results["preflight"] = checked = preflight(ordered, timeout_s=min(PREFLIGHT_MAX_S, 60 * args.max_minutes / 4))
    print(f"[gpu_check] {checked['message']}", flush=True)
    if not checked["ok"]:
        results["ok"] = False
        write()
        print(f"[gpu_check] nothing ran (no device time spent); results in {path}", file=sys.stderr)
        return 2
    write()  # (the preflight's findings, kept if the check is killed later)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        for name in ordered:
            left_s = deadline - time.monotonic()
            timeout_s = min(left_s * SHARES[name], left_s)
            print(f"[gpu_check] {name}: up to {timeout_s:.0f} s", flush=True)
            if name in ("gpu_tests", "gpu_tests_sanitized"):
                part = part_gpu_tests(work, timeout_s, sanitized=name == "gpu_tests_sanitized")
            elif name == "probes":
                part = part_probes(work, timeout_s, args.dry_run)
            elif name == "megatron_2rank":
                part = part_megatron(work, timeout_s, iterations)
            elif name == "deepspeed_2rank":
                part = part_deepspeed(work, timeout_s, iterations, shared_gpu)
            else:
                part = part_bench_gpu(work, timeout_s, args.dry_run)
            results["parts"][name] = part
            print(f"[gpu_check] {name}: {'ok' if part['ok'] else 'FAILED'}", flush=True)
            results["ok"] = all(p["ok"] for p in results["parts"].values())
            write()
    print(f"[gpu_check] {'all parts ok' if results['ok'] else 'some parts FAILED'} in {results['elapsed_s']:.0f} s; "
          f"results in {path}")
    return 0 if results["ok"] else 1


def _cuda_info(torch) -> dict:
    if not torch.cuda.is_available():
        return {"available": False, "build": torch.version.cuda}
    props = torch.cuda.get_device_properties(0)
    return {"available": True, "build": torch.version.cuda, "devices": torch.cuda.device_count(), "name": props.name,
            "total_memory_bytes": props.total_memory}


if __name__ == "__main__":
    sys.exit(main())
