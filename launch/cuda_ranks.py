"""Which GPU and which process-group backend one rank of a launcher takes on a CUDA machine.

One GPU per rank on the node (the usual job): the rank's own GPU (``LOCAL_RANK``) and NCCL. Fewer GPUs than
ranks on the node (a two-rank check on a one-GPU machine): the ranks share GPUs (``LOCAL_RANK`` modulo the
GPU count) and use gloo, because NCCL refuses two ranks of one communicator on the same GPU. Gloo moves CUDA
tensors only in all-reduce and broadcast: layouts that send between pipeline stages, or ZeRO stages that
reduce-scatter or all-gather, need one GPU per rank.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

logger = logging.getLogger(__name__)


def rank_cuda_setup(device_count: int, environ: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """(CUDA device index, process-group backend) for this rank, from torchrun's environment."""
    if device_count < 1:
        raise ValueError("rank_cuda_setup needs at least one CUDA device")
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    local_world_size = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    if device_count >= local_world_size:
        return local_rank, "nccl"
    logger.warning("%d ranks on this node share %d GPU(s): rank %d uses cuda:%d and the gloo backend (NCCL needs one "
                   "GPU per rank; gloo reduces CUDA tensors only by all-reduce and broadcast)",
                   local_world_size, device_count, local_rank, local_rank % device_count)
    return local_rank % device_count, "gloo"
