"""The GPU check (``launch/gpu_check.py``): its dry run on the CPU runs every part's Python (the gpu-marked tests,
two-rank Megatron and DeepSpeed jobs with and without Chameleon, bench_gpu's dry run) and writes one JSON;
``launch/cuda_ranks.py`` gives each rank its GPU and backend."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
from launch import cuda_ranks, gpu_check  # noqa: E402


def test_one_gpu_per_rank_takes_its_own_with_nccl():
    assert cuda_ranks.rank_cuda_setup(8, {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}) == (5, "nccl")
    assert cuda_ranks.rank_cuda_setup(1, {}) == (0, "nccl")


def test_ranks_sharing_a_gpu_take_it_modulo_with_gloo(caplog):
    assert cuda_ranks.rank_cuda_setup(1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (0, "gloo")
    assert cuda_ranks.rank_cuda_setup(2, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}) == (1, "gloo")
    assert "share 2 GPU(s)" in caplog.text and "gloo" in caplog.text
    with pytest.raises(ValueError):
        cuda_ranks.rank_cuda_setup(0, {})


def test_the_gpu_tests_part_finds_every_file_with_gpu_tests():
    files = gpu_check.gpu_test_files()
    assert "tests/test_cuda_device.py" in files and "tests/test_gpu_training.py" in files
    assert "tests/test_gpu_check.py" not in files and "tests/test_policy.py" not in files


def test_without_cuda_it_asks_for_the_dry_run(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real check")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path)])
    assert "--dry-run" in capsys.readouterr().err


@pytest.mark.multirank  # (two-rank jobs: NOTE [The multi-rank tier] in tests/conftest.py)
def test_the_dry_run_runs_every_part_and_writes_one_json(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launch.gpu_check", "--out", str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_check.json"]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] and result["emulated"] and result["ok"]
    parts = result["parts"]
    assert list(parts) == ["gpu_tests", "megatron_2rank", "deepspeed_2rank", "bench_gpu"]
    counts = parts["gpu_tests"]["counts"]
    assert counts["tests"] > 0 and counts["skipped"] == counts["tests"] and not counts["failures"]  # no GPU here
    for name in ("megatron_2rank", "deepspeed_2rank"):
        part = parts[name]
        assert part["comparison"]["bit_identical"], name
        assert [run["returncode"] for run in part["runs"].values()] == [0, 0], name
        assert len(part["stages_per_rank"]) == 2 and all(len(s) == 4 for s in part["stages_per_rank"]), name
    assert parts["megatron_2rank"]["layout"]["tp"] == 2 and parts["deepspeed_2rank"]["zero_stage"] == 2
    bench = parts["bench_gpu"]["results"]
    assert bench["emulated"] and "chameleon_swap" in bench["variants"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_part_past_its_time_limit_ends_with_every_process_it_started(tmp_path):
    """A part's process that started others (torchrun's ranks sit in sessions of their own) and outlives its limit:
    the part returns at its limit, and the processes it started are ended with it (they would keep the GPU, and
    the output pipe open)."""
    pid_file = tmp_path / "grandchild.pid"
    grandchild = tmp_path / "grandchild.py"
    grandchild.write_text(f"import os, pathlib, time\npathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
                          "time.sleep(30)\n")
    child = (f"import subprocess, sys, time\n"
             f"subprocess.Popen([sys.executable, {str(grandchild)!r}], start_new_session=True)\n"
             f"print('started', flush=True)\n"
             f"time.sleep(30)\n")
    result = gpu_check._run([sys.executable, "-c", child], timeout_s=3)
    assert result["timed_out"] and result["returncode"] is None and "started" in result["output_tail"]
    pid = int(pid_file.read_text())
    for _ in range(50):  # (a process told to end may take a moment)
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the grandchild outlived its part"
