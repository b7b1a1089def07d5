"""``launch/train_megatron.py``'s flags (``launch/megatron_flags.py``): Megatron-LM's names with the launcher's short
forms as aliases, Megatron's meaning for the derived sizes, every unsupported flag or combination refused by name
before any process group exists, ``--help`` grouped as Megatron-LM groups it, and the report's ``layout``. Parsing
only: no ranks, no model."""

from __future__ import annotations

import types

import pytest

from launch import megatron_flags
from launch.megatron_flags import build_parser, layout_of, parse_args


def _error(capsys, argv, world_size=1) -> str:
    with pytest.raises(SystemExit) as raised:
        parse_args(argv, world_size=world_size)
    assert raised.value.code == 2
    return capsys.readouterr().err


def test_megatron_names_and_the_short_forms_are_the_same_settings():
    long = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--num-virtual-stages-per-pipeline-rank", "2", "--train-iters", "7",
                       "--recompute-granularity", "full"], world_size=4)
    short = parse_args(["--tp", "2", "--pp", "2", "--vpp", "2", "--iterations", "7", "--recompute", "full"], world_size=4)
    assert vars(long) == vars(short)
    assert (long.tp, long.pp, long.vpp, long.iterations, long.recompute, long.dp) == (2, 2, 2, 7, "full", 1)


def test_layers_per_virtual_stage_has_megatrons_meaning():
    args = parse_args(["--pp", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"], world_size=2)
    assert args.vpp == 2  # 8 layers / (2 stages x 2 layers per virtual stage)
    assert parse_args(["--pp", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "4"],
                      world_size=2).vpp == 1


def test_global_batch_size_sets_the_micro_batches_per_data_parallel_rank():
    args = parse_args(["--tp", "2", "--micro-batch-size", "2", "--global-batch-size", "16"], world_size=8)
    assert (args.dp, args.micro_batches, args.global_batch_size) == (4, 2, 16)
    defaults = parse_args([], world_size=2)
    assert (defaults.micro_batches, defaults.global_batch_size) == (4, 4 * 4 * 2)  # --micro-batches' default of 4


@pytest.mark.parametrize("argv, names", [
    (["--global-batch-size", "10", "--micro-batch-size", "4"], ["--global-batch-size", "--micro-batch-size"]),
    (["--global-batch-size", "16", "--micro-batch-size", "4", "--micro-batches", "3"], ["--micro-batches"]),
    (["--pp", "2", "--num-layers", "6", "--num-layers-per-virtual-pipeline-stage", "2"],
     ["--num-layers-per-virtual-pipeline-stage"]),
    (["--pp", "2", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2", "--vpp", "4"], ["--vpp"]),
    (["--tp", "3"], ["--tensor-model-parallel-size"]),
    (["--bf16", "--fp16"], ["--bf16", "--fp16"]),
    (["--loss-scale", "128"], ["--loss-scale", "--fp16"]),
    (["--overlap-param-gather"], ["--overlap-param-gather", "--use-distributed-optimizer"]),
    (["--clip-grad", "1.0"], ["--clip-grad", "--use-distributed-optimizer"]),
    (["--group-query-attention", "--num-query-groups", "3"], ["--num-query-groups"]),
    (["--num-query-groups", "2"], ["--group-query-attention"]),
    (["--tp", "2", "--group-query-attention", "--num-query-groups", "1"], ["--num-query-groups",
                                                                           "--tensor-model-parallel-size"]),
    (["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "--num-experts"]),
    (["--expert-model-parallel-size", "2", "--num-experts", "4", "--tp", "2"], ["--expert-model-parallel-size",
                                                                                 "data-parallel size 1"]),
    (["--tp", "2", "--sequence-parallel", "--seq-length", "33"], ["--sequence-parallel", "--seq-length"]),
    (["--max-position-embeddings", "64"], ["--max-position-embeddings", "--seq-length"]),
])
def test_combinations_it_cannot_run_are_refused_naming_the_flags(capsys, argv, names):
    message = _error(capsys, argv, world_size=2)
    assert all(name in message for name in names), message


def test_context_parallelism_is_refused_before_any_process_group(capsys, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a process group was started"))
    message = _error(capsys, ["--context-parallel-size", "2"], world_size=2)
    assert "--context-parallel-size" in message and "Transformer Engine" in message, message


def test_unknown_and_unsupported_megatron_flags_are_named_all_at_once(capsys):
    message = _error(capsys, ["--tp", "1", "--use-flash-attn", "--fp8-format", "hybrid", "--enable-cuda-graph",
                              "--rotary-percent=0.5"])
    for flag in ("--use-flash-attn", "--fp8-format", "--enable-cuda-graph", "--rotary-percent"):
        assert flag in message, message
    assert "CUDA-graph" in message and "Transformer Engine" in message, message
    assert "hybrid" not in message  # a flag's value is not named as a flag
    assert parse_args(["--transformer-impl", "local"]).transformer_impl == "local"
    message = _error(capsys, ["--transformer-impl", "transformer_engine"])
    assert "--transformer-impl" in message and "Transformer Engine is CUDA-only" in message, message


def test_sequence_parallel_without_tensor_parallelism_is_turned_off_as_megatron_does():
    assert parse_args(["--sequence-parallel"], world_size=1).sequence_parallel is False
    assert parse_args(["--tp", "2", "--sequence-parallel"], world_size=2).sequence_parallel is True


def test_megatron_defaults_for_derived_sizes_and_the_optimizer():
    assert parse_args([]).ffn_hidden_size == 4 * 64
    assert parse_args(["--swiglu", "--hidden-size", "96"]).ffn_hidden_size == 256  # 8/3 x 96, down to a multiple of 64
    assert parse_args(["--distributed-timeout-minutes", "2"]).dist_timeout_s == 120.0
    assert not parse_args([]).megatron_optimizer  # torch Adam, the launcher's first path
    for flag in ("--use-distributed-optimizer", "--bf16", "--fp16"):
        assert parse_args([flag]).megatron_optimizer
    assert parse_args([]).overlap_grad_reduce and not parse_args(["--no-overlap-grad-reduce"]).overlap_grad_reduce


def test_world_size_comes_from_torchruns_environment(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_args(["--tp", "2"]).dp == 2
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "world size 3" in _error(capsys, ["--tp", "2"], world_size=None)


def test_help_groups_the_flags_as_megatron_lm_does():
    groups = {group.title: {o for action in group._group_actions for o in action.option_strings}
              for group in build_parser()._action_groups}
    assert {"--num-layers", "--hidden-size", "--normalization", "--swiglu", "--group-query-attention",
            "--position-embedding-type", "--untie-embeddings-and-output-weights"} <= groups["network size"]
    assert {"--micro-batch-size", "--global-batch-size", "--train-iters", "--recompute-granularity"} <= groups["training"]
    assert {"--bf16", "--fp16", "--initial-loss-scale", "--loss-scale-window", "--hysteresis"} <= groups["mixed precision"]
    assert {"--tensor-model-parallel-size", "--tp", "--pipeline-model-parallel-size", "--pp", "--sequence-parallel",
            "--context-parallel-size", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--overlap-param-gather", "--num-layers-per-virtual-pipeline-stage"} <= groups["distributed"]
    assert {"--num-experts", "--expert-model-parallel-size", "--moe-router-topk"} <= groups["moe"]
    assert {"--seq-length", "--vocab-size"} <= groups["data and dataloader"]
    assert "--chameleon-device-capacity" in groups["chameleon"]
    text = build_parser().format_help()
    assert text.index("network size:") < text.index("mixed precision:") < text.index("distributed:")


def test_the_layout_records_every_feature_in_use():
    args = parse_args(["--tp", "2", "--sequence-parallel", "--use-distributed-optimizer", "--overlap-param-gather",
                       "--bf16", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                       "--group-query-attention", "--num-query-groups", "2", "--num-experts", "4",
                       "--expert-model-parallel-size", "2"], world_size=4)
    layout = layout_of(args, types.SimpleNamespace(dp_size=2, world_size=4))
    assert {k: layout[k] for k in ("sequence_parallel", "use_distributed_optimizer", "overlap_grad_reduce",
                                   "overlap_param_gather", "precision", "normalization", "swiglu",
                                   "position_embedding_type", "num_query_groups", "expert_model_parallel_size",
                                   "context_parallel_size", "num_experts", "optimizer", "dp")} == {
        "sequence_parallel": True, "use_distributed_optimizer": True, "overlap_grad_reduce": True,
        "overlap_param_gather": True, "precision": "bf16", "normalization": "RMSNorm", "swiglu": True,
        "position_embedding_type": "rope", "num_query_groups": 2, "expert_model_parallel_size": 2,
        "context_parallel_size": 1, "num_experts": 4, "optimizer": "megatron", "dp": 2}
    assert set(megatron_flags.layout_of(parse_args([]), types.SimpleNamespace(dp_size=1, world_size=1))) == set(layout)
