"""The planner's per-rank peak against the emulated device's measured peak, for the CPU Megatron-core GPT.

Single-rank runs (TP = PP = DP = 1, fp32, Adam) with no, selective and full recomputation, and with the
Chameleon runtime swapping every eligible saved tensor (what it does in its WarmUp iterations); the
measurement helpers are those of ``python -m launch.experiments.reproduce_paper --validate``."""

import pytest

pytest.importorskip("chameleon_dist.integrations.megatron.gpt")

from launch.experiments import reproduce_paper as script  # noqa: E402  (after the skip)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")

SHAPES = script.VALIDATION_SHAPES
CASES = [(shape, recompute, swap) for shape in SHAPES for recompute, swap in script.SETTINGS]


@pytest.mark.slow
@pytest.mark.parametrize("shape,recompute,swap", CASES,
                         ids=[f"{s.num_layers}L-h{s.hidden_size}-s{s.seq_length}-{r}{'-swap' if w else ''}" for s, r, w in CASES])
def test_predicted_peak_is_within_10_percent_of_the_measured_peak(shape, recompute, swap):
    measured = script.measure_peak_bytes(shape, recompute, swap)
    predicted = script.predicted_peak_bytes(shape, recompute, swap)
    assert measured > 0
    assert abs(predicted / measured - 1) <= 0.10, (
        f"{shape.describe()}, recompute={recompute}, swap={swap}: predicted {predicted / 2**20:.1f} MiB, "
        f"measured {measured / 2**20:.1f} MiB")


def test_settings_order_the_peaks_as_measured_would():
    """Without running anything: recomputation and swapping lower the predicted peak for every shape."""
    for shape in SHAPES:
        peaks = {(r, w): script.predicted_peak_bytes(shape, r, w) for r, w in script.SETTINGS}
        assert peaks[("full", False)] < peaks[("selective", False)] < peaks[("none", False)]
        assert peaks[("none", True)] < peaks[("none", False)]


def test_validation_markdown_and_doc_sections(tmp_path):
    doc = tmp_path / "planner.md"
    doc.write_text("intro\n<!-- validation:begin -->\nold\n<!-- validation:end -->\nend\n")
    memory = [{"shape": "s", "recompute": "none", "swap": False, "measured_bytes": 2**20 * 100,
               "predicted_bytes": 2**20 * 105, "error": 0.05}]
    timing = [{"recompute": "none", "swap": True, "measured_s": 0.2, "predicted_s": 0.19, "error": -0.05,
               "measured_stall_s": 0.01, "predicted_stall_s": 0.0, "measured_peak_bytes": 2**20 * 90,
               "predicted_peak_bytes": 2**20 * 95}]
    calibration = {"layer_forward_s": 0.015, "optimizer_s": 0.02, "effective_flops_per_s": 1.2e11,
                   "link_bytes_per_s": 1e9, "capacity_bytes": 120 * 2**20}
    text = script.validation_markdown(memory, timing, calibration, "cmd")
    assert "| s | none | no | 100.0 MiB | 105.0 MiB | +5.0% |" in text
    assert "swap (runtime's policy)" in text and "-5.0%" in text
    script.write_section("validation", text, doc)
    written = doc.read_text()
    assert written.startswith("intro\n") and written.endswith("end\n") and "\nold\n" not in written and "`cmd`" in written
    with pytest.raises(SystemExit, match="reproduction"):
        script.write_section("reproduction", "x", doc)
