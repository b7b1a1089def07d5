"""ZeRO-3 over two ranks (gloo, CPU), model built under ``deepspeed.zero.Init``, each module's gathered weights
released after its forward (``stage3_max_reuse_distance: 0``): with Chameleon a forward pass holds what plain
DeepSpeed holds, measured as the emulated device's live bytes and as the process's resident memory, and the
emulated device counts the partitions and optimizer buffers DeepSpeed made before the first iteration.

One batch of three jobs of ``launch/experiments/zero3_memory.py`` (``tests/rank_batch.py``): ``plain`` (DeepSpeed alone),
``off`` (the runtime measuring only: no hooks) and ``on``. The first iteration is left out of the memory
comparison (one-time allocations of every run); the weights are 12 layers of 4 MiB, the activations a few KiB.
"""

from __future__ import annotations

import pytest

from tests.rank_batch import completed, run_jobs, selected_runs

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.multirank  # (NOTE [The multi-rank tier] in tests/conftest.py)

ITERATIONS = 3
TOLERANCE = 0.05  # of the full weights: what a forward may hold beyond plain DeepSpeed's (a held layer is 1/12)


READS = {"test_a_forward_pass_holds_what_plain_deepspeed_holds_on_the_emulated_device": ["on", "off"],
         "test_a_forward_pass_holds_what_plain_deepspeed_holds_in_resident_memory": ["plain", "off", "on"],
         "test_training_is_bit_identical": ["plain", "off", "on"],
         "test_the_engine_buffers_made_before_the_first_iteration_are_counted": ["off", "on"]}


@pytest.fixture(scope="module")
def reports(tmp_path_factory, request):
    """The runs the selected tests read, in one batch (the whole module: plain, off and on)."""
    work = tmp_path_factory.mktemp("zero3_memory")
    runs = [{"name": mode, "world_size": 2, "timeout_s": 300,
             "argv": ["--mode", mode, "--iterations", str(ITERATIONS), "--report", str(work / f"{mode}.json")]}
            for mode in ("plain", "off", "on")]
    runs = selected_runs(request, runs, lambda item: READS[item.originalname])
    return {name: completed(result) for name, result in run_jobs("zero3_memory", runs, work).items()}


def _growth(report, rank, field):
    return [row[field] for row in report["ranks"][rank]["iterations"][1:]]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_forward_pass_holds_what_plain_deepspeed_holds_on_the_emulated_device(reports, rank):
    full_bytes = reports["on"]["full_weight_bytes"]
    on_live, off_live = (_growth(reports[m], rank, "forward_live_growth_bytes") for m in ("on", "off"))
    for with_chameleon, without in zip(on_live, off_live):
        assert with_chameleon - without <= TOLERANCE * full_bytes, (
            f"emulated live bytes: the forward grew {with_chameleon / 2**20:.2f} MiB with Chameleon, "
            f"{without / 2**20:.2f} MiB without (full weights {full_bytes / 2**20:.0f} MiB)")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_forward_pass_holds_what_plain_deepspeed_holds_in_resident_memory(reports, rank):
    full_bytes = reports["on"]["full_weight_bytes"]
    allowed_bytes = TOLERANCE * full_bytes
    on_rss = _growth(reports["on"], rank, "forward_resident_growth_bytes")
    for mode in ("plain", "off"):
        for with_chameleon, without in zip(on_rss, _growth(reports[mode], rank, "forward_resident_growth_bytes")):
            assert with_chameleon - without <= allowed_bytes, (
                f"resident memory: the forward grew {with_chameleon / 2**20:.2f} MiB with Chameleon, "
                f"{without / 2**20:.2f} MiB in the {mode} run (full weights {full_bytes / 2**20:.0f} MiB)")


def test_training_is_bit_identical(reports):
    for mode in ("off", "on"):
        for reference, rank in zip(reports["plain"]["ranks"], reports[mode]["ranks"]):
            assert rank["losses"] == reference["losses"], mode
            assert [r["grads_sha256"] for r in rank["iterations"]] == [r["grads_sha256"] for r in reference["iterations"]]


@pytest.mark.quick  # (the module's test in the quick tier: two of the three jobs)
def test_the_engine_buffers_made_before_the_first_iteration_are_counted(reports):
    """A GPU counts each rank's parameter partition and the optimizer's fp32 copy of it (and its gradient
    partition buffer) from ``deepspeed.initialize`` on; so must the emulated device."""
    for mode in ("off", "on"):
        report = reports[mode]
        partition_bytes = report["full_weight_bytes"] // 2
        for rank in report["ranks"]:
            first = rank["iterations"][0]["live_bytes_before_forward"]
            assert first >= 2 * partition_bytes, (mode, rank["rank"], first, partition_bytes)
