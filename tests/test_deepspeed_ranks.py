"""Two-rank DeepSpeed jobs on CPU (gloo) through ``launch/train_deepspeed.py``: ZeRO-1, ZeRO-2, ZeRO-3, a
2-stage pipeline with 4 micro-batches, fp16 with loss-scale overflows that skip steps (in WarmUp, and with a
loss-scale window that brings the scale back up until it overflows again, under a policy and in Stable),
bf16 under ZeRO-2 and under DeepSpeed's BF16_Optimizer (ZeRO-1); ZeRO-1 accumulates gradients over 4
micro-batches. Each layout runs without Chameleon (measuring only, capacity unlimited) and with it at
a capacity below the unswapped peak: losses and every rank's final parameters are bit-identical, and every
rank stays within its capacity. For two layouts the run without Chameleon at that capacity runs, too, and
runs out of memory naming its rank.

All jobs run once per session, in one batch (``tests/rank_batch.py``: the launcher is imported once and
each rank is forked with torchrun's environment).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.rank_batch import assert_settled_in_stable, completed, run_jobs

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.multirank  # (NOTE [The multi-rank tier] in tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "deepspeed"
# 3 iterations: the two of WarmUp (swap everything) and a policy trial, each bit-identical, at the unswapped peak
# of the 4 iterations they ran before (reached in iteration 2); fp16 4: its steps 1 and 2 overflow, so the
# optimizer's states first exist after iteration 3's step and are held (its peak) in iteration 4
ITERATIONS = 3
SHORT_ITERATIONS = {"fp16": 4}
# Layouts trained long enough to reach the steady state: 2 WarmUp and 5 trial iterations (zero2: and up to
# profiler.trial_repeats (2) repeats of a close pair), then Stable
STEADY_ITERATIONS = {"zero2": 14, "fp16-window": 12}
MIN_STABLE_ITERATIONS = 4
STEADY_HOST_OP_S = 2e-5  # a fixed host cost per op: each rank's trials, so its Stable policy, repeat on every machine
# zero2 settles with the host's measured time (issue 37 item 6): its trials carry this machine's noise, as a GPU's
# would, and are ranked with profiler.trial_margin; fp16-window's overflows must fall on known iterations
FIXED_HOST = ("fp16-window",)
UNLIMITED = "4GB"
MIB = 2**20

# name -> (config file, changes to its top-level keys, launcher arguments, capacity with Chameleon)
LAYOUTS = {
    "zero1-gas4": ("zero1.json", {"gradient_accumulation_steps": 4}, [], "9MiB"),  # one step per 4 micro-batches
    "zero2": ("zero2.json", {}, [], "9MiB"),
    "zero3": ("zero3.json", {}, [], "8MiB"),
    "pipeline": ("pipeline.json", {}, ["--pipeline-stages", "2"], "9MiB"),
    # the config's initial loss scale 2^24 overflows twice (hysteresis 1): iterations 1 and 2 skip their
    # step, the later ones apply it
    "fp16": ("fp16.json", {}, [], "4MiB"),
    "bf16": ("bf16.json", {}, [], "4MiB"),  # ZeRO-2's optimizer on bf16 partitions
    "bf16-zero1": ("bf16_zero1.json", {}, [], "4MiB"),  # BF16_Optimizer: ZeRO-1, fp32 gradient accumulators
    # initial scale 2^22, window 2, hysteresis 1: 2^22 holds and 2^23 overflows, so after each overflow two clean
    # steps bring the scale back to 2^23 and the next step overflows: iterations 4 (a policy trial), 8 and 12
    # (Stable) skip their step
    "fp16-window": ("fp16_scale_window.json", {}, [], "4MiB"),
}
OVERFLOW_IN_STABLE = "fp16-window"
# The same fp16 job with one micro-batch per step (each skipped step is then a larger share of the iteration's
# ops) and 2 layers, measuring only (the profiler's stages are the same with and without swapping), for 8
# iterations: the overflow of iteration 4 (a trial), then Stable in iteration 8, which a runtime sent back to
# WarmUp by that skipped step never reaches
ONE_MICRO_BATCH = ("fp16_scale_window.json", {"gradient_accumulation_steps": 1}, ["--num-layers", "2"])
ONE_MICRO_BATCH_ITERATIONS = 8
OUT_OF_MEMORY_RUNS = ("zero1-gas4", "pipeline")  # the run without Chameleon at the tight capacity, too


def _iterations(name: str) -> int:
    return STEADY_ITERATIONS.get(name, SHORT_ITERATIONS.get(name, ITERATIONS))


def _argv(name: str, config: Path, report: Path, chameleon: bool, capacity: str) -> list[str]:
    extra = LAYOUTS[name][2]
    iterations = _iterations(name) if chameleon or capacity == UNLIMITED else ITERATIONS
    return ["--deepspeed_config", str(config), "--iterations", str(iterations), "--chameleon-device-capacity", capacity,
            "--report", str(report), *extra, *([] if chameleon else ["--no-chameleon"])]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("deepspeed_ranks")
    runs = []
    for name, (file, changes, _, capacity) in LAYOUTS.items():
        config = json.loads((CONFIGS / file).read_text())
        config.update(changes)
        if name in FIXED_HOST:
            config["chameleon"]["device"]["host_op_s"] = STEADY_HOST_OP_S
        path = work / f"{name}.ds.json"
        path.write_text(json.dumps(config))
        variants = [("off", False, UNLIMITED), ("on", True, capacity)]
        if name in OUT_OF_MEMORY_RUNS:
            variants.append(("oom", False, capacity))
        for variant, chameleon, size in variants:
            runs.append({"name": f"{name}-{variant}", "world_size": 2, "timeout_s": 300,
                         "argv": _argv(name, path, work / f"{name}-{variant}.report.json", chameleon, size)})
    file, changes, extra = ONE_MICRO_BATCH
    config = {**json.loads((CONFIGS / file).read_text()), **changes}
    config["chameleon"]["device"]["host_op_s"] = STEADY_HOST_OP_S
    path = work / "fp16-window-gas1.ds.json"
    path.write_text(json.dumps(config))
    runs.append({"name": "fp16-window-gas1-off", "world_size": 2, "timeout_s": 300,
                 "argv": ["--deepspeed_config", str(path), "--iterations", str(ONE_MICRO_BATCH_ITERATIONS),
                          "--chameleon-device-capacity", UNLIMITED, "--report", str(work / "fp16-window-gas1-off.report.json"),
                          "--no-chameleon", *extra]})
    return run_jobs("train_deepspeed", runs, work)


def _skipped_iterations(rank: dict) -> list[int]:
    """The iterations (1-based) whose optimizer step DeepSpeed skipped, from each row's running count."""
    counts = [row["skipped_steps"] for row in rank["iterations"]]
    return [i + 1 for i, (before, after) in enumerate(zip([0, *counts], counts)) if after > before]


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_trains_bit_identically_within_capacity(results, name):
    off, on = completed(results[f"{name}-off"]), completed(results[f"{name}-on"])
    assert len(on["losses"]) == _iterations(name) and on["losses"] == off["losses"], "losses differ"
    assert [r["params_sha256"] for r in on["ranks"]] == [r["params_sha256"] for r in off["ranks"]], "parameters differ"
    assert off["chameleon"]["enabled"] is False and off["chameleon"]["measured"] is True
    assert on["chameleon"]["enabled"] is True
    for without, rank in zip(off["ranks"], on["ranks"]):
        capacity = rank["capacity_bytes"]
        assert rank["peak_device_bytes"] <= capacity, (rank["rank"], rank["peak_device_bytes"], capacity)
        assert [row["stage"] for row in rank["iterations"]][:2] == ["warmup", "warmup"]
    peaks = [r["peak_device_bytes"] for r in off["ranks"]]
    assert max(peaks) > on["ranks"][0]["capacity_bytes"], "the capacity must be below the unswapped peak"
    for without, rank in zip(off["ranks"], on["ranks"]):
        if without["peak_device_bytes"] > rank["capacity_bytes"]:
            assert sum(row["swap_out_bytes"] for row in rank["iterations"]) > 0, rank["rank"]


@pytest.mark.parametrize("name", [n for n in STEADY_ITERATIONS if n != OVERFLOW_IN_STABLE])
def test_every_rank_reaches_stable_and_stays(results, name):
    """Every rank settles in Stable after its trials and stays, with no passive swap and a policy that swaps
    less than WarmUp's swap-everything (none on a rank that fits; the bit-identical training is asserted above)."""
    assert_settled_in_stable(completed(results[f"{name}-on"]), completed(results[f"{name}-off"]),
                             MIN_STABLE_ITERATIONS)


def test_an_fp16_overflow_in_stable_is_absorbed_without_leaving_stable(results):
    """The loss scale grows back every 2 clean steps until it overflows again: steps are skipped under a policy
    trial and in Stable, the same ones with and without Chameleon (the bit-identical training is asserted
    above), and every rank stays in Stable through them: no transition, no passive swap, no program change
    (an iteration without a skipped step is identical to the reference), a policy that swaps less than WarmUp."""
    on, off = completed(results[f"{OVERFLOW_IN_STABLE}-on"]), completed(results[f"{OVERFLOW_IN_STABLE}-off"])
    for rank, unswapped in zip(on["ranks"], off["ranks"]):
        rows, skipped = rank["iterations"], _skipped_iterations(rank)
        stages = [row["stage"] for row in rows]
        assert skipped == _skipped_iterations(unswapped) == _skipped_iterations(on["ranks"][0]), (rank["rank"], skipped)
        assert [it for it in skipped if stages[it - 1] == "stable"], (rank["rank"], skipped, stages)
        assert [it for it in skipped if stages[it - 1] == "gen_policy"], (rank["rank"], skipped, stages)
        scale_in = [None, *(row["loss_scale"] for row in rows)]  # scale_in[i - 1]: the scale iteration i ran with
        for it in skipped[1:]:  # an overflow again after the scale grew back; the skip halves it
            assert scale_in[it - 1] > scale_in[it - 2] and rows[it - 1]["loss_scale"] < scale_in[it - 1], scale_in
        first = stages.index("stable")
        assert set(stages[first:]) == {"stable"} and len(stages) - first >= MIN_STABLE_ITERATIONS, stages
        stable = list(enumerate(rows[first:], start=first + 1))
        assert all(row["stage_transition"] is None and row["passive_swaps"] == 0 for _, row in stable), stable
        assert all(row["sequence_change_kind"] == "identical" for it, row in stable if it not in skipped), stable
        assert all(row["sequence_change_kind"] != "changed" for _, row in stable), stable
        assert all(0 < row["swap_out_bytes"] < rows[0]["swap_out_bytes"] for _, row in stable), stable


def test_a_skipped_step_reads_as_absorbed(results):
    """A skipped optimizer step leaves the model's ops as they were: at most an absorbed difference."""
    for rank in completed(results[f"{OVERFLOW_IN_STABLE}-on"])["ranks"]:
        kinds = {rank["iterations"][it - 1]["sequence_change_kind"] for it in _skipped_iterations(rank)}
        assert kinds <= {"identical", "absorbed"}, (rank["rank"], kinds)


def test_with_one_micro_batch_per_step_a_skipped_step_keeps_the_runtime_on_course(results):
    """One micro-batch per step: a skipped step under a policy trial must not send the runtime back to WarmUp
    (when the step's ops counted as the model's: op-pair cosine 0.92-0.94 < 0.95, "changed", never Stable)."""
    report = completed(results["fp16-window-gas1-off"])
    for rank in report["ranks"]:
        assert [it for it in _skipped_iterations(rank) if rank["iterations"][it - 1]["stage"] != "warmup"], rank["rank"]
        stages = [row["stage"] for row in rank["iterations"]]
        assert stages == ["warmup"] * 2 + ["gen_policy"] * 5 + ["stable"] * (len(stages) - 7), (rank["rank"], stages)


def test_the_layouts_are_what_they_say(results):
    layouts = {name: completed(results[f"{name}-on"])["layout"] for name in LAYOUTS}
    assert [layouts[n]["zero_stage"] for n in ("zero1-gas4", "zero2", "zero3")] == [1, 2, 3]
    assert layouts["pipeline"]["pipeline_stages"] == 2 and layouts["pipeline"]["gradient_accumulation_steps"] == 4
    assert layouts["pipeline"]["dp"] == 1 and layouts["zero2"]["dp"] == 2
    assert layouts["zero1-gas4"]["gradient_accumulation_steps"] == 4
    assert layouts["fp16"]["precision"] == "fp16" and layouts["zero2"]["precision"] == "fp32"
    assert layouts["fp16-window"]["precision"] == "fp16"
    assert [(layouts[n]["precision"], layouts[n]["zero_stage"], layouts[n]["optimizer"]) for n in ("bf16", "bf16-zero1")] \
        == [("bf16", 2, "DeepSpeedZeroOptimizer"), ("bf16", 1, "BF16_Optimizer")]
    # the overflows really skipped steps (the op sequence of those iterations had no optimizer update)
    assert 0 < layouts["fp16"]["skipped_steps"] < _iterations("fp16")
    assert all(layout["world_size"] == 2 for layout in layouts.values())


def test_the_pipeline_names_each_micro_batch_in_its_stage(results):
    ranks = completed(results["pipeline-on"])["ranks"]
    assert [(r["pp_rank"], r["coordinates"]["pp_size"]) for r in ranks] == [(0, 2), (1, 2)]
    first, last = ranks[0]["schedule"].split(), ranks[1]["schedule"].split()
    assert sorted(first) == sorted(last) == sorted(f"{p}{m}" for p in "FB" for m in range(4))
    assert first.index("F1") < first.index("B0"), "the first stage runs ahead of the last (1F1B warm-up)"
    assert last[:2] == ["F0", "B0"]


@pytest.mark.parametrize("name", OUT_OF_MEMORY_RUNS)
def test_without_chameleon_the_tight_capacity_runs_out_of_memory(results, name):
    result = results[f"{name}-oom"]
    assert any(code != 0 for code in result["returncodes"]) and not result["timed_out"]
    assert result["report"] is None
    logs = "\n".join(result["logs"])
    assert "RankOutOfMemoryError: rank " in logs and "out of memory" in logs, logs[-3000:]
    assert "[rank 0/2 " in logs or "[rank 1/2 " in logs, "the failure is logged with the rank's coordinates"


def test_the_comparison_tool_reads_the_reports(results, capsys):
    from launch.bench import compare_reports

    paths = [results[f"zero2-{variant}"]["argv"] for variant in ("off", "on")]
    reference, chameleon = (argv[argv.index("--report") + 1] for argv in paths)
    assert compare_reports.main([reference, chameleon]) == 0
    printed = capsys.readouterr().out
    assert "bit-identical: yes" in printed and "within capacity on every rank: yes" in printed and "emulated" in printed
    assert compare_reports.main([reference, results["fp16-on"]["argv"][results["fp16-on"]["argv"].index("--report") + 1]]) == 1


@pytest.mark.quick  # (the module's test in the quick tier: it reads the README, no job)
def test_the_readme_commands_are_tested_layouts():
    """Every launcher line of the README's DeepSpeed section runs a layout these tests run, at its capacity."""
    readme = (REPO / "README.md").read_text().split("### The launcher: `launch/train_deepspeed.py`", 1)[1]
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    tested = {(LAYOUTS[n][0], tuple(LAYOUTS[n][2]), LAYOUTS[n][3]) for n in LAYOUTS if not LAYOUTS[n][1]}
    commands = [line.split() for line in block.strip().splitlines()]
    assert len(commands) >= 3
    for command in commands:
        assert command[0] in (".venv/bin/torchrun", ".venv/bin/deepspeed"), command
        assert command[1:3] in (["--nproc-per-node", "2"], ["--num_gpus", "2"]), command
        args = command[command.index("launch.train_deepspeed") + 1:]
        config = Path(args[args.index("--deepspeed_config") + 1])
        assert (REPO / config).is_file() and config.parent == Path("configs/deepspeed"), config
        capacity = args[args.index("--chameleon-device-capacity") + 1]
        rest = tuple(a for i, a in enumerate(args) if a not in ("--deepspeed_config", "--chameleon-device-capacity")
                     and args[i - 1] not in ("--deepspeed_config", "--chameleon-device-capacity"))
        assert (config.name, rest, capacity) in tested, command
