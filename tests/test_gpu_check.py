"""The GPU check (``launch/gpu_check.py``): its dry run on the CPU runs every part's Python (the preflight, the
gpu-marked tests plain and under the stream sanitizer, the probes on the emulated device, two-rank Megatron and
DeepSpeed jobs with and without Chameleon, bench_gpu's dry run) and writes one JSON; a missing module ends it
before any part; a part past its limit ends with every process it started; ``launch/cuda_ranks.py`` gives each
rank its GPU and backend."""

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


SINGLE_PROCESS_PARTS = ["gpu_tests", "probes", "gpu_tests_sanitized"]
RANK_PARTS = ["megatron_2rank", "deepspeed_2rank", "bench_gpu"]
"""The dry run in two tests: the parts above (quick), and the rank jobs with bench_gpu (multirank tier)."""
DRY_RUN_TIMEOUT_S = 600


class DryRuns:
    """The two dry runs (``--parts`` each test's), started together by the fixture below: the single-process parts
    keep about one core busy, the rank jobs mostly two, so side by side on a 2-core machine they take about as long
    as the rank jobs alone (one after the other: both times added). Each test waits for its own."""

    def __init__(self, tmp_path_factory, wanted: dict[str, list[str]]) -> None:
        self.runs: dict[str, tuple[list[str], Path, subprocess.Popen, object]] = {}
        for name, parts in wanted.items():
            out = tmp_path_factory.mktemp(f"dry_run_{name}")
            log = open(tmp_path_factory.mktemp(f"dry_run_{name}_log") / "output.txt", "w+", encoding="utf-8")
            process = subprocess.Popen([sys.executable, "-m", "launch.gpu_check", "--out", str(out), "--dry-run",
                                        "--parts", ",".join(parts)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True)
            self.runs[name] = (parts, out, process, log)

    def result(self, name: str) -> dict:
        """The JSON of dry run ``name`` once it has ended, checked as every dry run's must be."""
        parts, out, process, log = self.runs[name]
        returncode = process.wait(timeout=DRY_RUN_TIMEOUT_S)
        log.seek(0)
        assert returncode == 0, log.read()[-4000:]
        assert [p.name for p in out.iterdir()] == ["gpu_check.json"]
        result = json.loads((out / "gpu_check.json").read_text())
        assert result["dry_run"] and result["emulated"] and result["ok"]
        assert result["preflight"]["ok"] and result["preflight"]["carry"] == []
        assert list(result["parts"]) == parts
        return result

    def close(self) -> None:
        """End what still runs (a test that failed before waiting), with every process it started."""
        for _, _, process, log in self.runs.values():
            if process.poll() is None:
                gpu_check._end(process)
            log.close()


@pytest.fixture(scope="module")
def dry_runs(request, tmp_path_factory):
    """The dry runs of the tests selected in this session (a test run alone starts only its own)."""
    selected = {item.name for item in request.session.items}
    wanted = {name: parts for name, parts, test in (
        ("single", SINGLE_PROCESS_PARTS, test_the_dry_run_of_the_single_process_parts_runs_each_probe_on_the_emulated_device),
        ("rank", RANK_PARTS, test_the_dry_run_of_the_rank_parts_runs_megatron_and_deepspeed_jobs_bit_identically))
        if test.__name__ in selected}
    runs = DryRuns(tmp_path_factory, wanted)
    try:
        yield runs
    finally:
        runs.close()


@pytest.mark.extended  # (both dry runs side by side, 40-90 s: NOTE [The extended tier] in tests/conftest.py)
def test_the_dry_run_of_the_single_process_parts_runs_each_probe_on_the_emulated_device(dry_runs):
    """The dry run's parts without ranks (the rest: the multirank test below): the gpu tests plain and under the
    sanitizer (skipped here) and every probe."""
    parts = dry_runs.result("single")["parts"]
    for name in ("gpu_tests", "gpu_tests_sanitized"):
        counts = parts[name]["counts"]
        assert counts["tests"] > 0 and counts["skipped"] == counts["tests"] and not counts["failures"]  # no GPU here
    assert parts["gpu_tests_sanitized"]["sanitizer_enabled"] and "sanitizer_enabled" not in parts["gpu_tests"]
    probes = parts["probes"]["results"]
    assert probes["emulated"] and list(probes["probes"]) == ["relief_enforced", "side_stream_batchnorm",
                                                             "pinned_buffers", "copy_rates", "host_time_per_op"]
    relief = probes["probes"]["relief_enforced"]["attempts"][-1]
    assert relief["relieved_ops"] > 0 and relief["oom_retries"] == 0 and relief["bit_identical"] and not relief["error"]
    assert relief["capacity_bytes"] < max(relief["peaks_bytes"]) + probes["probes"]["relief_enforced"]["activation_peak_bytes"]
    side = probes["probes"]["side_stream_batchnorm"]
    assert side["bit_identical"] and side["swap_out_bytes"] > 0 and "stable" in side["stages"]
    assert side["state_equal"] == side["state_compared"] > 0  # parameters and BatchNorm's running statistics
    assert probes["probes"]["pinned_buffers"]["modelled"] is False  # the emulated device does not model pinning
    rates = probes["probes"]["copy_rates"]
    assert rates["preset"] == "h200" and set(rates["measured"]) == set(rates["preset_figures"]) == {
        "d2h_bytes_per_s", "h2d_bytes_per_s", "duplex_d2h_bytes_per_s", "duplex_h2d_bytes_per_s"}
    host = probes["probes"]["host_time_per_op"]
    assert host["stable_iterations"] > 0 and host["ops_per_iteration"] > 0 and host["bit_identical"]
    assert "added_host_s_per_op" in host


@pytest.mark.multirank  # (two-rank jobs: NOTE [The multi-rank tier] in tests/conftest.py)
@pytest.mark.extended  # (alone 80 s; after the test above, its remainder: NOTE [The extended tier] in tests/conftest.py)
def test_the_dry_run_of_the_rank_parts_runs_megatron_and_deepspeed_jobs_bit_identically(dry_runs):
    parts = dry_runs.result("rank")["parts"]
    for name in ("megatron_2rank", "deepspeed_2rank"):
        part = parts[name]
        assert part["comparison"]["bit_identical"], name
        assert [run["returncode"] for run in part["runs"].values()] == [0, 0], name
        assert len(part["stages_per_rank"]) == 2 and all(len(s) == 4 for s in part["stages_per_rank"]), name
    assert parts["megatron_2rank"]["layout"]["tp"] == 2 and parts["deepspeed_2rank"]["zero_stage"] == 2
    bench = parts["bench_gpu"]["results"]
    assert bench["emulated"] and "chameleon_swap" in bench["variants"]


@pytest.mark.slow  # (out of the quick tier: a preflight in fresh interpreters, 15 s loaded)
def test_a_missing_module_ends_the_check_before_any_part_naming_what_to_carry(tmp_path, monkeypatch, capsys):
    from launch import gpu_preflight

    missing = "no_such_distribution_for_the_check"
    monkeypatch.setitem(gpu_preflight.PART_MODULES, "gpu_tests", ("json",))  # (cheap stand-ins for the parts' modules)
    monkeypatch.setitem(gpu_preflight.PART_MODULES, "bench_gpu", ("json", missing))
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--parts", "gpu_tests,bench_gpu"]) == 2
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["parts"] == {} and not result["ok"]  # nothing ran
    preflight = result["preflight"]
    assert preflight["carry"] == [missing] and preflight["missing_by_part"] == {"gpu_tests": [], "bench_gpu": [missing]}
    assert f"missing distributions: {missing} (needed by bench_gpu)" in preflight["message"]
    assert "launch/gpu_wheels.sh" in preflight["message"] and preflight["message"] in capsys.readouterr().out


def _requirements(distribution: str) -> set[str]:
    import importlib.metadata
    import re

    return {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in importlib.metadata.requires(distribution) or ()
            if "extra ==" not in r}


def test_deepspeeds_and_megatrons_requirements_are_preflighted_and_carried():
    """Every requirement of DeepSpeed and megatron-core but PyTorch (the image's) is imported by the preflight of
    the part that runs it and downloaded by launch/gpu_wheels.sh (einops and msgpack were not)."""
    from launch import gpu_preflight

    pytest.importorskip("deepspeed")
    import re

    script = (REPO / "launch" / "gpu_wheels.sh").read_text()
    carried = set(re.search(r"for name in (.*?); do", script, re.S).group(1).replace("\\\n", " ").split())
    imports = {name: module for module, name in gpu_preflight.DISTRIBUTIONS.items()}
    for part, distribution in (("deepspeed_2rank", "deepspeed"), ("megatron_2rank", "megatron-core")):
        needed = _requirements(distribution) - {"torch"}
        assert needed, distribution
        for name in needed:
            assert imports.get(name, name.replace("-", "_")) in gpu_preflight.PART_MODULES[part], (part, name)
            assert name in carried, f"launch/gpu_wheels.sh does not carry {name} ({distribution} needs it)"


def test_carried_wheels_install_only_what_the_image_lacks_or_holds_older(tmp_path):
    import importlib.metadata

    from launch.carried_wheels import needed

    installed = importlib.metadata.version("packaging")
    files = ["packaging-1.0-py3-none-any.whl", f"packaging-{installed}-py3-none-any.whl",
             "packaging-999.0-py3-none-any.whl", "no_such_distribution_x-1.0-py3-none-any.whl",
             "Packaging-0.1.tar.gz", "Packaging-999.1.tar.gz"]
    chosen = [p.name for p in needed([tmp_path / name for name in files])]
    assert chosen == ["packaging-999.0-py3-none-any.whl", "no_such_distribution_x-1.0-py3-none-any.whl",
                      "Packaging-999.1.tar.gz"]


def test_copy_rates_are_the_devices_own_link_each_direction_and_both_at_once():
    """The probe's measurement over the backend's streams and events reads the link of the device it is given:
    a 4x faster H2D than D2H shows as 4x, and both directions at once are slower than either alone."""
    from chameleon_dist.device.emulated import EmulatedDevice
    from launch.bench.gpu_probes import measure_copy_rates

    device = EmulatedDevice(2**30, d2h_bytes_per_s=1e10, h2d_bytes_per_s=4e10, duplex_factor=0.5, host_op_s=1e-9,
                            peak_flop_per_s=1e12, memory_bytes_per_s=1e12, launch_latency_s=1e-9)
    rates = measure_copy_rates(device, 8 * 2**20)
    assert rates["h2d_bytes_per_s"] / rates["d2h_bytes_per_s"] == pytest.approx(4.0, rel=0.01)
    assert rates["duplex_d2h_bytes_per_s"] < rates["d2h_bytes_per_s"]
    assert rates["duplex_h2d_bytes_per_s"] < rates["h2d_bytes_per_s"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.slow  # (out of the quick tier: 3 s loaded)
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


def test_the_probes_compare_a_gpu_with_the_preset_its_name_names():
    from launch.bench.gpu_probes import preset_for

    assert preset_for("NVIDIA H200").name == "h200" and preset_for("NVIDIA H200 NVL").name == "h200"
    assert preset_for("NVIDIA GH200 480GB").name == "gh200"  # (not h200, which its name also holds)
    assert preset_for("NVIDIA H100 PCIe").name == "h100-pcie" and preset_for("NVIDIA A100-SXM4-80GB").name == "a100-pcie"
    assert preset_for("NVIDIA GeForce RTX 4090") is None
