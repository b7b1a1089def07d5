"""How much memory a ZeRO-3 forward pass holds, with and without Chameleon: a two-rank job whose model is built
under ``deepspeed.zero.Init`` and whose gathered weights DeepSpeed frees after each module's forward
(``stage3_max_reuse_distance: 0``, no prefetch). Start it with torchrun::

    torchrun --nproc-per-node 2 -m launch.experiments.zero3_memory --mode on --report zero3-on.json
    torchrun --nproc-per-node 2 -m launch.experiments.zero3_memory --mode off --report zero3-off.json

``--mode off`` installs the runtime measuring only (no saved-tensor hooks: DeepSpeed's own memory behaviour,
metered by the emulated device); ``on`` swaps as the config says; ``plain`` runs DeepSpeed without any runtime
(resident memory only). For each iteration every rank records how much its forward pass grew the process's
resident memory (``/proc/self/statm``) and, unless plain, the emulated device's live bytes; rank 0 writes them,
the losses and a hash of every rank's gradients to ``--report`` and logs the growth. The full weights
(``--num-layers`` square ``--hidden-size`` layers, fp32) dominate: at the defaults 12 layers of 4 MiB, while
the activations are a few KiB.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from chameleon_dist.schema_version import versioned


with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import deepspeed  # noqa: E402  (before any rank starts: tests fork ranks from one process)

    from chameleon_dist.config import config_from_deepspeed  # noqa: E402
    from chameleon_dist.integrations.deepspeed import initialize, install  # noqa: E402

logger = logging.getLogger("zero3_memory")

MIB = 2**20
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MODES = ("plain", "off", "on")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 2**20


def map_large_allocations() -> None:
    """Have glibc map every allocation of ``MMAP_THRESHOLD_BYTES`` or more on its own (and unmap it when freed), as
    a GPU's allocator returns a freed block: otherwise glibc raises its threshold after the first free of a large
    block and keeps later ones in its heap, and the resident set says more about glibc than about what is held.
    (A fixed threshold also stops glibc from adjusting it.)"""
    libc = ctypes.CDLL(None)
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        logger.warning("mallopt(M_MMAP_THRESHOLD) failed: resident memory includes glibc's cached blocks")


def resident_bytes() -> int:
    """The process's resident set size now (``/proc/self/statm``, second field, in pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=MODES, default="on")
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2, help="Rows of each rank's batch.")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--min-swap-bytes", default="1MiB",
                        help="chameleon.min_swap_bytes (the activations stay below it: every saved tensor is kept).")
    parser.add_argument("--report", default=None, metavar="PATH")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.num_layers < 1 or args.hidden_size < 1 or args.iterations < 1 or args.rows < 1:
        parser.error("--num-layers, --hidden-size, --rows and --iterations must be >= 1")
    return args


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.rows,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
            "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20,
        },
    }
    if args.mode != "plain":
        config["chameleon"] = {
            "enabled": args.mode == "on", "min_swap_bytes": args.min_swap_bytes,
            "device": {"kind": "emulated", "capacity": "4GB", "preset": "h100-pcie", "host_op_s": 2e-5},
        }
    return config


def build_model(args: argparse.Namespace, config: dict[str, Any]) -> nn.Module:
    torch.manual_seed(1234)
    with deepspeed.zero.Init(config_dict_or_path=config):
        layers = []
        for _ in range(args.num_layers):
            layers += [nn.Linear(args.hidden_size, args.hidden_size, bias=False), nn.Tanh()]
        return nn.Sequential(*layers)


def grads_sha256(engine: Any) -> str:
    """sha256 over this rank's gradient partitions (ZeRO-3 keeps each rank's share), in parameter order."""
    from deepspeed.utils import safe_get_local_grad

    digest = hashlib.sha256()
    for name, parameter in engine.module.named_parameters():
        grad = safe_get_local_grad(parameter)
        value = grad.detach().contiguous() if grad is not None else torch.empty(0)
        digest.update(name.encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def train(args: argparse.Namespace) -> dict[str, Any]:
    config = ds_config(args)
    settings = config_from_deepspeed(config) if args.mode != "plain" else None
    model = build_model(args, config)
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    if args.mode == "off":
        install(engine, settings)  # measuring only: no hooks, the emulated device meters DeepSpeed's own memory
    chameleon = engine.chameleon
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    losses = []
    for iteration in range(args.iterations):
        generator = torch.Generator().manual_seed(iteration * world + rank)
        batch = torch.randn(args.rows, args.hidden_size, generator=generator)
        if chameleon is not None:
            chameleon.device.track(batch)
        gc.collect()  # (what is unreachable is not held: DeepSpeed leaves a gathered buffer in a cycle at times)
        live_before = chameleon.device.live_bytes() if chameleon is not None else 0
        resident_before = resident_bytes()
        loss = engine(batch).square().mean()
        gc.collect()
        resident_after = resident_bytes()
        live_after = chameleon.device.live_bytes() if chameleon is not None else 0
        engine.backward(loss)
        grads = grads_sha256(engine)
        engine.step()
        losses.append(loss.item())
        rows.append({"forward_resident_growth_bytes": resident_after - resident_before,
                     "forward_live_growth_bytes": live_after - live_before,
                     "live_bytes_before_forward": live_before, "grads_sha256": grads})
    if chameleon is not None:
        chameleon.close()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "iterations": rows, "losses": losses})
    full_bytes = args.num_layers * args.hidden_size**2 * 4
    if rank == 0:
        for entry in everyone:
            last = entry["iterations"][-1]
            logger.info("mode %s rank %d: forward grew resident memory by %.2f MiB, emulated live bytes by %.2f MiB "
                        "(full weights %.1f MiB)", args.mode, entry["rank"], last["forward_resident_growth_bytes"] / MIB,
                        last["forward_live_growth_bytes"] / MIB, full_bytes / MIB)
    return {"mode": args.mode, "full_weight_bytes": full_bytes, "ranks": everyone}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("chameleon_dist").setLevel(logging.WARNING)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    map_large_allocations()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a minutes-long build of a CPU-only op
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        result = train(args)
        if dist.get_rank() == 0 and args.report:
            Path(args.report).write_text(json.dumps(versioned(result), indent=1))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # A ZeRO-3 engine built under zero.Init on gloo leaves a C++ thread that aborts the interpreter's teardown
    # ("terminate called without an active exception", plain DeepSpeed too, deepspeed 0.19.8): the results are
    # written by now, so leave without the teardown
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
