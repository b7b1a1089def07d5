"""Issue 29: a planner a user can trust. Every plan leaves the memory margin free, plans within the model's
error are ties with a reason to prefer one, assumed hardware inputs carry ranges, and the headline speedups
are reported as ranges over them."""

import json
import re

import pytest

from chameleon_dist.cli import plan as cli
from chameleon_dist.config import ConfigError
from chameleon_dist.config.shipped import CONFIGS_DIR
from chameleon_dist.planner import Layout, SearchSpace, TrainingSetup, evaluate, load_hardware, load_model, search
from chameleon_dist.planner.cluster import load_cluster
from chameleon_dist.planner.profiles import HardwareProfile, shipped_names
from chameleon_dist.planner.search import FEASIBLE, OUT_OF_MEMORY, TIE_FRACTION, departures
from chameleon_dist.planner.sensitivity import AssumedInput, sensitivity_of_search, sweep, with_inputs

GB = 10**9


@pytest.fixture(scope="module")
def default_search():
    """The default command's setting (Llama2-7B, 8 x 910B, seq 4K, batch 64)."""
    return search(load_model("llama2-7b"), load_hardware("ascend-910b"), TrainingSetup(global_batch_size=64,
                                                                                       seq_length=4096), 8)


SETTINGS = [(hardware, seq) for hardware in ("ascend-910b", "a100-80gb", "h100-80gb") for seq in (2048, 4096, 8192)]


def _first_search(wanted):
    """The first Llama2-7B-on-8 search over SETTINGS for which ``wanted(result)`` holds (which one does moves
    with the cost model; that one exists is part of what the tests check)."""
    for hardware, seq in SETTINGS:
        result = search(load_model("llama2-7b"), load_hardware(hardware),
                        TrainingSetup(global_batch_size=64, seq_length=seq), 8)
        if wanted(result):
            return hardware, seq, result
    raise AssertionError(f"no setting in {SETTINGS} has the wanted ties")


@pytest.fixture(scope="module")
def tie_search():
    """A setting whose best plan has a tie that is not the recommended one."""
    return _first_search(lambda r: len(r.ties()) >= 3 and r.recommended is not r.best)


# ---- the memory margin ------------------------------------------------------------------------------------
def test_every_plan_leaves_the_margin_swap_plans_too():
    llama, hardware = load_model("llama2-7b"), load_hardware("ascend-910b")
    setup = TrainingSetup(global_batch_size=64, seq_length=16384)
    result = search(llama, hardware, setup, 8)
    budget = int(hardware.usable_bytes * 0.95)
    feasible = [p for p in result.plans if p.status == FEASIBLE]
    assert any(p.layout.swap and p.swapped_bytes > 0 for p in feasible)
    for p in feasible:
        assert p.budget_bytes == budget and p.peak_bytes <= budget and p.free_bytes >= hardware.usable_bytes - budget
        assert all(s.budget_bytes == budget for s in p.swap)  # the policy had the margin taken off too


def test_a_plan_inside_the_margin_is_out_of_memory_and_fits_without_it():
    """The default command's old pick peaked at 62.0 of 62.0 GB usable (issue 29)."""
    llama, hardware = load_model("llama2-7b"), load_hardware("ascend-910b")
    tight = TrainingSetup(global_batch_size=64, seq_length=4096, memory_margin=0.0)
    fitting = [p for p in search(llama, hardware, tight, 8, SearchSpace(swap=(False,))).plans if p.feasible]
    fullest = max(fitting, key=lambda p: p.peak_bytes)
    assert fullest.free_bytes < 0.05 * hardware.usable_bytes  # without a margin a plan this full wins its place
    margin = fullest.free_bytes / hardware.usable_bytes + 0.001  # a margin its peak falls inside
    plan = evaluate(llama, hardware, tight.model_copy(update={"memory_margin": margin}), fullest.layout)
    assert plan.status == OUT_OF_MEMORY and plan.peak_bytes == fullest.peak_bytes


def test_default_run_no_longer_picks_a_plan_at_the_device_limit(default_search):
    best = default_search.best
    assert best.free_bytes >= 0.05 * default_search.hardware.usable_bytes
    assert best.peak_bytes <= default_search.setup.budget_bytes(default_search.hardware)


@pytest.mark.parametrize("argv, expected", [
    (["--memory-margin", "0%"], 0.0), (["--memory-margin", "10%"], 0.10), ([], 0.05),
    (["--memory-margin", "3.1GB"], 3.1e9 / 62e9),
])
def test_memory_margin_flag_reaches_the_plans(argv, expected, capsys):
    assert cli.main(["--devices", "8", "--tp", "1,2", "--no-swap", "--json", *argv]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory_margin"] == pytest.approx(expected)
    usable = data["best"]["usable_bytes"]
    assert data["best"]["budget_bytes"] == int(usable * (1 - expected))
    for a in data["alternatives"]:
        if a["status"] == "feasible":
            assert a["peak_bytes"] <= a["budget_bytes"] and a["free_bytes"] == usable - a["peak_bytes"]


@pytest.mark.parametrize("value, message", [
    ("100%", "from 0% to under 100%"), ("-1%", "from 0% to under 100%"), ("lots", "a size (e.g. 3GB)"),
])
def test_unreadable_memory_margins_are_refused(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"--memory-margin={value}"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_margin_larger_than_the_device_is_refused(capsys):
    assert cli.main(["--memory-margin", "70GB"]) == 2
    assert "--memory-margin 70GB leaves nothing of the 62.0 GB usable" in capsys.readouterr().err


def test_text_report_shows_free_memory_for_every_plan(capsys):
    assert cli.main(["--devices", "8", "--seq", "8192", "--global-batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "free GB" in out and "free at the peak:" in out and "--memory-margin 5%" in out


# ---- ties -------------------------------------------------------------------------------------------------
def test_ties_are_the_plans_within_the_models_error(tie_search):
    tie_search = tie_search[2]
    best = tie_search.best
    ties = tie_search.ties()
    assert ties[0] is best and len(ties) >= 2
    limit = best.iteration_s * (1 + TIE_FRACTION)
    assert all(p.iteration_s <= limit for p in ties)
    others = [p for p in tie_search.plans if p.feasible and p not in ties]
    assert others and all(p.iteration_s > limit for p in others)
    for p in ties[1:]:
        if p.iteration_s > best.iteration_s * 1.0005:
            assert p.reason.startswith("a tie: ") and "error" in p.reason


def test_the_recommended_tie_is_the_most_standard_then_the_roomiest(tie_search):
    tie_search = tie_search[2]
    ties = tie_search.ties()
    pick = tie_search.recommended
    assert pick in ties
    fewest = min(len(departures(p.layout)) for p in ties)
    assert len(departures(pick.layout)) == fewest
    assert pick.free_bytes == max(p.free_bytes for p in ties if len(departures(p.layout)) == fewest)


def test_departures_name_what_a_layout_adds():
    assert departures(Layout(tp=2, dp=4)) == []
    assert departures(Layout(pp=2, dp=4, vpp=4, swap=True)) == ["swap", "pipeline", "interleaving"]
    assert departures(Layout(dp=8, recompute="full")) == ["recomputation"]


def test_report_names_the_recommended_tie_and_why(tie_search, capsys):
    hardware, seq, result = tie_search
    assert cli.main(["--hardware", hardware, "--seq", str(seq)]) == 0
    words = " ".join(capsys.readouterr().out.split())
    assert f"{len(result.ties()) - 1} plan(s) within 2% of the best, the cost model's error: a tie." in words
    assert f"recommended: {result.recommended.layout.describe()} (" in words and "prefer it for" in words


# ---- assumed inputs carry ranges --------------------------------------------------------------------------
@pytest.mark.parametrize("kind, name", [("hardware", n) for n in shipped_names("hardware")]
                         + [("clusters", n) for n in shipped_names("cluster")])
def test_every_shipped_hardware_input_has_a_source_or_an_assumed_range(kind, name):
    hardware = load_hardware(name) if kind == "hardware" else load_cluster(name).device_profile()
    text = (CONFIGS_DIR / kind / f"{name}.yaml").read_text()
    in_block = False
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        in_block = line.startswith("  ") or (line.startswith("assumed:"))
        field = line.split(":")[0].strip()
        if in_block or field in ("kind", "name", "description", "hardware"):
            continue
        assert "#" in line, f"{name}: {field} has no source comment"
        unused = "unused" in line.split("#", 1)[1]  # (a required field that one node never uses)
        if "assumption" in line.split("#", 1)[1] and field in HardwareProfile.model_fields and not unused:
            value = getattr(hardware, field)
            if isinstance(value, (int, float)) and field != "devices_per_node":
                assert field in hardware.assumed, f"{name}: {field} is an assumption without a range"
    for field, (low, high) in hardware.assumed.items():
        assert low <= getattr(hardware, field) <= high and low < high


@pytest.mark.parametrize("assumed, message", [
    ({"colour": [1, 2]}, "not a numeric hardware input"),
    ({"efficiency": [0.5, 0.6]}, "must be positive and hold the profile's efficiency"),
    ({"efficiency": 0.4}, "give [low, high]"),
    ({"inter_node_bus_bytes_per_s": ["10GB/s", "fast"]}, "assumed.inter_node_bus_bytes_per_s"),
])
def test_bad_assumed_ranges_are_config_errors(assumed, message):
    data = load_hardware("h100-80gb").model_dump()
    data["assumed"] = assumed
    with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
        HardwareProfile.model_validate(data)


def test_assumed_sizes_accept_size_strings():
    data = load_hardware("h100-80gb").model_dump()
    data["assumed"] = {"inter_node_bus_bytes_per_s": ["30GB/s", "50GB/s"], "host_memory_bytes": ["1TB", "4TB"]}
    assert HardwareProfile.model_validate(data).assumed["host_memory_bytes"] == (1e12, 4e12)


# ---- ranges ------------------------------------------------------------------------------------------------
def test_sweep_reports_the_range_the_input_that_moves_most_and_the_joint_corners():
    inputs = [AssumedInput("a", 1.0, 0.5, 2.0), AssumedInput("b", 10.0, 5.0, 25.0), AssumedInput("c", 1.0, 0.0, 2.0)]
    calls = []

    def figures(over):
        calls.append(dict(over))
        a, b, c = (over.get(k, v) for k, v in (("a", 1.0), ("b", 10.0), ("c", 1.0)))
        return {"sum": a + b / 10, "never": None, "flat": 3.0 + 0 * c}

    out = sweep(figures, inputs)
    s = out["sum"]
    assert s.value == 2.0 and s.most == "b" and s.swing == pytest.approx(2.0)
    assert (s.low, s.high) == (pytest.approx(1.0), pytest.approx(4.5))  # both at their extremes together
    assert s.high_at == {"a": 2.0, "b": 25.0} and s.low_at == {"a": 0.5, "b": 5.0}
    assert out["never"].low is None and not out["never"].holds(0.0)
    assert out["flat"].most is None and out["flat"].low == out["flat"].high == 3.0
    assert len(calls) == 1 + 2 * 3 + 2  # base, each input at both ends, two corners for the one figure that moves


def test_with_inputs_leaves_other_names_to_the_caller():
    h = load_hardware("ascend-910b")
    before = h.efficiency
    varied = with_inputs(h, {"efficiency": 0.6, "host_memory_bytes": 5.12e11, "global_batch_size": 16})
    assert varied.efficiency == 0.6 and varied.host_memory_bytes == 512 * GB and isinstance(varied.host_memory_bytes, int)
    assert h.efficiency == before != 0.6


def test_sensitivity_ranges_match_searches_at_the_ends():
    llama, hardware = load_model("llama2-7b"), load_hardware("h100-80gb")
    setup = TrainingSetup(global_batch_size=64, seq_length=16384)
    space = SearchSpace(tp=(1, 2), pp=(1, 2), vpp=(1,), micro_batch=(1,))
    out = sensitivity_of_search(llama, hardware, setup, 8, space)
    spread = out.ranges["best plan iteration s"]
    assert spread.most in hardware.assumed and spread.most != "inter_node_bus_bytes_per_s"  # (unused by one node)
    ends = []
    for name, (low, high) in hardware.assumed.items():
        times = [search(llama, hardware.model_copy(update={name: v}), setup, 8, space).best.iteration_s
                 for v in (low, high)]
        ends += times
        if name == spread.most:
            assert spread.swing == pytest.approx(abs(times[1] - times[0]))
        else:
            assert abs(times[1] - times[0]) <= spread.swing
    assert spread.low <= min(ends) and max(ends) <= spread.high  # (the corners may go further)
    assert spread.low < spread.value < spread.high


def test_cli_sensitivity_prints_ranges_and_writes_them_to_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["--hardware", "h100-80gb", "--seq", "16384", "--tp", "1,2", "--pp", "1,2", "--vpp", "1",
            "--micro-batch", "1", "--sensitivity", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    low, high = load_hardware("h100-80gb").assumed["efficiency"]
    assert f"sensitivity over the assumed inputs of h100-80gb (efficiency {low:g} to {high:g}" in " ".join(out.split())
    assert "moved most by" in out and max(len(line) for line in out.splitlines()) <= 120
    data = json.loads(path.read_text())["sensitivity"]
    assert data["hardware"] == "h100-80gb" and "swap plan vs best recomputation plan" in data["ranges"]
