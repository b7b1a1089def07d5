"""Pieces the executor tests make by hand: a policy that names a decision per saved storage, and the dispatch
mode that tells the executor of every op (as the runtime's profiler does while a policy recomputes)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from chameleon_dist.executor import SwapExecutor
from chameleon_dist.policy.model import Decision, Policy, PolicyEntry


def policy_by_hand(decisions: list[Decision | None], key: str, swap_out_at: int = 0) -> Policy:
    """A policy matched on save keys: ``decisions[i]`` for the i-th saved storage (None: kept)."""
    entries = [
        PolicyEntry(decision=d, nbytes=0, micro_batch=0, layer=-1, group=0, save_ordinal=i, layer_save_ordinal=i,
                    save_op_index=0, calling_op="", arg_position=0, dtype="float32", shape=(), tensor_nbytes=0,
                    swap_out_at=swap_out_at, last_forward_use=0, release_at=-1, swap_in_at=0, first_backward_use=0)
        for i, d in enumerate(decisions) if d is not None
    ]
    return Policy(name="by hand", budget_bytes=0, feasible=True, predicted_peak_bytes=0, no_swap_peak_bytes=0,
                  predicted_stall_s=0.0, predicted_recompute_s=0.0, predicted_iteration_s=0.0, compute_s=0.0,
                  entries=entries, layers=[], num_ops=0, trace_iteration=0, settings={},
                  save_keys=[key] * len(decisions))


class Producers(TorchDispatchMode):
    """Tells the executor of every op, as the runtime's profiler does while a policy recomputes."""

    def __init__(self, executor: SwapExecutor) -> None:
        super().__init__()
        self.executor = executor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.executor.on_produced(func, args, kwargs, out)
        return out
