"""Runs several multi-rank jobs of one launcher (``launch/train_megatron.py``, ``launch/train_deepspeed.py``) in
a row, for the tests.

    python -m tests.rank_batch LAUNCHER RUNS.json RESULTS.json     # LAUNCHER: train_megatron or train_deepspeed

Each run in RUNS.json is ``{"name", "world_size", "argv", "timeout_s"}``. The point is time: importing
torch and megatron-core or DeepSpeed takes ~10 s per process on a 2-core machine, so torchrun would spend most of a test
run starting processes. This process imports the launcher once, while it has no threads, and then forks
``world_size`` ranks per run with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). It also does what torchrun does when a worker fails: the moment one rank exits non-zero, the
others are terminated (SIGTERM, then SIGKILL after 10 s), so a failed rank ends its job instead of hanging
it. A run that exceeds its ``timeout_s`` is killed and reported as timed out.

RESULTS.json holds per run: ``returncodes`` (per rank; negative: killed by that signal), ``timed_out``,
``elapsed_s``, ``report`` (the ``--report`` JSON when written) and ``logs`` (the last lines of each rank's
output).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAUNCHERS = ("train_megatron", "train_deepspeed", "zero3_memory")
GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(launcher, rank: int, world_size: int, port: int, argv: list[str], log: Path) -> None:
    """In the forked child: torchrun's environment, output to ``log``, then the launcher's main."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        launcher.main(argv)
    except BaseException:  # noqa: BLE001 - the child reports every failure through its exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(launcher, spec: dict, workdir: Path) -> dict:
    world_size, argv, name = int(spec["world_size"]), list(spec["argv"]), spec["name"]
    port = _free_port()
    logs = [workdir / f"{name}.rank{r}.log" for r in range(world_size)]
    start = time.monotonic()
    children: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _rank(launcher, rank, world_size, port, argv, logs[rank])
        children[pid] = rank
    codes: dict[int, int] = {}
    deadline = start + float(spec.get("timeout_s", 300))
    stop_at = None  # when the survivors get SIGKILL after a failure
    timed_out = False
    while len(codes) < world_size:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[children[pid]] = os.waitstatus_to_exitcode(status)
            if codes[children[pid]] != 0 and stop_at is None:
                stop_at = time.monotonic() + GRACE_S
                _signal([p for p, r in children.items() if r not in codes], signal.SIGTERM)
            continue
        now = time.monotonic()
        if now > deadline and not timed_out:
            timed_out = True
            _signal([p for p, r in children.items() if r not in codes], signal.SIGKILL)
        if stop_at is not None and now > stop_at:
            _signal([p for p, r in children.items() if r not in codes], signal.SIGKILL)
        time.sleep(0.05)
    report_path = argv[argv.index("--report") + 1] if "--report" in argv else None
    report = json.loads(Path(report_path).read_text()) if report_path and Path(report_path).exists() else None
    return {
        "name": name, "world_size": world_size, "argv": argv, "returncodes": [codes[r] for r in range(world_size)],
        "timed_out": timed_out, "elapsed_s": time.monotonic() - start, "report": report,
        "logs": [_tail(log) for log in logs],
    }


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _tail(path: Path, chars: int = 20000) -> str:
    """The end of a rank's output, without Python's warnings about missing optional packages."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(line for line in text.splitlines() if "warn" not in line.lower())[-chars:]


def run_jobs(launcher: str, runs: list[dict], workdir: Path, timeout_s: float = 1200) -> dict[str, dict]:
    """For a test: run ``runs`` of ``launcher`` in one batch (this module as a script, ``python -m`` from the
    repository root, in a fresh process with ``OMP_NUM_THREADS=1``); the results by run name."""
    spec, out = workdir / "runs.json", workdir / "results.json"
    spec.write_text(json.dumps(runs))
    subprocess.run([sys.executable, "-m", "tests.rank_batch", launcher, str(spec), str(out)], check=True,
                   timeout=timeout_s, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {r["name"]: r for r in json.loads(out.read_text())}


def selected_runs(request, runs: list[dict], reads) -> list[dict]:
    """For a module-scoped fixture: the ``runs`` that the tests of its module selected in this session read
    (``reads(item)``: the run names one test reads), in their order. The whole module still runs every run in
    one batch; a tier or ``-k`` that selects one test starts only the jobs that test reads."""
    wanted = set()
    for item in request.session.items:
        if item.module is request.module:
            wanted.update(reads(item))
    return [run for run in runs if run["name"] in wanted]


def completed(result: dict) -> dict:
    """The report of a run that every rank completed (else an assertion error with every rank's output)."""
    assert result["returncodes"] == [0] * result["world_size"], "\n\n".join(result["logs"])
    assert result["report"] is not None
    return result["report"]


def assert_settled_in_stable(on: dict, off: dict, min_stable_iterations: int) -> None:
    """For the tests: every rank of the report ``on`` reached Stable and stayed ``min_stable_iterations`` or
    more, with no passive swap (each a policy miss paid synchronously), no change of the op sequence, and a
    policy that swaps less than WarmUp's swap-everything: some bytes on a rank whose unswapped peak (the
    report ``off``) is above its capacity, possibly none on a rank that fits."""
    for rank, unswapped in zip(on["ranks"], off["ranks"]):
        stages = [row["stage"] for row in rank["iterations"]]
        first = stages.index("stable") if "stable" in stages else len(stages)
        assert len(stages) - first >= min_stable_iterations, (rank["rank"], stages)
        assert set(stages[first:]) == {"stable"}, (rank["rank"], stages)
        stable = rank["iterations"][first:]
        assert all(row["passive_swaps"] == 0 for row in stable), (rank["rank"], stable)
        assert all(row["sequence_change_kind"] == "identical" for row in stable), (rank["rank"], stable)
        warmup_swapped = rank["iterations"][0]["swap_out_bytes"]
        assert all(row["swap_out_bytes"] < warmup_swapped for row in stable), (rank["rank"], stable)
        if unswapped["peak_device_bytes"] > rank["capacity_bytes"]:
            assert all(row["swap_out_bytes"] > 0 for row in stable), (rank["rank"], stable)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in LAUNCHERS:
        raise SystemExit(f"usage: python -m tests.rank_batch {{{','.join(LAUNCHERS)}}} RUNS.json RESULTS.json")
    launcher = importlib.import_module(f"launch.{argv[0]}")  # imported once, while this process has no threads, before any fork
    runs = json.loads(Path(argv[1]).read_text())
    out = Path(argv[2])
    workdir = out.parent
    results = []
    for spec in runs:
        results.append(run(launcher, spec, workdir))
        out.write_text(json.dumps(results, indent=1))  # what finished so far, should a later run hang
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
