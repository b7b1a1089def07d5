"""Host pool under changing shapes (issue 10, item 4): reserved host bytes when every iteration has a
different batch shape.

A tiny plain-PyTorch MLP language model trains through the real ``Chameleon`` runtime on an
``EmulatedDevice`` (instant link, capacity unbounded, ``min_swap_bytes`` 0: every saved activation goes
to the host pool). Each iteration draws a new batch size and sequence length (seeded), so the swapped
tensors have new byte sizes nearly every time. After each iteration the script reads the report's
``host_pool_bytes`` (what the pool holds from the host: buffers in use plus cached idle ones) and the
pool's ``in_use_bytes``; it prints both at ``--checkpoints`` (default iterations 50 and 300), the
largest reserved figure over the run, the pool's peak in-use bytes and how many buffers it allocated.
A pool that keeps every exact size it ever saw grows without bound here; a bounded one stays flat.

Every figure is EMULATED (host buffers are plain CPU memory; no GPU is involved).

    .venv/bin/python -m launch.bench.bench_host_pool                     # ~10 s on 2 cores
    .venv/bin/python -m launch.bench.bench_host_pool --json runs/bench_host_pool.json
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from launch.bench.harness import run_benchmark

import torch
from torch import nn
from torch.nn import functional as F

from chameleon_dist import Chameleon
from chameleon_dist.device import UNBOUNDED_CAPACITY_BYTES, EmulatedDevice
from chameleon_dist.units import format_bytes


class TinyMLPLM(nn.Module):
    """Embedding, ``layers`` x (Linear, GELU, Linear) with residuals, tied output."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return F.linear(x, self.embed.weight)


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    shapes = random.Random(args.seed)
    model = TinyMLPLM(args.vocab, args.hidden, args.layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    device = EmulatedDevice(UNBOUNDED_CAPACITY_BYTES)
    chameleon = Chameleon({"min_swap_bytes": 0}, device=device)
    chameleon.attach(model)
    checkpoints = sorted(set(args.checkpoints))
    rows: list[dict] = []
    max_reserved_bytes = 0
    for iteration in range(1, max(checkpoints) + 1):
        batch = shapes.randint(1, args.max_batch)
        seq = shapes.randint(4, args.max_seq)
        tokens = torch.randint(0, args.vocab, (batch, seq + 1))

        def closure() -> torch.Tensor:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            return loss.detach()

        optimizer.zero_grad(set_to_none=True)
        chameleon.run_iteration(closure, optimizer=optimizer)
        reserved_bytes = chameleon.last_report.host_pool_bytes
        max_reserved_bytes = max(max_reserved_bytes, reserved_bytes)
        if iteration in checkpoints:
            row = {"iteration": iteration, "host_pool_bytes": reserved_bytes,
                   "in_use_bytes": device.host_pool.in_use_bytes, "allocations": device.host_pool.allocations}
            rows.append(row)
            print(f"iteration {iteration:4d}: reserved {format_bytes(reserved_bytes):>10} "
                  f"({reserved_bytes} B), in use {format_bytes(row['in_use_bytes'])}, "
                  f"buffers allocated so far {row['allocations']}  [emulated]", flush=True)
    pool = device.host_pool
    first, last = rows[0], rows[-1]
    ratio = last["host_pool_bytes"] / first["host_pool_bytes"] if first["host_pool_bytes"] else float("nan")
    peak_in_use_bytes = pool.peak_in_use_bytes
    print(f"max reserved over {max(checkpoints)} iterations: {format_bytes(max_reserved_bytes)}; "
          f"peak in use: {format_bytes(peak_in_use_bytes)}; buffers evicted: {format_bytes(pool.evicted_bytes)}; "
          f"reserved at {last['iteration']} / at {first['iteration']}: {ratio:.2f}x  [emulated]")
    return {"checkpoints": rows, "max_reserved_bytes": max_reserved_bytes,
            "peak_in_use_bytes": peak_in_use_bytes,
            "reserved_ratio_last_over_first": ratio, "emulated": True}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[50, 300],
                        help="iterations at which reserved and in-use bytes are printed (the last one ends the run)")
    parser.add_argument("--max-batch", type=int, default=16, help="batch size drawn from 1..this")
    parser.add_argument("--max-seq", type=int, default=64, help="sequence length drawn from 4..this")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny ops: more threads only contend)")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"host pool under changing shapes (EMULATED device, instant link, min_swap_bytes 0): "
          f"MLP LM {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch 1..{args.max_batch}, "
          f"seq 4..{args.max_seq} drawn every iteration (seed {args.seed})", flush=True)
    run_benchmark("launch.bench.bench_host_pool", argv, args, torch, run, lambda r: print(f"wall {r['wall_s']:.1f} s"),
                  emulated=False, config=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
