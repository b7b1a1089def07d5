"""``--kill-rank``: for the fault tests (issue 37 item 12), a rank ends itself with SIGKILL at a chosen point of
an iteration, as a rank the machine's OOM killer or an operator ends would: no exception, no cleanup, no
message of its own. The job must still end within a bounded time naming the dead rank, no survivor may hang in
a collective, and no process may stay behind.

Points: ``forward`` (in the forward step, before the model runs), ``backward`` (in the first gradient the
backward pass computes for the model's output) and ``swap-in`` (right after the runtime started copying a
swapped-out activation back to the device: the copy is in flight, its host buffer pinned).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
from typing import Any

import torch

POINTS = ("forward", "backward", "swap-in")


def kill_flags(group: Any) -> None:
    """Add ``--kill-rank``, ``--kill-iteration`` and ``--kill-at`` to an argparse group."""
    group.add_argument("--kill-rank", type=int, default=None, metavar="RANK",
                       help="Testing: this rank sends itself SIGKILL at --kill-at of --kill-iteration (the job must "
                            "end naming it, with no survivor left).")
    group.add_argument("--kill-iteration", type=int, default=2)
    group.add_argument("--kill-at", choices=POINTS, default="forward")


def die() -> None:
    os.write(2, f"--kill-rank: this rank sends itself SIGKILL (pid {os.getpid()})\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


class KillPoint:
    """Where this rank dies: ``armed(iteration)`` says whether it dies in that (1-based) iteration; the launcher
    calls ``forward``, ``backward(output)`` and installs ``on_swap_in(device)`` once."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.point = args.kill_at if args.kill_rank == rank else None
        self.iteration = args.kill_iteration
        self.current = 0

    def armed(self, point: str) -> bool:
        return self.point == point and self.current == self.iteration

    def forward(self) -> None:
        if self.armed("forward"):
            die()

    def backward(self, output: torch.Tensor) -> None:
        if self.armed("backward") and output.requires_grad:
            output.register_hook(lambda grad: die())

    def on_swap_in(self, device: Any) -> None:
        """Wrap ``device.copy_to_device`` (this device object only) to die once a copy back has started."""
        if self.point != "swap-in":
            return
        copy = device.copy_to_device

        @functools.wraps(copy)
        def copying(*args: Any, **kwargs: Any) -> Any:
            handle = copy(*args, **kwargs)
            if self.armed("swap-in"):
                die()
            return handle

        device.copy_to_device = copying
