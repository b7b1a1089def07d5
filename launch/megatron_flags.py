"""The flags of ``launch/train_megatron.py``: Megatron-LM's names for what the launcher supports, grouped as
Megatron-LM's ``--help`` groups them (network size, mixed precision, distributed, ...), the launcher's short
forms (``--tp``, ``--pp``, ``--vpp``, ``--micro-batches``, ``--iterations``) as aliases, and the
``--chameleon-*`` group.

``parse_args`` checks everything before any process group exists: a flag the launcher does not know is refused
by name (a Megatron-LM flag it does not support, or a typo), and so is a combination it cannot run
(``--context-parallel-size > 1`` needs Transformer Engine's attention, ...). The data-parallel size comes from
``WORLD_SIZE`` (torchrun's), so ``--global-batch-size`` keeps Megatron's meaning: micro-batches per iteration =
global batch / (micro-batch size x data-parallel size).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from launch.kill_point import kill_flags
from chameleon_dist.config import add_megatron_args, parse_size_bytes

logger = logging.getLogger("train_megatron")

DESCRIPTION = "Train a megatron-core GPT (or a Llama-style model) on synthetic tokens, with Chameleon on every rank."

UNSUPPORTED: dict[str, str] = {
    "--enable-cuda-graph": "Chameleon cannot swap inside a CUDA-graph capture (its copies and releases are "
                           "decided while the iteration runs)",
    "--cuda-graph-impl": "Chameleon cannot swap inside a CUDA-graph capture",
    "--external-cuda-graph": "Chameleon cannot swap inside a CUDA-graph capture",
    "--fp8-format": "fp8 needs Transformer Engine",
    "--hidden-dropout": "dropout must be 0 here (the CPU RNG tracker does not fork RNG states)",
    "--attention-dropout": "dropout must be 0 here (the CPU RNG tracker does not fork RNG states)",
}
"""Megatron-LM flags people type that the launcher refuses on purpose, with the reason (any other unknown flag is
refused too, by name)."""


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser: Megatron-LM's flag names, in Megatron-LM's groups, then Chameleon's."""
    parser = argparse.ArgumentParser(description=DESCRIPTION, allow_abbrev=False)
    _network_flags(parser)
    _training_flags(parser)
    _precision_flags(parser)
    _distributed_flags(parser)
    _run_flags(parser)
    add_megatron_args(parser)
    return parser


def _network_flags(parser: argparse.ArgumentParser) -> None:
    """Network size: layers, widths, heads, position embeddings, normalization, MLP."""
    network = parser.add_argument_group("network size")
    network.add_argument("--num-layers", type=int, default=4)
    network.add_argument("--hidden-size", type=int, default=64)
    network.add_argument("--ffn-hidden-size", type=int, default=None,
                         help="MLP width (Megatron-LM's default: 4 x hidden size; with --swiglu 8/3 x hidden size, "
                              "rounded down to a multiple of 64).")
    network.add_argument("--num-attention-heads", type=int, default=4)
    network.add_argument("--group-query-attention", action="store_true",
                         help="Grouped-query attention with --num-query-groups key/value heads.")
    network.add_argument("--num-query-groups", type=int, default=None)
    network.add_argument("--max-position-embeddings", type=int, default=None,
                         help="Learned position embeddings' table size (default: --seq-length).")
    network.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                         default="learned_absolute")
    network.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (with --position-embedding-type rope).")
    network.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    network.add_argument("--swiglu", action="store_true", help="SwiGLU MLPs (gated linear units, SiLU).")
    network.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                         help="Accepted for Megatron-LM scripts: the launcher always unties them (no first/last "
                              "stage embedding all-reduce).")
    network.add_argument("--disable-bias-linear", action="store_true", help="No biases in the linear layers.")
    network.add_argument("--transformer-impl", type=_local_only, default="local",
                         help="local only: megatron-core's own layers (Transformer Engine's are CUDA-only).")

def _training_flags(parser: argparse.ArgumentParser) -> None:
    """Data, training (batches, iterations, Megatron's recomputation), regularization, init and learning rate."""
    data = parser.add_argument_group("data and dataloader")
    data.add_argument("--seq-length", type=int, default=128)
    data.add_argument("--vocab-size", type=int, default=128, help="Synthetic tokens' vocabulary.")
    data.add_argument("--vary-seq-length", action="store_true",
                      help="Change the sequence length every 3 iterations (full, 1/2, 3/4 of --seq-length).")
    training = parser.add_argument_group("training")
    training.add_argument("--micro-batch-size", type=int, default=4)
    training.add_argument("--global-batch-size", type=int, default=None,
                          help="Samples per iteration over all data-parallel ranks: micro-batches per iteration = "
                               "global / (micro-batch size x data-parallel size).")
    training.add_argument("--micro-batches", type=int, default=None,
                          help="Micro-batches per iteration (default 4; the launcher's short form of "
                               "--global-batch-size).")
    training.add_argument("--train-iters", "--iterations", dest="iterations", type=int, default=10)
    training.add_argument("--recompute-granularity", "--recompute", dest="recompute",
                          choices=("none", "selective", "full"), default="none",
                          help="Megatron's own activation recomputation.")
    training.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform",
                          help="With --recompute-granularity full.")
    training.add_argument("--recompute-num-layers", type=int, default=1, help="With --recompute-granularity full.")
    regularization = parser.add_argument_group("regularization")
    regularization.add_argument("--weight-decay", type=float, default=None,
                                help="Megatron's optimizer only (default 0.01, as Megatron-LM).")
    regularization.add_argument("--clip-grad", type=float, default=None,
                                help="Megatron's optimizer only: gradient-norm clip (default 1.0, as Megatron-LM).")
    init = parser.add_argument_group("initialization")
    init.add_argument("--seed", type=int, default=1234)
    learning = parser.add_argument_group("learning rate")
    learning.add_argument("--lr", type=float, default=3e-3)

def _precision_flags(parser: argparse.ArgumentParser) -> None:
    """Mixed precision and loss scaling."""
    precision = parser.add_argument_group(
        "mixed precision", "--bf16/--fp16 train through Megatron's mixed-precision optimizer (fp32 main params).")
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--loss-scale", type=float, default=None, help="Static loss scale (fp16); default: dynamic.")
    precision.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    precision.add_argument("--min-loss-scale", type=float, default=1.0)
    precision.add_argument("--loss-scale-window", type=int, default=1000)
    precision.add_argument("--hysteresis", type=int, default=2)

def _distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Tensor, pipeline, data, sequence and expert parallelism."""
    distributed = parser.add_argument_group("distributed")
    distributed.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1)
    distributed.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1)
    distributed.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                             help="Interleaved 1F1B: model chunks per stage = num layers / (pp x this).")
    distributed.add_argument("--num-virtual-stages-per-pipeline-rank", "--vpp", dest="vpp", type=int, default=None,
                             help="Model chunks per pipeline stage (interleaved 1F1B when > 1).")
    distributed.add_argument("--sequence-parallel", action="store_true",
                             help="Shard the layer norms' and dropouts' activations along the sequence (TP > 1).")
    distributed.add_argument("--context-parallel-size", type=int, default=1,
                             help="Refused above 1: megatron-core's context parallelism needs Transformer Engine.")
    distributed.add_argument("--use-distributed-optimizer", action="store_true",
                             help="Shard the optimizer's state and fp32 main params over the data-parallel ranks.")
    distributed.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
                             help="Overlap the gradients' reduction with backward (the launcher's default: on).")
    distributed.add_argument("--overlap-param-gather", action="store_true",
                             help="With --use-distributed-optimizer: all-gather parameters during the next forward.")
    distributed.add_argument("--distributed-timeout-minutes", type=float, default=None)
    distributed.add_argument("--dist-timeout-s", type=float, default=300.0,
                             help="Collective timeout: a backstop should a peer vanish without torchrun noticing.")
    moe = parser.add_argument_group("moe")
    moe.add_argument("--num-experts", type=int, default=0,
                     help="Experts per MLP (mixture of experts, token dispatcher allgather); 0: dense MLPs.")
    moe.add_argument("--moe-router-topk", type=int, default=2, help="Experts each token is routed to.")
    moe.add_argument("--expert-model-parallel-size", type=int, default=1,
                     help="Ranks the experts are split over (carved out of the data-parallel ranks).")

def _run_flags(parser: argparse.ArgumentParser) -> None:
    """This launcher's own flags: the report, and the fault and squeeze tests' ranks."""
    run = parser.add_argument_group("run (this launcher)")
    run.add_argument("--report", default=None, metavar="PATH", help="Write the JSON report here (rank 0).")
    run.add_argument("--fail-rank", type=int, default=None, metavar="RANK",
                     help="Testing: this rank raises in the forward of --fail-iteration (the job must end, not hang).")
    run.add_argument("--fail-iteration", type=int, default=2)
    run.add_argument("--squeeze-rank", type=int, default=None, metavar="RANK",
                     help="Testing: another tenant takes --squeeze-bytes of this rank's device memory in the first "
                          "forward step of --squeeze-iteration and holds it to the iteration's end (relief inside "
                          "the op must absorb it: the job goes on).")
    run.add_argument("--squeeze-iteration", type=int, default=2)
    run.add_argument("--squeeze-bytes", type=parse_size_bytes, default=0, metavar="SIZE")
    kill_flags(run)

def _local_only(value: str) -> str:
    if value != "local":
        raise argparse.ArgumentTypeError(f"{value!r} is not supported: only 'local' (megatron-core's own layers) runs "
                                         "here; Transformer Engine is CUDA-only and not used by this launcher")
    return value


def _unknown(extra: list[str]) -> str:
    flags = [item.split("=", 1)[0] for item in extra if item.startswith("-")]
    words = [item for item in extra if not item.startswith("-")]
    parts = []
    known = [f"{flag} ({UNSUPPORTED[flag]})" for flag in flags if flag in UNSUPPORTED]
    other = [flag for flag in flags if flag not in UNSUPPORTED]
    if known:
        parts.append("unsupported Megatron-LM flags: " + ", ".join(known))
    if other:
        parts.append("unknown or unsupported flags: " + ", ".join(other) + " (the flags it supports are in --help)")
    if words and not flags:
        parts.append("unexpected arguments: " + " ".join(words))
    return "; ".join(parts)


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """The launcher's arguments, checked and completed (``vpp``, ``micro_batches``, ``global_batch_size``, ``dp``
    filled in). ``world_size``: the job's (default ``WORLD_SIZE``, 1 without torchrun). Exits with a message
    naming every problem."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    problems = [_unknown(extra)] if extra else []
    args.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    problems += _complete(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def _complete(args: argparse.Namespace) -> list[str]:
    """Derive what Megatron-LM derives from the flags; return every problem."""
    problems = []
    if args.distributed_timeout_minutes is not None:
        args.dist_timeout_s = 60.0 * args.distributed_timeout_minutes
    for name in ("tp", "pp", "micro_batch_size", "num_layers", "iterations", "context_parallel_size",
                 "expert_model_parallel_size", "recompute_num_layers"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if problems:
        return problems
    if args.context_parallel_size > 1:
        problems.append("--context-parallel-size > 1 is not supported: megatron-core's context parallelism runs only "
                        "in Transformer Engine's attention (its local DotProductAttention refuses it), which is "
                        "CUDA-only; use --context-parallel-size 1")
    model_parallel = args.tp * args.pp * args.context_parallel_size
    if args.world_size % model_parallel:
        problems.append(f"the world size {args.world_size} is not divisible by --tensor-model-parallel-size x "
                        f"--pipeline-model-parallel-size x --context-parallel-size = {model_parallel}")
        return problems
    args.dp = args.world_size // model_parallel
    if args.ffn_hidden_size is None:  # Megatron-LM's defaults
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.ffn_hidden_size < 1 or args.ffn_hidden_size % args.tp:
        problems.append(f"--ffn-hidden-size {args.ffn_hidden_size} must be >= 1 and divisible by "
                        f"--tensor-model-parallel-size {args.tp}")
    problems += _virtual_stages(args)
    problems += _batches(args)
    if args.sequence_parallel and args.tp == 1:
        logger.warning("--sequence-parallel has no effect with --tensor-model-parallel-size 1: turned off (as in "
                       "Megatron-LM)")
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % args.tp:
        problems.append(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                        f"--tensor-model-parallel-size {args.tp}")
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 exclude each other: give one")
    if args.loss_scale is not None and not args.fp16:
        problems.append("--loss-scale is for --fp16")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        problems.append("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    args.megatron_optimizer = bool(args.use_distributed_optimizer or args.bf16 or args.fp16)
    for flag in ("weight_decay", "clip_grad"):
        if getattr(args, flag) is not None and not args.megatron_optimizer:
            problems.append(f"--{flag.replace('_', '-')} applies to Megatron's optimizer only: add "
                            "--use-distributed-optimizer, --bf16 or --fp16 (without them the launcher trains "
                            "with torch Adam)")
    problems += _attention(args)
    problems += _experts(args)
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        problems.append(f"--max-position-embeddings {args.max_position_embeddings} must be >= --seq-length "
                        f"{args.seq_length}")
    return problems


def _virtual_stages(args: argparse.Namespace) -> list[str]:
    problems = []
    per_stage, given = args.num_layers_per_virtual_pipeline_stage, args.vpp
    args.vpp = 1 if given is None else given
    if per_stage is not None:
        if per_stage < 1 or args.num_layers % (args.pp * per_stage):
            return [f"--num-layers {args.num_layers} must be divisible by --pipeline-model-parallel-size x "
                    f"--num-layers-per-virtual-pipeline-stage = {args.pp} x {per_stage}"]
        vpp = args.num_layers // (args.pp * per_stage)
        if given is not None and given != vpp:
            return [f"--num-layers-per-virtual-pipeline-stage {per_stage} means {vpp} model chunks per stage, "
                    f"not --vpp {given}: give one of them"]
        args.vpp = vpp
    if args.vpp < 1:
        return ["--vpp must be >= 1"]
    if args.vpp > 1 and args.pp < 2:
        problems.append("--vpp > 1 needs --pp >= 2 (interleaving splits pipeline stages)")
    if args.num_layers % (args.pp * args.vpp):
        problems.append(f"--num-layers {args.num_layers} must be divisible by --pp x --vpp = {args.pp * args.vpp}")
    return problems


def _batches(args: argparse.Namespace) -> list[str]:
    per_step = args.micro_batch_size * args.dp
    if args.global_batch_size is not None:
        if args.global_batch_size < 1 or args.global_batch_size % per_step:
            return [f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size x "
                    f"data-parallel size = {args.micro_batch_size} x {args.dp}"]
        micro_batches = args.global_batch_size // per_step
        if args.micro_batches is not None and args.micro_batches != micro_batches:
            return [f"--global-batch-size {args.global_batch_size} means {micro_batches} micro-batches per "
                    f"iteration, not --micro-batches {args.micro_batches}: give one of them"]
        args.micro_batches = micro_batches
    args.micro_batches = 4 if args.micro_batches is None else args.micro_batches
    if args.micro_batches < 1:
        return ["--micro-batches must be >= 1"]
    args.global_batch_size = args.micro_batches * per_step
    if args.vpp > 1 and args.micro_batches % args.pp:
        return [f"interleaving needs --micro-batches divisible by --pp ({args.micro_batches} % {args.pp})"]
    return []


def _attention(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.hidden_size % args.num_attention_heads:
        problems.append(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
                        f"{args.num_attention_heads}")
    if args.num_attention_heads % args.tp:
        problems.append(f"--num-attention-heads {args.num_attention_heads} must be divisible by "
                        f"--tensor-model-parallel-size {args.tp}")
    if args.num_query_groups is not None and not args.group_query_attention:
        problems.append("--num-query-groups needs --group-query-attention")
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups is None or groups < 1 or args.num_attention_heads % groups:
            problems.append(f"--group-query-attention needs --num-query-groups dividing --num-attention-heads "
                            f"{args.num_attention_heads}")
        elif groups % args.tp:
            problems.append(f"--num-query-groups {groups} must be divisible by --tensor-model-parallel-size {args.tp}")
    return problems


def _experts(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.num_experts < 0 or (args.num_experts and not 1 <= args.moe_router_topk <= args.num_experts):
        problems.append(f"--num-experts {args.num_experts} must be >= 0 and --moe-router-topk {args.moe_router_topk} "
                        "between 1 and --num-experts")
    ep = args.expert_model_parallel_size
    if ep > 1:
        if not args.num_experts or args.num_experts % ep:
            problems.append(f"--expert-model-parallel-size {ep} needs --num-experts divisible by it")
        if args.dp % ep:
            problems.append(f"--expert-model-parallel-size {ep} must divide the data-parallel size {args.dp}")
    return problems


def layout_of(args: argparse.Namespace, coordinates: Any) -> dict[str, Any]:
    """The report's ``layout``: the parallel layout, the model and every feature in use."""
    return {
        "tp": args.tp, "pp": args.pp, "vpp": args.vpp, "dp": coordinates.dp_size, "world_size": coordinates.world_size,
        "context_parallel_size": args.context_parallel_size, "expert_model_parallel_size": args.expert_model_parallel_size,
        "micro_batches": args.micro_batches, "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size, "recompute": args.recompute,
        "recompute_method": args.recompute_method if args.recompute == "full" else None,
        "recompute_num_layers": args.recompute_num_layers if args.recompute == "full" else None,
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "ffn_hidden_size": args.ffn_hidden_size,
        "num_attention_heads": args.num_attention_heads, "num_query_groups": args.num_query_groups,
        "seq_length": args.seq_length, "vocab_size": args.vocab_size, "vary_seq_length": args.vary_seq_length,
        "position_embedding_type": args.position_embedding_type, "normalization": args.normalization,
        "swiglu": args.swiglu, "add_bias_linear": not args.disable_bias_linear,
        "untie_embeddings_and_output_weights": True,
        "num_experts": args.num_experts, "moe_router_topk": args.moe_router_topk if args.num_experts else None,
        "sequence_parallel": args.sequence_parallel, "use_distributed_optimizer": args.use_distributed_optimizer,
        "overlap_grad_reduce": args.overlap_grad_reduce, "overlap_param_gather": args.overlap_param_gather,
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        "optimizer": "megatron" if args.megatron_optimizer else "torch-adam",
        "iterations": args.iterations, "seed": args.seed,
    }
