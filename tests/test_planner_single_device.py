"""One device's predictions per approach (planner/single_device.py), the host link's physical bound, and the
pre_process / post_process switches of a layout that let the planner price a pipeline stage alone."""

import pytest

from chameleon_dist.device.presets import PRESETS, get_preset
from chameleon_dist.planner import Layout, evaluate, load_hardware, load_model
from chameleon_dist.planner.profiles import make_setup
from chameleon_dist.planner.single_device import (
    APPROACHES,
    hardware_from_preset,
    physical_bound,
    predict_single_device,
    stage_model,
    with_budget,
)

LLAMA7B, LLAMA70B, MIXTRAL = load_model("llama2-7b"), load_model("llama2-70b"), load_model("mixtral-8x7b")
SEQ = 4096


def preset_hardware(name):
    return hardware_from_preset(get_preset(name))


def predict(model=LLAMA7B, hardware="gh200", **kwargs):
    settings = dict(seq_length=SEQ, micro_batch_size=1, micro_batches=2)
    settings.update(kwargs)
    return predict_single_device(model, preset_hardware(hardware), **settings)


def half_way_budget(model=LLAMA7B, hardware="gh200", **kwargs):
    """A budget between what nothing can move and the peak without swapping."""
    none = predict(model, hardware, approaches=("none",), **kwargs)["none"]
    return none.static_bytes + (none.peak_bytes - none.static_bytes) // 2


def test_every_approach_gets_a_prediction():
    out = predict(budget_bytes=half_way_budget())
    assert tuple(out) == APPROACHES
    for approach, p in out.items():
        assert p.approach == approach and p.iteration_s > 0 and p.peak_bytes > p.static_bytes > 0
        assert p.layout.tp == p.layout.pp == p.layout.dp == 1
        assert p.to_dict()["time"]["total_s"] == pytest.approx(p.iteration_s)
    assert out["swap"].layout.swap and out["swap+recompute"].layout.recompute == "selective"


def test_recomputation_trades_time_for_memory():
    out = predict(approaches=("none", "selective", "full"))
    none, selective, full = out["none"], out["selective"], out["full"]
    assert full.iteration_s > selective.iteration_s > none.iteration_s
    assert full.peak_bytes < selective.peak_bytes < none.peak_bytes  # flash: selective drops only the LSE
    assert full.time.recompute > selective.time.recompute > none.time.recompute == 0


def test_none_reports_its_peak_even_when_it_does_not_fit():
    budget = half_way_budget()
    none = predict(budget_bytes=budget, approaches=("none",))["none"]
    assert not none.fits and none.peak_bytes > budget == none.budget_bytes
    assert "budget" in none.reason


def test_swap_fits_the_budget_it_is_given():
    budget = half_way_budget()
    out = predict(budget_bytes=budget, approaches=("none", "swap"))
    swap = out["swap"]
    assert swap.fits and swap.peak_bytes <= budget < out["none"].peak_bytes
    assert swap.swapped_bytes > 0
    assert swap.iteration_s >= out["none"].iteration_s  # the stall is the only difference


def test_swap_stalls_on_a_slow_link_at_the_same_budget():
    budget = half_way_budget(hardware="a100-pcie")
    slow = predict(hardware="a100-pcie", budget_bytes=budget, approaches=("swap",))["swap"]
    fast = predict(hardware="gh200", budget_bytes=budget, approaches=("swap",))["swap"]
    assert slow.stall_s > fast.stall_s == 0.0


def test_without_a_budget_the_profiles_usable_memory_is_the_budget():
    hardware = load_hardware("gh200-96gb")
    out = predict_single_device(LLAMA7B, hardware, seq_length=SEQ, micro_batch_size=1, micro_batches=1,
                                approaches=("full",))
    assert out["full"].budget_bytes == hardware.usable_bytes


def test_a_stage_without_embedding_and_head_is_cheaper_than_with_them():
    kwargs = dict(model=LLAMA70B, num_layers=10, approaches=("none",))
    middle = predict(pre_process=False, post_process=False, **kwargs)["none"]
    first = predict(pre_process=True, post_process=False, **kwargs)["none"]
    last = predict(pre_process=False, post_process=True, **kwargs)["none"]
    assert middle.static_bytes < first.static_bytes  # the embedding's parameters and their optimizer state
    assert middle.peak_bytes < last.peak_bytes and middle.iteration_s < last.iteration_s  # the head's work
    assert "no-embedding no-head" in middle.layout.describe()
    whole = predict(model=LLAMA70B, approaches=("none",))["none"]
    assert whole.iteration_s > 7 * middle.iteration_s  # 80 layers against 10


def test_a_mixtral_stage_is_predicted_too():
    out = predict(model=MIXTRAL, num_layers=4, pre_process=False, post_process=False,
                  approaches=("none", "full"))
    assert out["full"].peak_bytes < out["none"].peak_bytes


def test_layout_defaults_keep_the_ends_of_the_model():
    setup = make_setup(global_batch_size=2, seq_length=SEQ)
    hardware = load_hardware("h200-141gb")
    plain, explicit = (evaluate(LLAMA7B, hardware, setup, layout)
                       for layout in (Layout(), Layout(pre_process=True, post_process=True)))
    assert plain.peak_bytes == explicit.peak_bytes and plain.iteration_s == explicit.iteration_s


def test_helpers_check_their_inputs():
    with pytest.raises(ValueError, match="unknown approaches"):
        predict(approaches=("magic",))
    with pytest.raises(ValueError, match="budget_bytes"):
        with_budget(preset_hardware("h200"), 0)
    assert with_budget(preset_hardware("h200"), 10**15).usable_bytes == 10**15  # above the capacity
    assert stage_model(LLAMA70B, 10).num_layers == 10 and stage_model(LLAMA70B) is LLAMA70B


def test_hardware_from_preset_carries_the_presets_figures():
    for preset in PRESETS:
        hardware = hardware_from_preset(preset)
        assert hardware.usable_bytes == preset.memory_bytes
        assert hardware.peak_flops_per_s == preset.peak_flop_per_s and hardware.efficiency == 0.45
        assert (hardware.h2d_bytes_per_s, hardware.d2h_bytes_per_s) == (preset.h2d_bytes_per_s, preset.d2h_bytes_per_s)
        assert hardware.swap_h2d_bytes_per_s == pytest.approx(preset.h2d_bytes_per_s * preset.duplex_factor)


# ---- the host link's physical bound -----------------------------------------------------------------
def test_physical_bound_grows_with_the_link_and_stops_at_one():
    hardware = preset_hardware("h200")
    shares = [physical_bound(LLAMA7B, hardware, seq_length=SEQ, d2h_bytes_per_s=rate).share
              for rate in (10e9, 25e9, 55e9, 100e9, 300e9, 1e12)]
    assert shares == sorted(shares) and shares[0] < shares[2] < 1.0
    assert shares[-1] == 1.0


def test_physical_bound_is_the_roofline_formula():
    bound = physical_bound(LLAMA7B, preset_hardware("h200"), seq_length=SEQ)
    assert bound.share == pytest.approx(bound.d2h_bytes_per_s * bound.layer_forward_s / bound.layer_saved_bytes)
    assert bound.savable_bytes == int(bound.share * bound.total_saved_bytes)
    assert bound.total_saved_bytes > LLAMA7B.num_layers * bound.layer_saved_bytes  # and the head's
    slower = physical_bound(LLAMA7B, preset_hardware("h200"), seq_length=SEQ, efficiency=0.30)
    assert slower.share > bound.share  # a slower forward gives the link more time


def test_gh200_moves_all_of_a_llama2_7b_layer():
    for hardware in (preset_hardware("gh200"), load_hardware("gh200-96gb")):
        bound = physical_bound(LLAMA7B, hardware, seq_length=SEQ)
        assert bound.share == 1.0 and bound.savable_bytes == bound.total_saved_bytes


def test_physical_bound_matches_the_pcie5_figures():
    """Issue 28's figures at 45% MFU on a 989 TFLOPS Hopper with a ~55 GB/s PCIe5 link: 38-44% of a
    Llama2-7B layer, 69-83% of a Llama2-70B layer."""
    hardware = preset_hardware("h200")
    assert 0.38 <= physical_bound(LLAMA7B, hardware, seq_length=SEQ).share <= 0.44
    assert 0.69 <= physical_bound(LLAMA70B, hardware, seq_length=SEQ).share <= 0.83
