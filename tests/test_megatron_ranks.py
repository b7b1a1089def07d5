"""Multi-rank megatron-core jobs on CPU (gloo) through ``launch/train_megatron.py``: every layout trains
bit-identically with Chameleon, within an emulated capacity below its unswapped peak, at which the run without
it runs out of memory (run, and its error read, for one layout of each kind: ``OUT_OF_MEMORY_RUNS``).

All jobs run once per session, in one batch (``tests/rank_batch.py``: the launcher is imported once and
each job's ranks are forked, as torchrun would start them); the tests below read the results. One test
starts real torchrun to check that a failing rank ends the whole job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rank_batch import assert_settled_in_stable, completed, run_jobs

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.multirank  # (NOTE [The multi-rank tier] in tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]
# 4 iterations: WarmUp's two (swap everything) and two policy trials, each bit-identical; --vary-seq-length's
# second length (from iteration 4); an MoE router's moving sizes over iterations 2-4
ITERATIONS = 4
COMMON = ["--iterations", str(ITERATIONS), "--hidden-size", "64", "--seq-length", "128", "--micro-batch-size", "4",
          "--micro-batches", "4", "--chameleon-min-swap-bytes", "16KiB"]
UNLIMITED = "4GB"

# name -> (world size, layout arguments, emulated capacity per rank: below the largest unswapped peak)
LAYOUTS = {
    "tp2": (2, ["--tp", "2"], "8MB"),
    "pp2": (2, ["--pp", "2"], "10MB"),
    "tp2pp2": (4, ["--tp", "2", "--pp", "2"], "9MB"),
    "pp2vpp2": (2, ["--pp", "2", "--vpp", "2"], "12MB"),
    "tp2dp2": (4, ["--tp", "2"], "9MB"),
    "pp2-full-recompute": (2, ["--pp", "2", "--recompute", "full", "--num-layers", "8"], "10.6MB"),
    "tp2-selective-recompute": (2, ["--tp", "2", "--recompute", "selective"], "8MB"),
    "pp2-vary-seq-length": (2, ["--pp", "2", "--vary-seq-length"], "10MB"),
    "pp2-moe": (2, ["--pp", "2", "--num-experts", "4"], "15MB"),  # unswapped peaks 30.4MB / 18.7MB; 13MB runs out
    # Megatron's features as its users run them (two layers each, to keep the batch short):
    "tp2dp2-sp-distopt-bf16": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--use-distributed-optimizer", "--overlap-param-gather", "--bf16", "--num-layers", "2"],
                               "3MB"),  # unswapped peaks 4.2-4.3MB
    # a Llama-style model; fp16's dynamic loss scale doubles after every 2 good steps: it overflows in iteration 5
    # (a trial), grows back and overflows again in iteration 10, in Stable (each overflow skips the step, halves it)
    "tp2pp2-sp-llama-fp16": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                 "--sequence-parallel", "--num-layers", "2", "--position-embedding-type", "rope",
                                 "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
                                 "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--fp16",
                                 "--initial-loss-scale", "32768", "--loss-scale-window", "2", "--hysteresis", "1"],
                             "3.5MB"),  # unswapped peaks 4.3MB / 2.7MB
    "ep2-moe": (2, ["--expert-model-parallel-size", "2", "--num-experts", "4", "--num-layers", "2"],
                "12MB"),  # unswapped peaks 18.4MB / 17.7MB
}
# The layouts whose run without Chameleon at the capacity runs too, and must stop with RankOutOfMemoryError
# naming its rank: one per kind of parallelism (tp, pp, tp x pp on 4 ranks, interleaved pp, ep) and precision
# (bf16 with the distributed optimizer, fp16). The others (dp 2, recompute, another sequence length, MoE over
# pp) stop the same way, in the same code (the emulated device meters every byte of a run measuring only):
# test_layout_trains_bit_identically_within_capacity asserts that their unswapped peak is above the capacity.
OUT_OF_MEMORY_RUNS = ("tp2", "pp2", "tp2pp2", "pp2vpp2", "tp2dp2-sp-distopt-bf16", "tp2pp2-sp-llama-fp16", "ep2-moe")
SIZES = {"MB": 10**6, "GB": 10**9}
# Layouts trained long enough to reach the steady state users train in: 2 WarmUp and 5 trial iterations, then
# Stable on every rank for the rest (tests below assert it)
STEADY_ITERATIONS = {"tp2pp2": 11, "tp2dp2-sp-distopt-bf16": 11, "tp2pp2-sp-llama-fp16": 11, "ep2-moe": 11}
# ... where Stable's iterations differ from the reference, though not enough to re-plan: a skipped step (no update:
# ~ops only) or another routing of the tokens (tokens per expert)
STABLE_CHANGES = {"tp2pp2-sp-llama-fp16": {"absorbed"}, "ep2-moe": {"absorbed", "rescaled", "rerouted"}}
MIN_STABLE_ITERATIONS = 4
# ... with a fixed host cost per op: the trials' times, and so each rank's Stable policy, are the same on every
# machine (measured host time is noise on an emulated device that is host-bound: a rank that fits may then
# settle on a policy that swaps everything, as fast as swapping nothing within that noise)
# ... and fixed device rates: without them the kernel times come from this CPU's measured rates, and on a slower
# CPU another policy wins the trials (CI: the squeezed rank's Stable policy then absorbed the squeeze unrelieved)
FIXED_RATES = ["--chameleon-peak-flop-per-s", "75e9", "--chameleon-memory-bytes-per-s", "15e9"]
STEADY_HOST = ["--chameleon-host-op-s", "2e-5", *FIXED_RATES]

# Another tenant takes 1.6 MB of rank 0's 10 MB in iteration 8 (Stable, its policy made for the whole device):
# the ops that run short are relieved inside the op (passive swap) and run again; one rank cannot retry an
# iteration, so without that relief the job ends (NOTE [Relief inside the op] in device/dispatch.py). A fixed
# host cost per op and fixed device rates (STEADY_HOST) make the policy trials, and so the Stable policy, the same
# on every machine.
SQUEEZED_COMMON = [*COMMON[:1], "9", *COMMON[2:], "--pp", "2", *STEADY_HOST]
SQUEEZED = {
    "pp2-squeezed-off": ["--no-chameleon", "--chameleon-device-capacity", UNLIMITED],
    "pp2-squeezed-on": ["--chameleon-device-capacity", "10MB", "--squeeze-rank", "0", "--squeeze-iteration", "8",
                        "--squeeze-bytes", "1.6MB"],
}


def _bytes(size: str) -> int:
    return int(float(size[:-2]) * SIZES[size[-2:]])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("megatron")
    runs = []
    for name, (world_size, layout, capacity) in LAYOUTS.items():
        for variant, extra in (
            ("off", ["--no-chameleon", "--chameleon-device-capacity", UNLIMITED]),
            ("on", ["--chameleon-device-capacity", capacity]),
            ("oom", ["--no-chameleon", "--chameleon-device-capacity", capacity]),
        ):
            if variant == "oom" and name not in OUT_OF_MEMORY_RUNS:
                continue
            report = work / f"{name}-{variant}.json"
            longer = ["--iterations", str(STEADY_ITERATIONS[name]), *STEADY_HOST] \
                if name in STEADY_ITERATIONS and variant != "oom" else []
            runs.append({"name": f"{name}-{variant}", "world_size": world_size, "timeout_s": 180,
                         "argv": [*COMMON, *layout, *extra, *longer, "--report", str(report)]})
    for name, extra in SQUEEZED.items():
        runs.append({"name": name, "world_size": 2, "timeout_s": 180,
                     "argv": [*SQUEEZED_COMMON, *extra, "--report", str(work / f"{name}.json")]})
    return run_jobs("train_megatron", runs, work)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_trains_bit_identically_within_capacity(results, name):
    world_size, _layout, capacity = LAYOUTS[name]
    off, on = completed(results[f"{name}-off"]), completed(results[f"{name}-on"])
    assert on["losses"] == off["losses"] and len(on["losses"]) == STEADY_ITERATIONS.get(name, ITERATIONS)
    assert all(loss != "nan" for loss in on["losses"])
    assert [r["params_sha256"] for r in on["ranks"]] == [r["params_sha256"] for r in off["ranks"]]
    unswapped = [r["peak_device_bytes"] for r in off["ranks"]]
    assert max(unswapped) > _bytes(capacity), f"{capacity} is not below any rank's unswapped peak {unswapped}"
    for rank in on["ranks"]:
        assert rank["capacity_bytes"] == _bytes(capacity)
        assert rank["peak_device_bytes"] <= rank["capacity_bytes"], rank
    needed = [r for r, peak in zip(on["ranks"], unswapped) if peak > _bytes(capacity)]
    assert needed and all(sum(it["swap_out_bytes"] for it in r["iterations"]) > 0 for r in needed)
    assert on["chameleon"]["enabled"] is True and off["chameleon"]["enabled"] is False


@pytest.mark.parametrize("name", OUT_OF_MEMORY_RUNS)
def test_without_chameleon_the_same_capacity_runs_out_of_memory(results, name):
    result = results[f"{name}-oom"]
    assert not result["timed_out"]
    failed = [rank for rank, code in enumerate(result["returncodes"]) if code == 1]
    assert failed, result["returncodes"]
    log = result["logs"][failed[0]]
    assert "RankOutOfMemoryError" in log and f"rank {failed[0]}/{result['world_size']} tp " in log, log
    assert "Chameleon is disabled on this rank" in log
    assert result["report"] is None  # the job ended: nobody wrote a report


@pytest.mark.parametrize("name", STEADY_ITERATIONS)
def test_every_rank_reaches_stable_and_stays(results, name):
    """The steady state is where users train: every rank settles in Stable after its trials and stays there,
    with no passive swap (each one a policy miss paid synchronously) and a policy that swaps less than
    WarmUp's swap-everything (none on a rank that fits), while training bit-identically (asserted above)."""
    on, off = completed(results[f"{name}-on"]), completed(results[f"{name}-off"])
    allowed = {"identical", *STABLE_CHANGES.get(name, ())}
    for rank in on["ranks"]:
        stable = [row for row in rank["iterations"] if row["stage"] == "stable"]
        assert {row["sequence_change_kind"] for row in stable} <= allowed, (rank["rank"], stable)
    identical = {**on, "ranks": [{**rank, "iterations": [{**row, "sequence_change_kind": "identical"}
                                                         if row["sequence_change_kind"] in allowed else row
                                                         for row in rank["iterations"]]} for rank in on["ranks"]]}
    assert_settled_in_stable(identical, off, MIN_STABLE_ITERATIONS)


def test_an_fp16_overflow_in_stable_skips_the_step_and_stable_holds(results):
    """Megatron's DynamicGradScaler: the scale grows back after the overflow of a trial and overflows again in
    Stable. The skipped step is the same with and without Chameleon, bit for bit, and no rank leaves Stable (it
    skips only optimizer ops, which the op signature marks as not mattering to swapping)."""
    on, off = completed(results["tp2pp2-sp-llama-fp16-on"]), completed(results["tp2pp2-sp-llama-fp16-off"])
    assert on["steps"] == off["steps"]
    skipped = [i for i, step in enumerate(on["steps"]) if step["skipped"]]
    scales = [step["loss_scale"] for step in on["steps"]]
    for rank in on["ranks"]:
        stages = [row["stage"] for row in rank["iterations"]]
        first_stable = stages.index("stable")
        assert any(i < first_stable for i in skipped) and any(first_stable < i < len(stages) - 1 for i in skipped), (
            skipped, stages)
        assert set(stages[first_stable:]) == {"stable"}
        assert all(rank["iterations"][i]["passive_swaps"] == 0 for i in skipped if i >= first_stable)
    overflow = max(skipped)
    assert scales[overflow] > max(scales[:overflow]) and scales[overflow + 1] == scales[overflow] / 2, scales
    assert on["layout"]["precision"] == "fp16" and on["layout"]["normalization"] == "RMSNorm"
    assert (on["layout"]["position_embedding_type"], on["layout"]["swiglu"], on["layout"]["num_query_groups"]) == (
        "rope", True, 2)


def test_the_feature_layouts_report_what_they_ran(results):
    bf16 = completed(results["tp2dp2-sp-distopt-bf16-on"])
    assert {k: bf16["layout"][k] for k in ("tp", "dp", "sequence_parallel", "use_distributed_optimizer",
                                           "overlap_grad_reduce", "overlap_param_gather", "precision", "optimizer")} == {
        "tp": 2, "dp": 2, "sequence_parallel": True, "use_distributed_optimizer": True, "overlap_grad_reduce": True,
        "overlap_param_gather": True, "precision": "bf16", "optimizer": "megatron"}
    assert all(not step["skipped"] and step["loss_scale"] == 1.0 for step in bf16["steps"])
    # the distributed optimizer: each data-parallel rank steps its own shard of the fp32 main parameters (hashed with
    # the rank's parameters: the two data-parallel ranks of a tensor-parallel rank differ there only)
    shards = {}
    for rank in bf16["ranks"]:
        shards.setdefault(rank["tp_rank"], set()).add(rank["params_sha256"])
    assert all(len(hashes) == 2 for hashes in shards.values()), shards
    ep = completed(results["ep2-moe-on"])
    assert (ep["layout"]["expert_model_parallel_size"], ep["layout"]["num_experts"], ep["layout"]["dp"]) == (2, 4, 2)
    assert "steps" not in ep and ep["layout"]["optimizer"] == "torch-adam"


def test_a_rank_squeezed_mid_iteration_is_relieved_inside_the_op_and_the_job_trains_on(results):
    off, on = completed(results["pp2-squeezed-off"]), completed(results["pp2-squeezed-on"])
    assert on["losses"] == off["losses"] and len(on["losses"]) == 9
    assert [r["params_sha256"] for r in on["ranks"]] == [r["params_sha256"] for r in off["ranks"]]
    squeezed = on["ranks"][0]["iterations"][7]
    assert squeezed["stage"] == "stable" and squeezed["passive_swaps"] > 0, squeezed
    assert squeezed["peak_device_bytes"] <= on["ranks"][0]["capacity_bytes"]
    assert all(it["passive_swaps"] == 0 for it in on["ranks"][1]["iterations"])  # the other rank was not squeezed


def test_report_holds_the_layout_and_every_rank(results):
    report = completed(results["tp2pp2-on"])
    assert {k: report["layout"][k] for k in ("tp", "pp", "vpp", "dp", "world_size", "micro_batches", "recompute")} == {
        "tp": 2, "pp": 2, "vpp": 1, "dp": 1, "world_size": 4, "micro_batches": 4, "recompute": "none"}
    assert report["chameleon"]["config"]["device"]["capacity"] == _bytes("9MB")
    assert all(float.fromhex(x) > 0 for x in report["losses"])
    coordinates = sorted((r["rank"], r["tp_rank"], r["pp_rank"], r["dp_rank"]) for r in report["ranks"])
    assert coordinates == [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 1, 0), (3, 1, 1, 0)]
    for rank in report["ranks"]:
        assert len(rank["iterations"]) == STEADY_ITERATIONS["tp2pp2"] and len(rank["params_sha256"]) == 64
        assert {"peak_device_bytes", "swap_out_bytes", "stall_s", "iteration_s", "stage",
                "stage_transition"} <= set(rank["iterations"][0])
        transitions = [it["stage_transition"] for it in rank["iterations"] if it["stage_transition"]]
        assert transitions and transitions[0].startswith("warmup -> gen_policy: "), transitions
        assert rank["iterations"][0]["stage"] == "warmup" and rank["iterations"][-1]["stage"] in ("gen_policy", "stable")
    dp = completed(results["tp2dp2-on"])
    assert dp["layout"]["dp"] == 2 and sorted(r["dp_rank"] for r in dp["ranks"]) == [0, 0, 1, 1]
    # the data-parallel ranks train on different data: their losses alone would differ, their parameters not
    assert len({r["params_sha256"] for r in dp["ranks"] if r["tp_rank"] == 0}) == 1


def test_micro_batches_are_named_by_the_schedule(results):
    """1F1B: the first stage holds two micro-batches at once (F0 F1 B0 ...); guessing from forward/backward
    turns would merge F0 and F1. Interleaved: slot = chunk * micro_batches + micro_batch."""
    pp2 = {r["pp_rank"]: r["schedule"] for r in completed(results["pp2-on"])["ranks"]}
    assert pp2 == {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"}
    for rank in completed(results["pp2vpp2-on"])["ranks"]:
        runs = rank["schedule"].split()
        assert sorted(runs) == sorted([f"F{s}" for s in range(8)] + [f"B{s}" for s in range(8)]), runs
        assert all(runs.index(f"F{s}") < runs.index(f"B{s}") for s in range(8))
    first_stage = {r["pp_rank"]: r["schedule"] for r in completed(results["pp2vpp2-on"])["ranks"]}[0]
    assert first_stage.startswith("F0 F1 F4 F5"), first_stage  # chunk 0's micro-batches 0, 1, then chunk 1's


def test_sequence_length_changes_are_trained_through(results):
    on, off = completed(results["pp2-vary-seq-length-on"]), completed(results["pp2-off"])
    assert on["layout"]["vary_seq_length"] and on["losses"][:3] == off["losses"][:3]
    assert on["losses"][3:] != off["losses"][3:]  # other lengths from iteration 4 on: other losses


def test_routing_changes_what_each_iteration_holds(results):
    """Tokens per expert follow the router's weights, which change every step: the unswapped peak and the sizes
    saved for backward move from iteration to iteration (the profiler absorbs it); dense layers repeat exactly."""
    moe_off, dense_off = completed(results["pp2-moe-off"]), completed(results["pp2-off"])
    for rank in moe_off["ranks"]:
        assert len({it["peak_device_bytes"] for it in rank["iterations"][1:]}) > 1, rank["iterations"]
    for rank in dense_off["ranks"]:
        assert len({it["peak_device_bytes"] for it in rank["iterations"][1:]}) == 1, rank["iterations"]
    kinds = {name: [[it["sequence_change_kind"] for it in r["iterations"][2:]] for r in completed(results[name])["ranks"]]
             for name in ("pp2-moe-on", "pp2-on")}
    assert all(kind in ("absorbed", "rerouted") for rank in kinds["pp2-moe-on"] for kind in rank), kinds
    assert all(kind == "identical" for rank in kinds["pp2-on"] for kind in rank), kinds


def _torchrun_megatron(tmp_path, *args: str) -> tuple[str, float]:
    """A real torchrun job of two pipeline stages that is meant to fail: its output and its wall time."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "2", "-m", "launch.train_megatron", "--pp", "2",
               "--iterations", "4", "--dist-timeout-s", "600", *args]
    start = time.monotonic()
    # (the job runs in tmp_path; the repository root on PYTHONPATH makes ``launch`` importable there)
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path})
    assert done.returncode != 0
    return done.stdout + done.stderr, time.monotonic() - start


def test_a_failing_rank_ends_a_torchrun_job_in_bounded_time(tmp_path):
    """Rank 1 raises inside its forward step of iteration 2 while rank 0 waits on it in the pipeline; the job
    must end with rank 1's error, not hang in a collective."""
    output, elapsed_s = _torchrun_megatron(tmp_path, "--fail-rank", "1", "--fail-iteration", "2")
    assert "[rank 1/2 tp 0/1 pp 1/2 dp 0/1] iteration 2 failed: RuntimeError: --fail-rank" in output, output[-4000:]
    assert elapsed_s < 180, elapsed_s  # far below the 600 s collective timeout: torchrun tore the job down


def test_an_unrecoverable_out_of_memory_with_chameleon_on_ends_a_torchrun_job_in_bounded_time(tmp_path):
    """Chameleon on, and another tenant takes 50 MB of rank 1's 10 MB in iteration 3: nothing Chameleon frees can
    make room, and one rank cannot retry an iteration alone. Rank 1 must stop with ``RankOutOfMemoryError``
    naming its coordinates and the setting to change, and torchrun must end the job (rank 0 waits on it)."""
    output, elapsed_s = _torchrun_megatron(tmp_path, "--chameleon-device-capacity", "10MB", "--squeeze-rank", "1",
                                           "--squeeze-iteration", "3", "--squeeze-bytes", "50MB")
    assert "RankOutOfMemoryError: rank 1/2 tp 0/1 pp 1/2 dp 0/1: out of memory in iteration 3" in output, output[-4000:]
    assert "--chameleon-device-capacity" in output and "Chameleon swapping is on" in output, output[-4000:]
    assert "iteration 3/4" not in output  # no rank finished the iteration
    assert elapsed_s < 180, elapsed_s  # far below the 600 s collective timeout: torchrun tore the job down


@pytest.mark.quick  # (the module's test in the quick tier: it reads the README, no job)
def test_the_readme_commands_are_the_tested_layouts():
    """The README's torchrun lines run exactly what these tests run (with the launcher's defaults for the
    model size; the tests only ask for fewer iterations)."""
    from launch import train_megatron

    readme = (REPO / "README.md").read_text().split("### The launcher: `launch/train_megatron.py`", 1)[1]
    commands = [line.split("#")[0].split() for line in readme.splitlines()
                if line.startswith(".venv/bin/torchrun") and "--chameleon-device-capacity" in line]
    assert len(commands) == len(LAYOUTS)
    tested = {(world, tuple([*layout, "--chameleon-device-capacity", capacity])) for world, layout, capacity in LAYOUTS.values()}
    for command in commands:
        world = int(command[command.index("--nproc-per-node") + 1])
        assert (world, tuple(command[command.index("launch.train_megatron") + 1:])) in tested, command
    defaults, common = vars(train_megatron.parse_args([])), vars(train_megatron.parse_args(COMMON))
    differ = {k for k in defaults if defaults[k] != common[k]}
    assert differ == {"iterations", "chameleon_min_swap_bytes"}, differ
    assert common["chameleon_min_swap_bytes"] == train_megatron.CPU_DEFAULT_MIN_SWAP

