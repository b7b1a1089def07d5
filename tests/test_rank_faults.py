"""Multi-rank faults (issue 37 item 12), on the Megatron launcher's ranks (gloo on CPU, the emulated device):

- ranks started with different Chameleon settings (a budget, Chameleon on one rank only) are refused at start,
  every rank naming the setting and the ranks, before the first iteration;
- a rank killed with SIGKILL in its forward, in its backward, or while a swap-in is in flight ends the job:
  no launcher tears the survivor down here (``tests/fault_batch.py``), it must end by itself, naming the
  dead rank; and a real torchrun job killed during a swap-in ends non-zero naming the dead rank, with no rank
  process left behind (a process's exit releases its host pool: none may survive).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.rank_batch import selected_runs

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multirank  # (NOTE [The multi-rank tier] in tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]
# a tiny two-stage pipeline: a few seconds per run; a short collective timeout as the backstop of a hang
BASE = ["--pp", "2", "--iterations", "3", "--hidden-size", "32", "--num-layers", "2", "--seq-length", "64",
        "--micro-batch-size", "2", "--micro-batches", "2", "--chameleon-min-swap-bytes", "4KiB",
        "--chameleon-device-capacity", "10MB", "--dist-timeout-s", "60"]
KILLED = {point: [*BASE, "--kill-rank", "1", "--kill-iteration", "2", "--kill-at", point]
          for point in ("forward", "backward", "swap-in")}
RUNS = [
    {"name": "budget", "argv_by_rank": [BASE, [*BASE, "--chameleon-memory-budget", "4MB"]]},
    {"name": "one-rank-only", "argv_by_rank": [BASE, [*BASE, "--no-chameleon"]]},
    *[{"name": f"killed-in-{point}", "argv_by_rank": [argv, argv]} for point, argv in KILLED.items()],
]


READS = {"test_a_different_budget_is_refused_on_every_rank_before_the_first_iteration": ["budget"],
         "test_chameleon_on_one_rank_only_is_refused_naming_enabled": ["one-rank-only"]}


def _reads(item) -> list[str]:
    """The runs of RUNS a test reads (a killed-rank case: its own point's)."""
    if item.originalname == "test_a_killed_rank_ends_the_job_and_the_survivor_names_it":
        return [f"killed-in-{item.callspec.params['point']}"]
    return READS.get(item.originalname, [])


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    """Every run the selected tests read, in one batch (the whole module: all of RUNS)."""
    workdir = tmp_path_factory.mktemp("faults")
    spec, out = workdir / "runs.json", workdir / "results.json"
    spec.write_text(json.dumps([{**run, "timeout_s": 150} for run in selected_runs(request, RUNS, _reads)]))
    subprocess.run([sys.executable, "-m", "tests.fault_batch", "train_megatron", str(spec), str(out)], check=True,
                   timeout=900, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {r["name"]: r for r in json.loads(out.read_text())}


def _ended(result):
    logs = "\n\n".join(f"--- rank {r} ---\n{log[-3000:]}" for r, log in enumerate(result["logs"]))
    assert not result["timed_out"], logs
    return logs


def test_a_different_budget_is_refused_on_every_rank_before_the_first_iteration(results):
    result = results["budget"]
    logs = _ended(result)
    assert result["returncodes"] == [1, 1], logs
    for log in result["logs"]:
        assert "memory_budget differs between ranks: " in log and "on rank 0; " in log and "on rank 1" in log, logs
        assert "iteration 1/3" not in log and "iteration 1 failed" not in log, logs


@pytest.mark.quick  # (the module's test in the quick tier: one job, refused before its first iteration)
def test_chameleon_on_one_rank_only_is_refused_naming_enabled(results):
    result = results["one-rank-only"]
    logs = _ended(result)
    assert result["returncodes"] == [1, 1], logs
    for log in result["logs"]:
        assert "enabled differs between ranks: true on rank 0; false on rank 1" in log, logs


@pytest.mark.parametrize("point", list(KILLED))
def test_a_killed_rank_ends_the_job_and_the_survivor_names_it(results, point):
    result = results[f"killed-in-{point}"]
    logs = _ended(result)
    assert result["returncodes"][1] == -9, logs  # (it died where asked: the kill point was reached)
    assert "--kill-rank: this rank sends itself SIGKILL" in result["logs"][1], logs
    assert result["returncodes"][0] not in (0, -9), logs  # the survivor ended by itself, with an error
    assert "rank 1 of 2 is gone" in result["logs"][0], logs


def _marked_processes(marker: str) -> list[int]:
    """The live processes whose environment holds ``marker`` (this job's ranks and launcher), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.extended  # (a real torchrun job: NOTE [The extended tier] in tests/conftest.py)
def test_a_rank_killed_during_a_swap_in_ends_a_torchrun_job_naming_it_and_leaving_no_process(tmp_path):
    """Real torchrun: rank 1 dies (SIGKILL) with a copy back to the device in flight. The job must end non-zero,
    its output must name rank 1 as killed, and no process of the job may be left (each rank's host pool goes
    with its process)."""
    marker = f"CHAMELEON_FAULT_TEST={uuid.uuid4().hex}"
    torchrun = Path(sys.executable).with_name("torchrun")
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path, marker.split("=")[0]: marker.split("=")[1]}
    command = [str(torchrun), "--nproc-per-node", "2", "-m", "launch.train_megatron", *KILLED["swap-in"]]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    finally:
        left = _marked_processes(marker)
        for pid in left:  # (so that a failing test leaves nothing running either)
            os.kill(pid, 9)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert "--kill-rank: this rank sends itself SIGKILL" in output, output[-4000:]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9 .*SIGKILL", output), output[-4000:]
    assert left == [], left
