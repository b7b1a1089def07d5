"""Mixture-of-experts routing for Megatron models whose activations are meta tensors (sizes, no data).

Megatron's router runs unchanged on meta (its gating matmul, top-k, softmax and auxiliary loss only need shapes),
but the allgather token dispatcher must know how many tokens each expert receives: it copies the per-expert counts
to the host (``local_map.sum(0).cpu()``), and its permutation (``masked_select``) has a data-dependent size. Neither
works on meta. :data:`META_DISPATCH_POSTPROCESS` replaces ``MoEAllGatherTokenDispatcher.dispatch_postprocess`` for
meta inputs only (any other input goes to the original): the routing is real top-k routing (Megatron's own
``topk_routing_with_score_function``, with the layer's top-k and score function) over *random* logits drawn on the
CPU, ``[tokens, experts]`` of them, so the counts and the permutation indices are real CPU tensors; the large tensors
(hidden states, probabilities, the permuted tokens) stay on meta, gathered with ``index_select`` at those indices
where upstream uses ``masked_select`` with the routing map (the same elements in the same order).

The random logits come from the global CPU generator, which Megatron's activation recomputation saves and
restores (``CheckpointFunction``, with the CPU shims' RNG patches): a recomputed MoE layer draws the routing of its
forward again. ``meta_models.meta_schedule_step`` seeds that generator from ``(MetaRouting.seed, iteration)``
inside ``torch.random.fork_rng``, so every iteration routes differently and the same seed and iteration route
alike. Imports no Megatron at module level (the replacement imports Megatron's routing function when it runs).

Also here: the :class:`InstanceChange` records of the Megatron MoE state a meta session keeps apart from CPU runs
in the same process (``meta_models.megatron_meta_session`` makes the change).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Any

import torch

from chameleon_dist.patching import InstanceChange, Patch, unbound_replacement

logger = logging.getLogger(__name__)

_MEGATRON_VERSIONS = ">=0.16,<0.17"
_NEEDS = "a model's MetaRouting: apply meta_routing_patches(routing)"
_SEED_STRIDE = 1_000_003


@dataclasses.dataclass(frozen=True)
class RoutingRecord:
    """One dispatch of one MoE layer: the tokens each (local) expert received. ``recomputed``: drawn again inside
    backward by activation recomputation (it then repeats the forward's draw)."""

    layer_number: int | None
    tokens_per_expert: tuple[int, ...]
    recomputed: bool


class MetaRouting:
    """The routing state of one meta model: ``seed`` (``build_meta_gpt(moe_routing_seed=...)``), the ``iteration``
    being run, and the :class:`RoutingRecord` of every dispatch since :meth:`begin_iteration`."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.iteration = -1  # none begun yet
        self.records: list[RoutingRecord] = []
        self._layer_numbers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def register(self, dispatcher: Any, layer_number: int | None) -> None:
        """Name the layer a dispatcher belongs to (for the records)."""
        if layer_number is not None:
            self._layer_numbers[dispatcher] = layer_number

    def seed_for(self, iteration: int) -> int:
        """The CPU generator's seed for ``iteration``."""
        return self.seed * _SEED_STRIDE + iteration

    @property
    def next_iteration(self) -> int:
        return self.iteration + 1

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.records.clear()

    def forward_counts(self) -> list[tuple[int, ...]]:
        """Tokens per expert of each forward dispatch (recomputations left out), in order."""
        return [record.tokens_per_expert for record in self.records if not record.recomputed]

    def draw(self, dispatcher: Any, num_tokens: int, num_experts: int) -> torch.Tensor:
        """A real ``[num_tokens, num_experts]`` boolean routing map (CPU) from random logits, with the router's
        top-k and score function (``dispatcher.config``)."""
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        config = dispatcher.config
        logits = torch.randn(num_tokens, num_experts, dtype=torch.float32, device="cpu")
        _, routing_map = topk_routing_with_score_function(
            logits, config.moe_router_topk, use_pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor, score_function=config.moe_router_score_function,
            expert_bias=None, fused=False,
        )
        return routing_map

    def record(self, dispatcher: Any, tokens_per_expert: torch.Tensor) -> None:
        recomputed = torch._C._current_graph_task_id() != -1  # drawn inside backward: a recomputed forward
        self.records.append(RoutingRecord(self._layer_numbers.get(dispatcher), tuple(tokens_per_expert.tolist()),
                                          recomputed))


def _dispatch_postprocess_replacement(original: Any, routing: MetaRouting) -> Any:
    @functools.wraps(original)
    def dispatch_postprocess(self: Any, hidden_states: torch.Tensor, probs: torch.Tensor) -> Any:
        """Upstream's dispatch_postprocess, with the routing drawn on the CPU for meta inputs (chameleon-dist)."""
        if hidden_states.device.type != "meta":
            return original(self, hidden_states, probs)
        device = hidden_states.device
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()  # meta, as upstream (unpermute's routing_map)
        local_probs = probs[:, first:last].contiguous()
        drawn = routing.draw(self, *self.routing_map.shape)[:, first:last]
        tokens_per_expert = drawn.sum(dim=0).long()  # on the CPU, as upstream's .cpu() leaves it
        routing.record(self, tokens_per_expert)
        num_tokens = drawn.shape[0]
        # Expert-major positions of the routed (expert, token) pairs: the order of upstream's masked_select over
        # the transposed map, for the token indices (permute) and for the probabilities alike.
        picked = drawn.T.contiguous().view(-1).nonzero().squeeze(1)
        sorted_indices = (picked % num_tokens).to(device)
        permuted = hidden_states.index_select(0, sorted_indices)
        self.reversed_local_input_permutation_mapping = sorted_indices
        self.local_probs = local_probs.T.contiguous().view(-1).index_select(0, picked.to(device))
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs

    return dispatch_postprocess


META_DISPATCH_POSTPROCESS = Patch(
    name="megatron-moe-dispatch-routes-meta-tokens",
    target="megatron.core.transformer.moe.token_dispatcher:MoEAllGatherTokenDispatcher.dispatch_postprocess",
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "The allgather dispatcher copies the tokens per expert to the host (.cpu()) and permutes with masked_select, "
        "whose size depends on the data: neither runs on meta tensors. For meta inputs the replacement draws real "
        "top-k routing (Megatron's topk_routing_with_score_function) over random CPU logits from the CPU generator "
        "(which recomputation replays), gives the experts those CPU counts, and gathers the meta tokens and "
        "probabilities with index_select at the routed positions (upstream's masked_select order); other inputs go "
        "to the original. Applied by meta_models.meta_schedule_step (or meta_routing_patches) only."
    ),
    remove_when="Megatron-core offers a routing hook for shape-only runs, or models on meta tensors are dropped",
    fingerprint="d38d348cfe8891bc",
    make_replacement=unbound_replacement("megatron-moe-dispatch-routes-meta-tokens", _NEEDS),
)

META_PATCHES: tuple[Patch, ...] = (META_DISPATCH_POSTPROCESS,)


def meta_routing_patches(routing: MetaRouting) -> tuple[Patch, ...]:
    """The meta routing patches bound to ``routing`` (apply them with ``apply_patches``)."""

    def make_replacement(original: Any) -> Any:
        return _dispatch_postprocess_replacement(original, routing)

    return (dataclasses.replace(META_DISPATCH_POSTPROCESS, make_replacement=make_replacement),)


_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_META_MODELS = "chameleon_dist/integrations/megatron/meta_models.py"
_KEPT_APART_REMOVE_WHEN = "Megatron-core keeps its MoE logging and loss-scale state per model instead of per process"

MOE_LOGGING_TRACKER_KEPT_APART = InstanceChange(
    name="megatron-moe-logging-tracker-kept-apart",
    owner=_MOE_UTILS,
    attributes=("_MOE_LAYER_WISE_LOGGING_TRACKER",),
    how="writes",
    relies_on=(f"{_MOE_UTILS}:get_moe_layer_wise_logging_tracker", f"{_MOE_UTILS}:save_to_aux_losses_tracker"),
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "The process-wide auxiliary-loss tracker keeps one values tensor per loss on the device of the first loss "
        "it saw, and later losses are added into it: a meta session's meta values would break the next CPU run "
        "(and a CPU run's the meta one). A meta session empties the dict (in place) on entry and puts the previous "
        "entries back on exit."
    ),
    remove_when=_KEPT_APART_REMOVE_WHEN,
    fingerprint="92d1648b1438642e",
    defined_in=_META_MODELS,
)

MOE_LOSS_SCALE_KEPT_APART = InstanceChange(
    name="megatron-moe-aux-loss-scale-kept-apart",
    owner=f"{_MOE_UTILS}:MoEAuxLossAutoScaler",
    attributes=("main_loss_backward_scale",),
    how="writes",
    relies_on=(f"{_MOE_UTILS}:MoEAuxLossAutoScaler.set_loss_scale", f"{_MOE_UTILS}:MoEAuxLossAutoScaler.backward"),
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "The schedule sets the auxiliary loss's backward scale on this class attribute, copying into the tensor "
        "already there (made on the device of the first run in the process): a meta scale cannot be copied into a "
        "CPU tensor, nor a CPU run use a meta one. A meta session sets it to None on entry (the first "
        "set_loss_scale then stores the meta scale) and puts the previous value back on exit."
    ),
    remove_when=_KEPT_APART_REMOVE_WHEN,
    fingerprint="675ea1b67374db56",
    defined_in=_META_MODELS,
)

META_INSTANCE_CHANGES: tuple[InstanceChange, ...] = (MOE_LOGGING_TRACKER_KEPT_APART, MOE_LOSS_SCALE_KEPT_APART)
