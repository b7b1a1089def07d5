"""Train a megatron-core GPT (or a Llama-style model) on synthetic tokens under tensor (with sequence), pipeline
(optionally interleaved), data and expert parallelism, in fp32, bf16 or fp16, with Chameleon installed on every
rank. Start it with torchrun::

    torchrun --nproc-per-node 4 -m launch.train_megatron --tp 2 --pp 2 --iterations 10 \\
        --chameleon-device-capacity 40MB --report runs/megatron_tp2pp2.json

Its flags are Megatron-LM's (``launch/megatron_flags.py``: ``--tensor-model-parallel-size``, ``--sequence-parallel``,
``--use-distributed-optimizer``, ``--bf16``, ...; the short forms ``--tp``, ``--pp``, ``--vpp``, ``--micro-batches``
too). ``--bf16``, ``--fp16`` and ``--use-distributed-optimizer`` train through Megatron's optimizer; otherwise torch
Adam steps the fp32 parameters.

On a machine without CUDA it uses gloo, the opt-in CPU shims and one emulated device per rank (sized by
``--chameleon-device-capacity``); with CUDA, the rank's GPU, NCCL and the real device (gloo when ranks share
a GPU: ``launch/cuda_ranks.py``). ``--no-chameleon`` still meters every
rank (nothing is swapped, out of memory at the emulated capacity), so its report gives each rank's
unswapped peak. Rank 0 prints one line per iteration and writes the ``--report`` JSON (launch/rank_report.py).
Megatron stays the distributed engine: its own schedule, DDP and collectives run the job.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import logging
import os
import sys
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

from launch import megatron_flags
from launch.cuda_ranks import rank_cuda_setup
from launch.kill_point import KillPoint
from launch.rank_report import RankRecord, gather, launcher_setup, params_sha256, schedule_of, write_report

from chameleon_dist.config import config_from_megatron_args
from chameleon_dist.models import TransformerShape
from chameleon_dist.units import format_bytes

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from chameleon_dist.integrations.megatron import build_gpt, megatron_cpu_session, synthetic_batch  # noqa: E402
    from chameleon_dist.integrations.megatron.install import install  # noqa: E402
    # torch.use_deterministic_algorithms (main) imports torch._inductor: ~2.5 s in every rank unless imported
    # here, once (tests fork ranks from one process that imported this module)
    import torch._inductor  # noqa: E402,F401

logger = logging.getLogger("train_megatron")

CPU_DEFAULT_CAPACITY = "8GB"
"""The emulated device's capacity when neither --chameleon-device-capacity nor a config file gives one."""

CPU_DEFAULT_MIN_SWAP = "16KiB"
"""``min_swap_bytes`` on CPU when neither --chameleon-min-swap-bytes nor a config file gives one: the toy
model's activations are tens of KiB, below the 1 MiB default meant for real models."""


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """The launcher's flags (``launch/megatron_flags.py``: Megatron-LM's names, checked before any process group)."""
    return megatron_flags.parse_args(argv, world_size)


def seq_length_at(args: argparse.Namespace, iteration: int) -> int:
    if not args.vary_seq_length:
        return args.seq_length
    fraction = (1.0, 0.5, 0.75)[(iteration // 3) % 3]
    return max(8, int(args.seq_length * fraction) // 8 * 8)


@contextlib.contextmanager
def session(args: argparse.Namespace) -> Iterator[bool]:
    """Process group and Megatron's model-parallel state; yields whether this is a CPU run."""
    timeout = datetime.timedelta(seconds=args.dist_timeout_s)
    vpp = args.vpp if args.vpp > 1 else None
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group("gloo", init_method="env://", timeout=timeout)
        with megatron_cpu_session(args.seed, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                      virtual_pipeline_model_parallel_size=vpp,
                                      expert_model_parallel_size=args.expert_model_parallel_size):
            yield True
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    from megatron.core import tensor_parallel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, as use_deterministic_algorithms needs
    index, backend = rank_cuda_setup(torch.cuda.device_count())
    torch.cuda.set_device(index)
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    parallel_state.initialize_model_parallel(args.tp, args.pp, virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=args.expert_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    try:
        yield False
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def config_overrides(args: argparse.Namespace, on_cpu: bool) -> dict[str, Any]:
    """The TransformerConfig fields the flags set (beyond ``gpt.transformer_config``'s CPU-safe defaults)."""
    overrides: dict[str, Any] = {}
    if args.recompute == "full":
        overrides = {"recompute_granularity": "full", "recompute_method": args.recompute_method,
                     "recompute_num_layers": args.recompute_num_layers}
    elif args.recompute == "selective":
        overrides = {"recompute_granularity": "selective"}
    if not on_cpu:
        overrides.update(use_cpu_initialization=False)
    if args.num_experts:
        overrides.update(num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                         moe_router_pre_softmax=args.moe_router_topk == 1)  # Megatron requires it for top-1
    if args.sequence_parallel:
        overrides.update(sequence_parallel=True)
    if args.bf16 or args.fp16:
        dtype = torch.bfloat16 if args.bf16 else torch.float16
        overrides.update(bf16=args.bf16, fp16=args.fp16, params_dtype=dtype, pipeline_dtype=dtype)
    if args.normalization != "LayerNorm":
        overrides.update(normalization=args.normalization)
    if args.swiglu:
        overrides.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if args.group_query_attention:
        overrides.update(num_query_groups=args.num_query_groups)
    if args.disable_bias_linear:
        overrides.update(add_bias_linear=False)
    return overrides


def build_chunks(args: argparse.Namespace, shape: TransformerShape, on_cpu: bool) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage), each in Megatron's DistributedDataParallel (and in its
    Float16Module under --bf16/--fp16)."""
    overrides = config_overrides(args, on_cpu)
    gpt_kwargs: dict[str, Any] = {"share_embeddings_and_output_weights": False,
                                  "position_embedding_type": args.position_embedding_type}
    if args.position_embedding_type == "rope":
        gpt_kwargs.update(rotary_base=args.rotary_base)
    stages = [None] if args.vpp == 1 else list(range(args.vpp))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for vp_stage in stages:
        chunk = build_gpt(shape, seed=args.seed + 1000 * pp_rank + (vp_stage or 0), vp_stage=vp_stage,
                              max_sequence_length=args.max_position_embeddings, gpt_kwargs=gpt_kwargs, **overrides)
        chunk = chunk if on_cpu else chunk.cuda()
        chunks.append(Float16Module(chunk.config, chunk) if args.bf16 or args.fp16 else chunk)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=args.overlap_grad_reduce, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, grad_reduce_in_fp32=args.bf16)  # (Megatron-LM's for bf16)
    return [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)]


def build_optimizer(args: argparse.Namespace, chunks: list[torch.nn.Module]) -> Any:
    """Megatron's optimizer (mixed precision, distributed) under --use-distributed-optimizer/--bf16/--fp16; else
    torch Adam over the parameters (the launcher's first path, kept so its layouts keep their figures)."""
    if not args.megatron_optimizer:
        return torch.optim.Adam([p for chunk in chunks for p in chunk.parameters()], lr=args.lr)
    config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.lr, bf16=args.bf16, fp16=args.fp16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_param_gather=args.overlap_param_gather,
        weight_decay=0.01 if args.weight_decay is None else args.weight_decay,
        clip_grad=1.0 if args.clip_grad is None else args.clip_grad, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis)
    return get_megatron_optimizer(config, chunks)


def batches_for(args: argparse.Namespace, iteration: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    shape = shape_for(args, seq_length_at(args, iteration))
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    first = (iteration * dp_size + dp_rank) * args.micro_batches
    return [{k: v.to(device) for k, v in synthetic_batch(shape, first + i, args.seed).items()}
            for i in range(args.micro_batches)]


def shape_for(args: argparse.Namespace, seq_length: int) -> TransformerShape:
    return TransformerShape(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                            ffn_hidden_size=args.ffn_hidden_size,
                            vocab_size=args.vocab_size, seq_length=seq_length, micro_batch_size=args.micro_batch_size)


def loss_func(loss_mask: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides the returned loss in place


def forward_step(fail: bool, squeeze: list, data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module,
                 kill: KillPoint | None = None):
    batch = next(data_iterator)
    if kill is not None:
        kill.forward()
    if fail:
        raise RuntimeError("--fail-rank: this rank raises in its forward step, as a crashing rank would")
    if squeeze and isinstance(squeeze[0], int):  # --squeeze-rank: the tenant's memory, held by the caller's list
        squeeze[0] = torch.empty(squeeze[0], dtype=torch.uint8, device=batch["tokens"].device)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    if kill is not None:
        kill.backward(output)
    return output, functools.partial(loss_func, batch["loss_mask"])


def chameleon_config(args: argparse.Namespace, on_cpu: bool):
    """The config the flags give; on CPU without a config file, the emulated device's defaults above."""
    if on_cpu and args.chameleon_config is None:
        if args.chameleon_device_capacity is None:
            args.chameleon_device_capacity = CPU_DEFAULT_CAPACITY
        if args.chameleon_min_swap_bytes is None:
            args.chameleon_min_swap_bytes = CPU_DEFAULT_MIN_SWAP
    return config_from_megatron_args(args)


def train(args: argparse.Namespace) -> None:
    with session(args) as on_cpu:
        device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        shape = shape_for(args, args.seq_length)
        chunks = build_chunks(args, shape, on_cpu)
        config = chunks[0].config
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        if args.overlap_param_gather:
            config.param_sync_func = [c.start_param_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_param_sync
        parameters = [p for chunk in chunks for p in chunk.parameters()]
        optimizer = build_optimizer(args, chunks)
        if args.megatron_optimizer:
            config.grad_scale_func = optimizer.scale_loss  # (as Megatron-LM: fp16's loss scale, 1 otherwise)
        chameleon = install(chunks, chameleon_config(args, on_cpu), optimizer=optimizer, cuda_literals_on_cpu=on_cpu)
        coordinates = chameleon.coordinates
        kill = KillPoint(args, coordinates.rank)
        kill.on_swap_in(chameleon.device)
        record = RankRecord(coordinates.to_dict(), chameleon.device.capacity_bytes)
        forward_backward = chameleon.wrap(get_forward_backward_func())
        last_stage = parallel_state.is_pipeline_last_stage()
        losses: list[float] = []
        steps: list[dict[str, Any]] = []
        for iteration in range(args.iterations):
            batches = batches_for(args, iteration, device)
            iterators = [iter(batches) for _ in chunks]
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad(set_to_none=True)
            fail = args.fail_rank == coordinates.rank and args.fail_iteration == iteration + 1
            kill.current = iteration + 1
            squeezed = args.squeeze_rank == coordinates.rank and args.squeeze_iteration == iteration + 1
            squeeze = [args.squeeze_bytes] if squeezed and args.squeeze_bytes else []
            reduced = forward_backward(
                forward_step_func=functools.partial(forward_step, fail, squeeze, kill=kill), data_iterator=iterators if len(chunks) > 1 else iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=args.micro_batches,
                seq_length=seq_length_at(args, iteration), micro_batch_size=args.micro_batch_size, forward_only=False,
            )
            if args.megatron_optimizer:
                scale = float(optimizer.get_loss_scale())
                updated, _grad_norm, _zeros = optimizer.step()  # closes the iteration (install(optimizer=...))
                steps.append({"loss_scale": scale, "skipped": not updated})
            else:
                for p in parameters:
                    p.grad = p.main_grad
                optimizer.step()  # closes the iteration (install(optimizer=...))
            squeeze.clear()
            row = record.add(chameleon.last_report)
            loss = sum(float(d["lm loss"]) for d in reduced) / len(reduced) if last_stage and reduced else None
            progress(args, iteration, loss, row, gather((coordinates.pp_rank, coordinates.tp_rank, coordinates.dp_rank, loss, row)),
                     record.capacity_bytes, losses)
        if args.overlap_param_gather:  # the last step's parameters are gathered by the next forward: gather them now
            for chunk in chunks:
                chunk.start_param_sync(force_sync=True)
        record.schedule = schedule_of(chameleon.last_trace)
        record.params_sha256 = params_sha256(trained_tensors(chunks, optimizer if args.megatron_optimizer else None))
        records = gather(record.to_dict())
        chameleon.close()
        if coordinates.rank == 0 and args.report:
            settings = {"enabled": chameleon.config.enabled, "config": chameleon.config.model_dump(mode="json")}
            write_report(args.report, megatron_flags.layout_of(args, coordinates), settings, losses, records,
                         extra={"steps": steps} if steps else None)


def trained_tensors(chunks: list[torch.nn.Module], optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """What a run's result is: every chunk's parameters and, with Megatron's optimizer, the fp32 main parameters
    it steps (this rank's shards under the distributed optimizer)."""
    for i, chunk in enumerate(chunks):
        for name, parameter in chunk.named_parameters():
            yield f"{i}.{name}", parameter
    if optimizer is not None:
        for j, inner in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
            for g, group in enumerate(inner.optimizer.param_groups):
                for k, parameter in enumerate(group["params"]):
                    yield f"main.{j}.{g}.{k}", parameter


def progress(args, iteration, loss, row, everyone, capacity_bytes, losses) -> None:
    """Rank 0: one line per iteration; ``losses`` gets the iteration's loss (mean over data-parallel ranks)."""
    finals = [entry[3] for entry in everyone if entry[3] is not None and entry[1] == 0]
    value = sum(finals) / len(finals) if finals else float("nan")
    losses.append(value)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    stages = {}
    for pp_rank, _tp, _dp, _loss, r in everyone:
        stages.setdefault(pp_rank, r["stage"])
    peak = max(entry[4]["peak_device_bytes"] for entry in everyone)
    stall = max(entry[4]["stall_s"] for entry in everyone)
    logger.info("iteration %d/%d  loss %.4f  stage %s  max peak %s of %s  stall %.3fs", iteration + 1, args.iterations,
                value, " ".join(f"pp{k}:{v}" for k, v in sorted(stages.items())), format_bytes(peak),
                format_bytes(capacity_bytes), stall)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launcher_setup("megatron", ignored_warnings=[".*(Apex|Transformer Engine).*not installed.*"])
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
