"""Multi-rank faults (issue 37 item 12) on the DeepSpeed launcher's ranks (ZeRO-2 over two data-parallel ranks,
gloo on CPU): a different ``chameleon.device.capacity`` and a ``"chameleon"`` block enabled on one rank only
are refused at ``initialize`` on every rank, naming the key and the ranks, before the first step; a rank
killed with SIGKILL in its backward leaves a survivor that ends by itself naming it (no launcher tears it down
here: ``tests/fault_batch.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rank_batch import selected_runs

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.multirank, pytest.mark.extended]  # (NOTEs [The multi-rank tier], [The extended tier])

REPO = Path(__file__).resolve().parents[1]
BASE = ["--deepspeed_config", str(REPO / "configs" / "deepspeed" / "zero2.json"), "--iterations", "3",
        "--chameleon-device-capacity", "9MiB", "--dist-timeout-s", "60"]
RUNS = [
    {"name": "capacity", "argv_by_rank": [BASE, [*BASE, "--chameleon-device-capacity", "8MiB"]]},
    {"name": "one-rank-only", "argv_by_rank": [[*BASE, "--no-chameleon"], BASE]},
    {"name": "killed-in-backward", "argv_by_rank": [[*BASE, "--kill-rank", "0", "--kill-at", "backward"]] * 2},
]


READS = {"test_a_different_capacity_is_refused_on_every_rank": ["capacity"],
         "test_chameleon_enabled_on_one_rank_only_is_refused": ["one-rank-only"],
         "test_a_rank_killed_in_its_backward_is_named_by_the_survivor": ["killed-in-backward"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    """Every run the selected tests read, in one batch (the whole module: all of RUNS)."""
    workdir = tmp_path_factory.mktemp("deepspeed_faults")
    spec, out = workdir / "runs.json", workdir / "results.json"
    runs = selected_runs(request, RUNS, lambda item: READS[item.originalname])
    spec.write_text(json.dumps([{**run, "timeout_s": 150} for run in runs]))
    subprocess.run([sys.executable, "-m", "tests.fault_batch", "train_deepspeed", str(spec), str(out)], check=True,
                   timeout=900, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {r["name"]: r for r in json.loads(out.read_text())}


def _logs(result):
    logs = "\n\n".join(f"--- rank {r} ---\n{log[-3000:]}" for r, log in enumerate(result["logs"]))
    assert not result["timed_out"], logs
    return logs


def test_a_different_capacity_is_refused_on_every_rank(results):
    result = results["capacity"]
    logs = _logs(result)
    assert result["returncodes"] == [1, 1], logs
    for log in result["logs"]:
        assert "chameleon.device.capacity differs between ranks: 9437184 on rank 0; 8388608 on rank 1" in log, logs
        assert "iteration 1/3" not in log, logs


@pytest.mark.quick  # (the module's test in the quick tier: one job, refused at initialize)
def test_chameleon_enabled_on_one_rank_only_is_refused(results):
    result = results["one-rank-only"]
    logs = _logs(result)
    assert result["returncodes"] == [1, 1], logs
    for log in result["logs"]:
        assert "chameleon.enabled differs between ranks: false on rank 0; true on rank 1" in log, logs


def test_a_rank_killed_in_its_backward_is_named_by_the_survivor(results):
    result = results["killed-in-backward"]
    logs = _logs(result)
    assert result["returncodes"][0] == -9, logs
    assert "--kill-rank: this rank sends itself SIGKILL" in result["logs"][0], logs
    assert result["returncodes"][1] not in (0, -9), logs
    assert "rank 0 of 2 is gone" in result["logs"][1], logs
