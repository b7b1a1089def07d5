"""Clusters as data (configs/clusters, ``chameleon-plan --cluster``) and the host RAM per node that the
ranks of a node share, which bounds the swap plans."""

import json

import pytest

from chameleon_dist.cli import plan
from chameleon_dist.config import ConfigError
from chameleon_dist.planner import Layout, load_hardware, load_model
from chameleon_dist.planner.cluster import ClusterProfile, load_cluster
from chameleon_dist.planner.host_memory import (
    node_budget_bytes,
    node_host_use,
    node_stage_ranks,
    stage_host_budget_bytes,
)
from chameleon_dist.planner.profiles import load_profile, make_setup, shipped_names
from chameleon_dist.planner.search import FEASIBLE, OUT_OF_MEMORY, SearchSpace, evaluate, search

GB = 10**9
CLUSTER = """kind: cluster
name: {name}
hardware: {hardware}
nodes: {nodes}
devices_per_node: {per_node}
intra_node_bus_bytes_per_s: 150GB/s
inter_node_bus_bytes_per_s: {inter}
host_memory_bytes: {host}
"""


def _cluster_file(tmp_path, name="test-cluster", hardware="ascend-910b", nodes=2, per_node=8, inter="20GB/s",
                  host="1TB", extra=""):
    path = tmp_path / f"{name}.yaml"
    path.write_text(CLUSTER.format(name=name, hardware=hardware, nodes=nodes, per_node=per_node, inter=inter,
                                   host=host) + extra)
    return path


# ---- the profiles ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", shipped_names("cluster"))
def test_every_shipped_cluster_loads_with_nodes_times_devices(name):
    cluster = load_cluster(name)
    assert isinstance(cluster, ClusterProfile) and cluster.name == name
    assert cluster.world_size == cluster.nodes * cluster.devices_per_node
    device = cluster.device_profile()
    accelerator = load_hardware(cluster.hardware)
    assert device.name == accelerator.name and device.memory_bytes == accelerator.memory_bytes
    assert device.devices_per_node == cluster.devices_per_node
    assert device.host_memory_bytes == cluster.host_memory_bytes
    assert device.inter_node_bus_bytes_per_s == cluster.inter_node_bus_bytes_per_s
    assert device.h2d_bytes_per_s == (cluster.h2d_bytes_per_s or accelerator.h2d_bytes_per_s)


def test_the_papers_testbed_and_the_asked_for_clusters_ship():
    sizes = {name: load_cluster(name).world_size for name in shipped_names("cluster")}
    assert sizes["ascend-910b-8x8"] == 64 and sizes["ascend-910b-1x8"] == 8 and sizes["dgx-h100-8x8"] == 64
    assert load_cluster("gh200-16x4").device_profile().devices_per_node == 4
    assert load_cluster("dgx-a100-1x8").nodes == 1


def test_a_cluster_file_is_a_planner_profile_and_its_hardware_path_is_relative_to_it(tmp_path):
    (tmp_path / "hw").mkdir()
    accelerator = load_hardware("h100-80gb").model_dump()
    accelerator.update(name="my-gpu", memory_bytes=40 * GB)
    (tmp_path / "hw" / "my-gpu.json").write_text(json.dumps(accelerator))
    path = _cluster_file(tmp_path, hardware="hw/my-gpu.json", extra="h2d_bytes_per_s: 5GB/s\n")
    assert isinstance(load_profile(path), ClusterProfile)
    device = load_cluster(path).device_profile()
    assert device.name == "my-gpu" and device.memory_bytes == 40 * GB
    # a cluster's slower host link also caps the accelerator's rate while both directions copy
    assert device.h2d_bytes_per_s == 5e9 and device.swap_h2d_bytes_per_s <= 5e9


# ---- the CLI ---------------------------------------------------------------------------------------
def _json(capsys, argv):
    code = plan.main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


ONE_LAYOUT = ["--model", "llama2-7b", "--seq", "4096", "--global-batch", "64", "--tp", "8", "--pp", "1",
              "--vpp", "1", "--micro-batch", "1", "--recompute", "none", "--no-swap"]


def test_cluster_sets_the_world_size_and_the_node_values(capsys, tmp_path):
    code, data = _json(capsys, ["--cluster", "dgx-a100-1x8", "--no-swap", "--recompute", "none"])
    assert code == 0 and data["devices"] == 8 and data["cluster"]["name"] == "dgx-a100-1x8"
    assert data["hardware"]["name"] == "a100-80gb" and data["hardware"]["host_memory_bytes"] == 2 * 10**12
    fast = _cluster_file(tmp_path, name="fast", inter="40GB/s")
    slow = _cluster_file(tmp_path, name="slow", inter="10GB/s", host="512GB")
    code_fast, on_fast = _json(capsys, ["--cluster", str(fast)] + ONE_LAYOUT)
    code_slow, on_slow = _json(capsys, ["--cluster", str(slow)] + ONE_LAYOUT)
    assert code_fast == code_slow == 0 and on_fast["devices"] == on_slow["devices"] == 16
    assert on_slow["hardware"]["host_memory_bytes"] == 512 * GB
    # TP8 fills a node, so DP2 reduces across the two nodes: at a quarter of the bandwidth, four times as long
    dp_fast, dp_slow = on_fast["best"]["time"]["dp_comm_s"], on_slow["best"]["time"]["dp_comm_s"]
    assert dp_fast > 0 and dp_slow == pytest.approx(4 * dp_fast)
    assert on_fast["best"]["time"]["tp_comm_s"] == pytest.approx(on_slow["best"]["time"]["tp_comm_s"])
    assert on_slow["best"]["iteration_s"] > on_fast["best"]["iteration_s"]


def test_a_sub_cluster_of_whole_nodes_or_of_one_node(capsys):
    for devices in ("16", "4"):
        code, data = _json(capsys, ["--cluster", "ascend-910b-8x8", "--devices", devices, "--no-swap",
                                    "--recompute", "none"])
        assert code == 0 and data["devices"] == int(devices)


def test_the_header_names_the_cluster_and_the_default_run_has_none(capsys):
    assert plan.main(["--cluster", "ascend-910b-1x8", "--no-swap", "--recompute", "none"]) == 0
    header = capsys.readouterr().out.split("\ntraining:")[0]
    assert "on 8 x ascend-910b" in header and "cluster ascend-910b-1x8" in " ".join(header.split())
    code, data = _json(capsys, ["--no-swap", "--recompute", "none"])
    assert code == 0 and data["cluster"] is None and data["devices"] == 8
    assert plan.main(["--no-swap", "--recompute", "none"]) == 0
    assert "cluster" not in capsys.readouterr().out.split("\ntraining:")[0]


@pytest.mark.parametrize("argv, words", [
    (["--cluster", "dgx-h100-8x9"], ["--cluster", "did you mean 'dgx-h100-8x8'"]),
    (["--cluster", "dgx-h100-8x8", "--hardware", "h100-80gb"], ["--hardware h100-80gb", "--cluster dgx-h100-8x8"]),
    (["--cluster", "dgx-h100-8x8", "--devices", "72"], ["--devices 72", "at most 64"]),
    (["--cluster", "dgx-h100-8x8", "--devices", "12"], ["--devices 12", "whole nodes"]),
    (["--cluster", "configs/hardware/h100-80gb.yaml"], ["a hardware profile, expected a cluster profile"]),
])
def test_bad_cluster_arguments_are_errors_naming_the_option(capsys, argv, words):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_bad_cluster_files_name_the_field(capsys, tmp_path):
    missing = tmp_path / "missing.yaml"
    missing.write_text("kind: cluster\nname: missing\nhardware: ascend-910b\ndevices_per_node: 8\n"
                       "intra_node_bus_bytes_per_s: 150GB/s\ninter_node_bus_bytes_per_s: 20GB/s\n")
    assert plan.main(["--cluster", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "nodes" in err and "host_memory_bytes" in err
    unknown = _cluster_file(tmp_path, name="unknown", hardware="ascend-910c")
    with pytest.raises(ConfigError, match="hardware: no hardware profile 'ascend-910c'; did you mean 'ascend-910b'"):
        load_cluster(unknown)
    extra = _cluster_file(tmp_path, name="extra", extra="gpus_per_node: 8\n")
    assert plan.main(["--cluster", str(extra)]) == 2
    assert "gpus_per_node" in capsys.readouterr().err
    zero = _cluster_file(tmp_path, name="zero", nodes=0)
    with pytest.raises(ConfigError, match="nodes"):
        load_cluster(zero)


# ---- host RAM per node -----------------------------------------------------------------------------
def test_ranks_of_a_node_in_megatron_order():
    # TP2 DP2: 4 ranks per stage, two stages per node of 8
    assert node_stage_ranks(Layout(tp=2, pp=4, dp=2), 8) == [{0: 4, 1: 4}, {2: 4, 3: 4}]
    # 3 ranks per stage do not divide a node: stage 2 straddles nodes 0 and 1; node 1 is half used
    assert node_stage_ranks(Layout(tp=1, pp=4, dp=3), 8) == [{0: 3, 1: 3, 2: 2}, {2: 1, 3: 3}]
    # a stage wider than a node: every node holds one stage
    assert node_stage_ranks(Layout(tp=8, pp=2, dp=2), 8) == [{0: 8}, {0: 8}, {1: 8}, {1: 8}]


def test_the_node_sum_adds_the_ranks_of_every_stage_on_the_node():
    hardware = load_hardware("ascend-910b").model_copy(update={"host_memory_bytes": 100 * GB, "host_swap_fraction": 1.0})
    per_rank = {0: 10 * GB, 1: 3 * GB, 2: 1 * GB, 3: 0}
    nodes = node_host_use(hardware, Layout(tp=1, pp=4, dp=3), per_rank.__getitem__)
    assert [n.host_bytes for n in nodes] == [(3 * 10 + 3 * 3 + 2 * 1) * GB, (1 * 1 + 3 * 0) * GB]
    assert [n.budget_bytes for n in nodes] == [100 * GB, 50 * GB]  # node 1: 4 of its 8 devices
    assert nodes[0].fits and node_budget_bytes(hardware, 8) == 100 * GB
    # each stage's ranks may share what the node allows them, not an eighth of it each
    assert stage_host_budget_bytes(hardware, Layout(tp=2, pp=4, dp=2), 1) == 25 * GB
    assert stage_host_budget_bytes(hardware, Layout(tp=8, pp=2, dp=2), 1) == hardware.host_swap_budget_bytes()
    # stage 2 has 2 ranks on node 0 (100 GB) and 1 on node 1 (50 GB): the tighter is 50 GB per rank
    assert stage_host_budget_bytes(hardware, Layout(tp=1, pp=4, dp=3), 2) == 50 * GB


MODEL, SETUP = load_model("llama2-7b"), make_setup(global_batch_size=64, seq_length=8192)
SWAP_LAYOUT = Layout(tp=1, pp=2, dp=4, vpp=4, swap=True)  # 4 ranks per stage: 2 stages share a node of 8


def _host(node_bytes, devices_per_node):
    return load_hardware("ascend-910b").model_copy(update={
        "host_memory_bytes": int(node_bytes), "host_swap_fraction": 1.0, "devices_per_node": devices_per_node})


def test_a_swap_plan_reports_its_host_bytes_per_node_and_sums_both_stages():
    plan_ = evaluate(MODEL, load_hardware("ascend-910b"), SETUP, SWAP_LAYOUT)
    assert plan_.feasible and {e.stage for e in plan_.swap} == {0, 1}
    per_rank = {e.stage: e.host_bytes for e in plan_.swap}
    assert per_rank[0] > 0 and per_rank[1] > 0
    assert [n.host_bytes for n in plan_.host_nodes] == [4 * per_rank[0] + 4 * per_rank[1]]
    data = plan_.to_dict()
    assert data["host_bytes_per_node"] == [4 * per_rank[0] + 4 * per_rank[1]]
    assert data["host_nodes"][0]["stages"] == [
        {"stage": 0, "ranks": 4, "host_bytes_per_rank": per_rank[0]},
        {"stage": 1, "ranks": 4, "host_bytes_per_rank": per_rank[1]}]


def _smallest_fitting_node_bytes(devices_per_node):
    low, high = 4 * GB, 400 * GB  # (the planner's swap estimate holds ~216 GB per shared node of 8 here)
    assert evaluate(MODEL, _host(high, devices_per_node), SETUP, SWAP_LAYOUT).feasible
    assert not evaluate(MODEL, _host(low, devices_per_node), SETUP, SWAP_LAYOUT).feasible
    while high - low > GB // 8:
        mid = (low + high) // 2
        if evaluate(MODEL, _host(mid, devices_per_node), SETUP, SWAP_LAYOUT).feasible:
            high = mid
        else:
            low = mid
    return high


def test_two_stages_in_one_node_share_its_host_ram():
    """The least host RAM per node the plan fits in when each stage has its own nodes (4 devices per node) is
    not enough when both stages share a node of 8: the node sum adds the second stage's ranks."""
    alone = _smallest_fitting_node_bytes(4)
    shared = _smallest_fitting_node_bytes(8)
    assert shared > alone
    plan_ = evaluate(MODEL, _host(alone, 8), SETUP, SWAP_LAYOUT)
    assert plan_.status == OUT_OF_MEMORY and all(e.feasible for e in plan_.swap)  # every policy fits its rank
    node = plan_.host_nodes[0]
    assert node.host_bytes > node.budget_bytes == alone
    assert node.host_bytes == sum(4 * e.host_bytes for e in plan_.swap)
    # the extra host RAM the shared node needs is about what the second stage's ranks hold
    stage1 = next(e.host_bytes for e in plan_.swap if e.stage == 1)
    assert shared - alone <= 4 * stage1 + GB // 8


SWAP_ONLY = SearchSpace(tp=(1,), pp=(2,), vpp=(4,), micro_batch=(1,), recompute=("none",), swap=(False, True),
                        cp=(1,))  # (with CP2 Llama2-7B at 8K fits without swap)


def test_too_little_host_ram_per_node_is_out_of_memory_naming_it(tmp_path):
    needed = _smallest_fitting_node_bytes(4)
    cluster = load_cluster(_cluster_file(tmp_path, name="small-host", nodes=1, host=f"{2 * needed}",
                                         extra="host_swap_fraction: 0.5\n"))  # node budget = needed
    result = search(MODEL, cluster.device_profile(), SETUP, 8, SWAP_ONLY, cluster=cluster)
    swap_plan = next(p for p in result.plans if p.layout.swap)
    assert swap_plan.status == OUT_OF_MEMORY and result.best is None
    assert "host RAM per node" in swap_plan.reason and "host_memory_bytes" in swap_plan.reason
    assert "cluster small-host" in swap_plan.reason
    roomy = load_cluster(_cluster_file(tmp_path, name="roomy", nodes=1, host="1TB"))
    result = search(MODEL, roomy.device_profile(), SETUP, 8, SWAP_ONLY, cluster=roomy)
    assert result.best is not None and result.best.layout == SWAP_LAYOUT and result.best.status == FEASIBLE


def test_a_policy_stopped_by_the_host_budget_names_host_ram_per_node(capsys, tmp_path):
    tiny = _cluster_file(tmp_path, name="tiny-host", nodes=1, host="16GB")
    argv = ["--cluster", str(tiny), "--model", "llama2-7b", "--seq", "8192", "--global-batch", "64",
            "--tp", "1", "--cp", "1", "--pp", "2", "--vpp", "4", "--micro-batch", "1", "--recompute", "none"]
    code, data = _json(capsys, argv)
    assert code == 3 and data["best"] is None
    swap_plan = next(a for a in data["alternatives"] if a["layout"]["swap"])
    assert swap_plan["status"] == OUT_OF_MEMORY
    assert "its host budget is full" in swap_plan["reason"] and "host RAM per node" in swap_plan["reason"]
    assert "host_memory_bytes 16 GB" in swap_plan["reason"] and "cluster tiny-host" in swap_plan["reason"]


def test_the_one_node_testbed_cluster_plans_as_the_default_hardware_profile(capsys):
    """ascend-910b-1x8 holds the ascend-910b profile's own node values: the same plans; the cluster's run adds
    "cluster" to the JSON and, where the host budget was full, where it comes from to the reason."""
    common = ["--model", "llama2-7b", "--seq", "8192", "--global-batch", "64"]
    _, by_cluster = _json(capsys, ["--cluster", "ascend-910b-1x8"] + common)
    _, by_default = _json(capsys, common)
    rows = [[(a["describe"], a["status"], a["iteration_s"]) for a in data["alternatives"]]
            for data in (by_cluster, by_default)]
    assert rows[0] == rows[1] and by_cluster["best"]["host_bytes_per_node"] == by_default["best"]["host_bytes_per_node"]
    marker = "; its host budget is full"
    for with_cluster, without in zip(by_cluster["alternatives"], by_default["alternatives"]):
        mine, theirs = with_cluster["reason"], without["reason"]
        assert mine == theirs or (marker in mine and mine.split(marker)[0] == theirs.removesuffix(")"))
    assert by_cluster["cluster"]["name"] == "ascend-910b-1x8" and by_default["cluster"] is None
