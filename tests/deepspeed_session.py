"""DeepSpeed on one gloo rank inside the test process, for the in-process DeepSpeed test modules.

``TokenEmbedding`` and ``token_cross_entropy`` are the first layer and the loss of the test modules' pipelines.

``one_rank_deepspeed()`` is the body of a module-scoped fixture: it starts a one-rank gloo group (a free port;
DeepSpeed's shared-memory CPU op is skipped, its build takes minutes), forgets the groups DeepSpeed cached for
an earlier module's dead default group, and afterwards puts back ``torch.nn.functional.linear``, which
ZeRO-3 replaces for the whole process and leaves replaced.
"""

from __future__ import annotations

import os
import socket
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class TokenEmbedding(nn.Module):
    """A pipeline's first layer: token ids in, hidden states out."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A pipeline's ``loss_fn``: cross entropy over every token position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _forget_deepspeed_groups() -> None:
    """DeepSpeed caches the process groups it made and the last pipeline's grid (``deepspeed.utils.groups``):
    after a module before this one destroyed its default group they name dead groups."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")):
            setattr(groups, name, {} if isinstance(value, dict) else None)
    groups.mpu = None


def one_rank_deepspeed() -> Iterator[None]:
    import deepspeed

    linear = F.linear
    try:
        if dist.is_initialized():
            yield
            return
        _forget_deepspeed_groups()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")
        yield
        dist.destroy_process_group()
        _forget_deepspeed_groups()
    finally:
        torch.nn.functional.linear = linear
