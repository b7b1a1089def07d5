"""Synthetic ``StepTrace``s for policy tests: transformer-like layers, forward then backward per micro-batch.

Every layer's forward runs ``ops_per_layer`` ops; each op makes one new activation storage, which autograd
saves (the op after it reads it) unless ``saved`` says otherwise; backward runs the layers in reverse, each
backward op reading one saved tensor of its layer, after which the storage dies. Live bytes follow from
the storages' lives, so the no-swap curve is exact by construction.
"""

from __future__ import annotations

from chameleon_dist.trace.step_trace import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    OpRecord,
    StepTrace,
    StorageRecord,
    TensorRecord,
)

OP_NAMES = ["aten.mm.default", "aten.silu.default", "aten._softmax.default", "aten.mm.default.bwd",
            "aten.native_dropout.default", "aten.add_.Tensor"]


def layered_trace(
    sizes: list[list[int]],
    micro_batches: int = 1,
    iteration_s: float = 1.0,
    static_bytes: int = 1000,
    optimizer_ops: int = 2,
    producer_names: list[list[int]] | None = None,
) -> StepTrace:
    """``sizes[layer][k]``: bytes of the k-th activation of a layer (0: an op that saves nothing)."""
    ops: list[OpRecord] = []
    tensors: list[TensorRecord] = []
    storages: list[StorageRecord] = []
    saves: list[tuple[int, int]] = []
    live = static_bytes
    param = TensorRecord(0, 0, "float32", (10,), 40, is_parameter=True)
    tensors.append(param)
    storages.append(StorageRecord(0, 40, -1, -1, True))
    for mb in range(micro_batches):
        made: list[list[int]] = []
        for layer, layer_sizes in enumerate(sizes):
            ids = []
            for k, nbytes in enumerate(layer_sizes):
                name = producer_names[layer][k] if producer_names else (2 if k == 1 else 0)
                inputs = (0,) if not ids else (0, ids[-1])
                if nbytes:
                    sid, tid = len(storages), len(tensors)
                    storages.append(StorageRecord(sid, nbytes, len(ops), -1, False))
                    tensors.append(TensorRecord(tid, sid, "float32", (nbytes // 4,), nbytes, saved=True))
                    live += nbytes
                    ops.append(OpRecord(name, FORWARD, mb, -1, layer, inputs, (tid,), live))
                    saves.append((tid, len(ops)))
                    ids.append(tid)
                else:
                    ops.append(OpRecord(name, FORWARD, mb, -1, layer, inputs, (), live))
            made.append(ids)
        for layer in reversed(range(len(sizes))):
            for tid in reversed(made[layer]):
                ops.append(OpRecord(3, BACKWARD, mb, -1, -1, (tid, 0), (), live))
                live -= tensors[tid].nbytes
                storages[tensors[tid].storage_id].freed_at = len(ops)
                ops[-1].live_bytes = live
            if not made[layer]:
                ops.append(OpRecord(3, BACKWARD, mb, -1, -1, (0,), (), live))
    for _ in range(optimizer_ops):
        ops.append(OpRecord(5, OPTIMIZER, micro_batches - 1, -1, -1, (0,), (0,), live))
    return StepTrace(
        iteration=3, op_names=list(OP_NAMES), module_paths=[], ops=ops, tensors=tensors, storages=storages,
        swaps=[], iteration_s=iteration_s, start_live_bytes=static_bytes, saves=saves,
    )
