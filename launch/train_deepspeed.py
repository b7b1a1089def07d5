"""Train a GPT-style model on synthetic tokens with DeepSpeed, Chameleon installed on every rank by the
config's ``"chameleon"`` block. Start it with torchrun or with DeepSpeed's launcher::

    torchrun --nproc-per-node 2 -m launch.train_deepspeed --deepspeed_config configs/deepspeed/zero2.json
    deepspeed --num_gpus 2 --module launch.train_deepspeed --deepspeed_config configs/deepspeed/zero2.json

``--pipeline-stages`` 0 or 1 trains through a ``DeepSpeedEngine`` (``engine(batch)``, ``engine.backward``,
``engine.step`` per micro-batch); 2 or more through a ``PipelineModule`` and ``PipelineEngine.train_batch``.
On a machine without CUDA it uses gloo and the emulated device the block configures (and, for an fp16
config, the opt-in ``deepspeed-cpu-fp16-supported`` patch); with CUDA, the rank's GPU, NCCL and the real device
(gloo when ranks share a GPU: ``launch/cuda_ranks.py``).
``--no-chameleon`` installs the runtime measuring only (nothing swapped, every byte metered, out of memory at
the device's capacity), so its report gives each rank's unswapped peak. Rank 0 prints one line per iteration
and writes the ``--report`` JSON (launch/rank_report.py, the shape the Megatron launcher writes; each
iteration's row adds DeepSpeed's ``skipped_steps`` so far and, in fp16, the ``loss_scale`` after its step).
DeepSpeed stays the distributed engine: its ZeRO optimizers, pipeline schedule and collectives run the job.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from launch.kill_point import KillPoint, kill_flags
from launch.cuda_ranks import rank_cuda_setup
from launch.rank_report import RankRecord, gather, launcher_setup, params_sha256, schedule_of, write_report
from launch.models.toy_gpt import Block, MoEFeedForward

from chameleon_dist.config import config_from_deepspeed
from chameleon_dist.units import format_bytes

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import deepspeed  # noqa: E402  (before any rank starts: tests fork ranks from one process)
    # torch.use_deterministic_algorithms imports torch._inductor, and DeepSpeed's optimizer check imports its
    # Muon module, which calls torch.compile (torch._dynamo, inductor's compile_fx): 6-7 s in every rank
    # unless imported here, once
    import torch._inductor  # noqa: E402,F401
    with contextlib.suppress(ImportError):
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
    from deepspeed.pipe import PipelineModule  # noqa: E402
    from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

    from chameleon_dist.integrations.deepspeed import initialize, install  # noqa: E402

logger = logging.getLogger("train_deepspeed")

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "deepspeed" / "zero2.json"

CPU_DEFAULT_CAPACITY = "8GB"
"""The emulated device's capacity when neither --chameleon-device-capacity nor the block gives one."""

CPU_DEFAULT_MIN_SWAP = "16KiB"
"""``min_swap_bytes`` on CPU when the block gives none: the toy model's activations are tens of KiB, below
the 1 MiB default meant for real models."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--deepspeed_config", "--deepspeed-config", default=str(DEFAULT_CONFIG), metavar="PATH",
                        help="DeepSpeed JSON config with a \"chameleon\" block (default: %(default)s).")
    parser.add_argument("--pipeline-stages", type=int, default=0,
                        help="0 or 1: DeepSpeedEngine; 2 or more: PipelineModule + PipelineEngine with this many stages.")
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--seq-length", type=int, default=128)
    model.add_argument("--vocab-size", type=int, default=128)
    model.add_argument("--vary-seq-length", action="store_true",
                       help="Change the sequence length every 3 iterations (full, 1/2, 3/4 of --seq-length).")
    model.add_argument("--num-experts", type=int, default=0,
                       help="Experts in every odd layer's MLP (top-k routing, data dependent); 0: dense MLPs.")
    model.add_argument("--moe-router-topk", type=int, default=2)
    run = parser.add_argument_group("run")
    run.add_argument("--iterations", type=int, default=10)
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--report", default=None, metavar="PATH", help="Write the JSON report here (rank 0).")
    run.add_argument("--no-chameleon", action="store_true",
                     help="Measure only: the block's device meters every rank, nothing is swapped.")
    run.add_argument("--chameleon-device-capacity", default=None, metavar="SIZE",
                     help="Override the block's device.capacity (e.g. 40MB).")
    run.add_argument("--fail-rank", type=int, default=None, metavar="RANK",
                     help="Testing: this rank raises in the forward of --fail-iteration (the job must end, not hang).")
    run.add_argument("--fail-iteration", type=int, default=2)
    run.add_argument("--dist-timeout-s", type=float, default=300.0,
                     help="Collective timeout: a backstop should a peer vanish without the launcher noticing.")
    kill_flags(run)
    run.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args(argv)
    problems = []
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "iterations"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.pipeline_stages < 0:
        problems.append("--pipeline-stages must be >= 0")
    if args.hidden_size % args.num_attention_heads:
        problems.append(f"--hidden-size {args.hidden_size} must be divisible by --num-attention-heads")
    if args.num_experts < 0 or (args.num_experts and not 1 <= args.moe_router_topk <= args.num_experts):
        problems.append("--num-experts must be >= 0 and --moe-router-topk between 1 and --num-experts")
    if not Path(args.deepspeed_config).is_file():
        problems.append(f"--deepspeed_config {args.deepspeed_config}: no such file")
    if problems:
        parser.error("; ".join(problems))
    return args


# ---- the model ----------------------------------------------------------------------------------------
class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class Head(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_layers(args: argparse.Namespace) -> list[nn.Module]:
    """Embedding, ``--num-layers`` pre-norm blocks (every odd one with experts under ``--num-experts``), head;
    the same values on every rank (seeded)."""
    torch.manual_seed(args.seed)
    hidden = args.hidden_size
    blocks = []
    for index in range(args.num_layers):
        mlp = MoEFeedForward(hidden, 4 * hidden, args.num_experts, args.moe_router_topk) \
            if args.num_experts and index % 2 else None
        blocks.append(Block(hidden, args.num_attention_heads, mlp))
    return [Embedding(args.vocab_size, hidden), *blocks, Head(args.vocab_size, hidden)]


class GPT(nn.Module):
    """The layers in sequence; ``forward(tokens, labels)`` returns the loss (the plain engine's model)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return lm_loss(x, labels)


def build_model(args: argparse.Namespace) -> nn.Module:
    layers = build_layers(args)
    if args.pipeline_stages < 2:
        return GPT(layers)
    return PipelineModule(layers=layers, num_stages=args.pipeline_stages, loss_fn=lm_loss, partition_method="uniform",
                          dynamic_shape=args.vary_seq_length)


# ---- data ---------------------------------------------------------------------------------------------
def seq_length_at(args: argparse.Namespace, iteration: int) -> int:
    if not args.vary_seq_length:
        return args.seq_length
    fraction = (1.0, 0.5, 0.75)[(iteration // 3) % 3]
    return max(8, int(args.seq_length * fraction) // 8 * 8)


def micro_batches(args: argparse.Namespace, iteration: int, count: int, rows: int, dp_rank: int, dp_size: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's ``count`` micro-batches of iteration ``iteration``: (tokens, next tokens)."""
    seq = seq_length_at(args, iteration)
    out = []
    for index in range(count):
        generator = torch.Generator().manual_seed(args.seed * 7919 + ((iteration * dp_size + dp_rank) * count + index))
        tokens = torch.randint(0, args.vocab_size, (rows, seq + 1), generator=generator)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].contiguous().to(device)))
    return out


# ---- the run ------------------------------------------------------------------------------------------
def deepspeed_config(args: argparse.Namespace, on_cpu: bool) -> dict[str, Any]:
    """The JSON config, with ``--chameleon-device-capacity`` and ``--no-chameleon`` applied to a copy (and on
    CPU, ``min_swap_bytes`` defaulted for the toy model)."""
    config = json.loads(Path(args.deepspeed_config).read_text())
    block = copy.deepcopy(config.get("chameleon"))
    if isinstance(block, dict) and on_cpu:
        block.setdefault("min_swap_bytes", CPU_DEFAULT_MIN_SWAP)
        if not isinstance(block.get("device"), dict) or block["device"].get("capacity") is None:
            block["device"] = {**(block.get("device") or {}), "capacity": CPU_DEFAULT_CAPACITY}
    if isinstance(block, dict) and args.chameleon_device_capacity is not None:
        block.setdefault("device", {})["capacity"] = args.chameleon_device_capacity
    if isinstance(block, dict) and args.no_chameleon:
        block["enabled"] = False
    if block is not None:
        config["chameleon"] = block
    return config


@contextlib.contextmanager
def session(args: argparse.Namespace, config: dict[str, Any]) -> Iterator[bool]:
    """Process group (gloo on CPU, NCCL with CUDA) and, on CPU for fp16, the opt-in fp16 patch; yields
    whether this is a CPU run."""
    on_cpu = not torch.cuda.is_available()
    timeout = datetime.timedelta(seconds=args.dist_timeout_s)
    patches = contextlib.nullcontext()
    if on_cpu:
        torch.set_num_threads(1)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a minutes-long build of a CPU-only op
        if config.get("fp16", {}).get("enabled"):
            from chameleon_dist.integrations.deepspeed import CPU_PATCHES
            from chameleon_dist.patching import apply_patches

            patches = apply_patches(CPU_PATCHES)
        backend = "gloo"
    else:
        index, backend = rank_cuda_setup(torch.cuda.device_count())
        torch.cuda.set_device(index)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    with patches:
        try:
            yield on_cpu
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    config = deepspeed_config(args, on_cpu=not torch.cuda.is_available())
    settings = config_from_deepspeed(config)  # (raises before anything is built when the block is wrong)
    with session(args, config) as on_cpu:
        model = build_model(args)
        engine, _, _, _ = initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                     config=config)
        if args.no_chameleon and engine.chameleon is None and "chameleon" in config:
            install(engine, settings)  # measuring only
        chameleon = engine.chameleon
        device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        pipeline = args.pipeline_stages >= 2
        coordinates = chameleon.coordinates.to_dict() if chameleon is not None else {
            "rank": dist.get_rank(), "tp_rank": 0, "pp_rank": 0, "dp_rank": dist.get_rank()}
        capacity = chameleon.device.capacity_bytes if chameleon is not None else 0
        kill = KillPoint(args, dist.get_rank())
        engine.module.register_forward_pre_hook(lambda module, inputs: kill.forward())
        if chameleon is not None:
            kill.on_swap_in(chameleon.device)
        record = RankRecord(coordinates, capacity)
        gas = engine.gradient_accumulation_steps()
        rows = engine.train_micro_batch_size_per_gpu()
        dp_rank, dp_size = _dp_place(engine, pipeline)
        losses: list[float] = []
        for iteration in range(args.iterations):
            batches = micro_batches(args, iteration, gas, rows, dp_rank, dp_size, device)
            fail = args.fail_rank == dist.get_rank() and args.fail_iteration == iteration + 1
            kill.current = iteration + 1
            if fail:
                _fail_next_forward(engine)
            if pipeline:
                loss = engine.train_batch(iter(batches)).item()
            else:
                window = []
                for tokens, labels in batches:
                    micro_loss = engine(tokens, labels)
                    kill.backward(micro_loss)
                    engine.backward(micro_loss)
                    engine.step()
                    window.append(micro_loss.item())
                loss = sum(window) / len(window)
            row = record.add(chameleon.last_report) if chameleon is not None else {}
            if row:  # (the record's own row: DeepSpeed's count of skipped steps so far and the loss scale after it)
                row.update(skipped_steps=_skipped(engine), loss_scale=_loss_scale(engine))
            progress(args, iteration, loss, row, gather((loss, row, _skipped(engine))), capacity, losses)
        record.schedule = schedule_of(chameleon.last_trace) if chameleon is not None else ""
        record.params_sha256 = params_sha256(_final_parameters(engine, config))
        records = gather(record.to_dict())
        if chameleon is not None:
            chameleon.close()
        if dist.get_rank() == 0 and args.report:
            layout = {"zero_stage": engine.zero_optimization_stage(), "pipeline_stages": max(1, args.pipeline_stages),
                      "dp": dp_size, "world_size": dist.get_world_size(), "gradient_accumulation_steps": gas,
                      "micro_batch_size": rows, "precision": _precision(config), "num_layers": args.num_layers,
                      "hidden_size": args.hidden_size, "seq_length": args.seq_length,
                      "vary_seq_length": args.vary_seq_length, "iterations": args.iterations, "seed": args.seed,
                      "num_experts": args.num_experts, "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
                      "optimizer": type(engine.optimizer).__name__}
            chameleon_settings = {"enabled": settings.enabled, "measured": chameleon is not None,
                                  "config": settings.model_dump(mode="json")}
            write_report(args.report, layout, chameleon_settings, losses, records)


def _dp_place(engine: Any, pipeline: bool) -> tuple[int, int]:
    if pipeline:
        return engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size()
    return int(engine.global_rank) % int(engine.dp_world_size), int(engine.dp_world_size)


def _precision(config: dict[str, Any]) -> str:
    if config.get("bf16", {}).get("enabled"):
        return "bf16"
    return "fp16" if config.get("fp16", {}).get("enabled") else "fp32"


def _skipped(engine: Any) -> int:
    return int(getattr(engine, "skipped_steps", 0))


def _loss_scale(engine: Any) -> float | None:
    """The fp16 optimizer's current loss scale (after the iteration's step updated it); None without one."""
    scale = getattr(engine.optimizer, "cur_scale", None) if engine.fp16_enabled() else None
    return float(scale) if scale is not None else None


def _fail_next_forward(engine: Any) -> None:
    """--fail-rank: the next forward of this rank's model raises, as a crashing rank would."""
    def fail(module: nn.Module, inputs: Any) -> None:
        handle.remove()
        raise RuntimeError("--fail-rank: this rank raises in its forward, as a crashing rank would")

    handle = engine.module.register_forward_pre_hook(fail)


def _final_parameters(engine: Any, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The rank's parameters in a fixed order: the fp32 master copies under ZeRO (full, also under ZeRO-3) and
    mixed precision, the module's own values otherwise."""
    mixed = _precision(config) != "fp32"
    for name, parameter in engine.module.named_parameters():
        if engine.zero_optimization_stage() > 0 or mixed:
            value = safe_get_full_fp32_param(parameter)
            yield name, value if value is not None else parameter
        else:
            yield name, parameter


def progress(args, iteration, loss, row, everyone, capacity_bytes, losses) -> None:
    """Rank 0: one line per iteration; ``losses`` gets the iteration's loss (mean over ranks)."""
    value = sum(entry[0] for entry in everyone) / len(everyone)
    losses.append(value)
    if dist.get_rank() != 0:
        return
    rows = [entry[1] for entry in everyone if entry[1]]
    if not rows:
        logger.info("iteration %d/%d  loss %.4f  (no chameleon block: not metered)", iteration + 1, args.iterations, value)
        return
    peak = max(r["peak_device_bytes"] for r in rows)
    stall = max(r["stall_s"] for r in rows)
    logger.info("iteration %d/%d  loss %.4f  stage %s  max peak %s of %s  swapped out %s  stall %.3fs  skipped steps %d",
                iteration + 1, args.iterations, value, " ".join(sorted({r["stage"] for r in rows})), format_bytes(peak),
                format_bytes(capacity_bytes), format_bytes(max(r["swap_out_bytes"] for r in rows)), stall,
                max(entry[2] for entry in everyone))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    launcher_setup("DeepSpeed")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
