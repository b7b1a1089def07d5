"""Megatron-core ``GPTModel`` at real LLM shapes on meta tensors (sizes only, no data), and Megatron's own schedule
over it, forward and backward.

Typical use::

    with megatron_meta_session():
        model = build_meta_gpt(load_model("llama2-7b"), seq_length=4096)
        meta_schedule_step(model, micro_batches=2)                        # forward and backward, on meta
        with my_context():                                                # a runtime, a dispatch mode, ...
            meta_schedule_step(model, micro_batches=2, forward_backward_func=my_wrapper(get_forward_backward_func()))

What Megatron needs for that (each through ``chameleon_dist.patching``):

- the CPU shims (``cuda_on_cpu.CPU_PATCHES``), with the current-device shim answering the *meta* device
  (``current_device_is``): the attention workspace (``GlobalMemoryBuffer``), the rotary table and other buffers
  Megatron makes on "the current device" are then meta as well;
- ``CudaLiteralsToCpu`` around the schedule: it counts tokens in ``torch.zeros(..., device="cuda")``; the loss
  function returns ``(loss, report)``, not ``(loss, num_tokens, report)``, since that CPU count cannot add a meta one;
- the attention mask is a meta tensor (with ``attention_mask=None`` Megatron's unfused softmax builds a causal mask
  on the CPU);
- for mixtures of experts, routing drawn on the CPU (``meta_routing.META_DISPATCH_POSTPROCESS``, applied only while
  :func:`meta_schedule_step` runs), and Megatron's process-wide MoE state kept apart from CPU runs
  (``meta_routing.META_INSTANCE_CHANGES``, made by :func:`megatron_meta_session`).

Megatron's local (non-Transformer-Engine) ``DotProductAttention`` is the only training attention without Transformer
Engine: it materialises the ``[b * heads, s, s]`` scores (``baddbmm`` into the workspace), their fp32 softmax and
the bf16 probabilities, which the ``bmm`` with the values saves for backward. Megatron-core has no flash-style path
without Transformer Engine (its ``flash_attn`` calls are inference-only; the local spec's ``sdpa`` backend needs
NVIDIA's Kitchen package), so the models keep it. Measured on Llama2-7B at s=4096, one sequence, no recompute: each
layer saves 3 GiB of ``s x s`` tensors (the fp32 softmax output, 2 GiB, and the bf16 probabilities, 1 GiB; 96 GiB over
32 layers) besides about 0.9 GiB of everything else (30 GiB in all); flash attention would save none of them.
Selective recompute (``core_attn``) removes exactly those.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from chameleon_dist.integrations.megatron.cuda_on_cpu import CudaLiteralsToCpu, shimmed_current_device
from chameleon_dist.integrations.megatron.fused_attention import FusedDotProductAttention
from chameleon_dist.integrations.megatron.gpt import (
    MOE_CPU_SETTINGS, CpuSession, megatron_cpu_session, transformer_config,
)
from chameleon_dist.integrations.megatron.meta_routing import META_INSTANCE_CHANGES, MetaRouting, meta_routing_patches
from chameleon_dist.models.shape import TransformerShape
from chameleon_dist.patching import apply_patches, verify_instance_changes
from chameleon_dist.planner.profiles import ModelProfile

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    from megatron.core.utils import get_attr_wrapped_model

logger = logging.getLogger(__name__)

META = torch.device("meta")
RECOMPUTE_CHOICES = (None, "selective", "full")
ATTENTION_CHOICES = ("fused", "local")
_BUILD_ATTR = "chameleon_meta"  # chameleon-dist's own attribute on the models it builds


@dataclasses.dataclass(frozen=True)
class MetaBuild:
    """How :func:`build_meta_gpt` built a model (``meta_build_of(model)``); ``routing`` for a mixture of experts."""

    profile: str
    num_layers: int
    pre_process: bool
    post_process: bool
    seq_length: int
    micro_batch_size: int
    recompute: str | None
    dtype: torch.dtype
    routing: MetaRouting | None


@contextlib.contextmanager
def megatron_meta_session(seed: int = 0) -> Iterator[CpuSession]:
    """Megatron on meta tensors: a single-rank gloo world (unless one exists; torchrun's under torchrun),
    ``initialize_model_parallel(1, 1)``, the CPU shims (the current-device shim answering the meta
    device), and Megatron's process-wide MoE logging and loss-scale state emptied on entry and put back on exit.
    Everything is undone on exit (also on error)."""
    verify_instance_changes(META_INSTANCE_CHANGES)
    with megatron_cpu_session(seed, current_device=META) as session, _moe_state_kept_apart():
        yield session


@contextlib.contextmanager
def _moe_state_kept_apart() -> Iterator[None]:
    """The change ``meta_routing.META_INSTANCE_CHANGES`` declares."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()  # moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER
    scaler = moe_utils.MoEAuxLossAutoScaler
    saved_tracker, saved_scale = dict(tracker), scaler.main_loss_backward_scale
    tracker.clear()
    scaler.main_loss_backward_scale = None
    try:
        yield
    finally:
        tracker.clear()
        tracker.update(saved_tracker)
        scaler.main_loss_backward_scale = saved_scale


def _require_meta_session(what: str) -> None:
    if not parallel_state.model_parallel_is_initialized() or shimmed_current_device() != META:
        raise RuntimeError(f"{what} needs Megatron on the meta device: enter megatron_meta_session() first")


def _recompute_settings(recompute: str | None) -> dict[str, Any]:
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute={recompute!r}: use one of {RECOMPUTE_CHOICES}")
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def meta_transformer_config(profile: ModelProfile, *, num_layers: int, seq_length: int, micro_batch_size: int = 1,
                            recompute: str | None = None, dtype: torch.dtype = torch.bfloat16,
                            **overrides: Any) -> Any:
    """The ``TransformerConfig`` of ``num_layers`` layers of ``profile``: grouped-query attention, RMSNorm or
    LayerNorm, SwiGLU or GeLU, biases as the profile says, no dropout, no fusions, parameters in ``dtype``, Megatron's
    own recompute settings (``recompute``), experts with top-k routing and the allgather dispatcher for an MoE."""
    if profile.dropout:
        raise ValueError(f"profile {profile.name}: dropout={profile.dropout} is not supported on meta; use 0")
    swiglu = profile.activation == "swiglu"
    settings: dict[str, Any] = {
        "num_query_groups": profile.query_groups,
        "normalization": "RMSNorm" if profile.normalization == "rmsnorm" else "LayerNorm",
        "gated_linear_unit": swiglu,
        "activation_func": F.silu if swiglu else F.gelu,
        "add_bias_linear": profile.add_bias_linear,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "perform_initialization": False,  # nothing to initialise on meta
        **_recompute_settings(recompute),
    }
    if profile.is_moe:
        if profile.add_bias_linear:
            raise ValueError(f"profile {profile.name}: add_bias_linear=true with experts: the local MoE spec has no "
                             "bias path; set add_bias_linear: false")
        settings.update(MOE_CPU_SETTINGS, num_moe_experts=profile.num_experts, moe_router_topk=profile.moe_router_topk)
    settings.update(overrides)
    _check_meta_routing_settings(settings)
    shape = TransformerShape(num_layers=num_layers, hidden_size=profile.hidden_size,
                             num_attention_heads=profile.num_attention_heads, ffn_hidden_size=profile.ffn_hidden_size,
                             vocab_size=profile.vocab_size, seq_length=seq_length, micro_batch_size=micro_batch_size)
    return transformer_config(shape, **settings)


def _check_meta_routing_settings(settings: Mapping[str, Any]) -> None:
    """What the meta routing draw (top-k over random logits, allgather dispatcher) cannot follow."""
    if not settings.get("num_moe_experts"):
        return
    problems = {
        "moe_token_dispatcher_type": settings.get("moe_token_dispatcher_type") != "allgather",
        "moe_expert_capacity_factor": settings.get("moe_expert_capacity_factor") is not None,
        "moe_router_enable_expert_bias": bool(settings.get("moe_router_enable_expert_bias")),
        "moe_router_load_balancing_type": settings.get("moe_router_load_balancing_type") == "sinkhorn",
    }
    bad = [name for name, wrong in problems.items() if wrong]
    if bad:
        raise ValueError(f"{', '.join(bad)}: routing on meta draws top-k routing for the allgather dispatcher, "
                         "without token dropping, expert bias or sinkhorn; leave these settings at their defaults")


def build_meta_gpt(profile: ModelProfile, *, num_layers: int | None = None, pre_process: bool = True,
                   post_process: bool = True, seq_length: int, micro_batch_size: int = 1,
                   recompute: str | None = None, dtype: torch.dtype = torch.bfloat16, moe_routing_seed: int = 0,
                   attention: str = "fused", **config_overrides: Any) -> GPTModel:
    """A Megatron-core ``GPTModel`` of ``profile`` whose parameters are meta tensors, inside a
    :func:`megatron_meta_session` (TP1, PP1).

    ``num_layers`` (default: all of the profile's) makes a pipeline stage: ``pre_process`` gives it the embedding,
    ``post_process`` the final norm and the output layer (untied unless the profile ties them). Rotary or learned
    positions as the profile says, ``max_sequence_length=seq_length``. Parameters are in ``dtype``, norms and the
    router included (as Megatron's ``Float16Module`` leaves them: ``module.bfloat16()``). ``recompute``: None,
    ``"selective"`` (Megatron's ``core_attn``) or ``"full"`` (uniform, one layer per checkpoint).
    ``micro_batch_size`` and ``seq_length`` are the defaults of :func:`meta_schedule_step`. An MoE profile's model
    routes with a :class:`MetaRouting` seeded with ``moe_routing_seed``. ``attention``: ``"fused"`` (default:
    ``FusedDotProductAttention``, what a GPU run with Transformer Engine's flash attention saves) or ``"local"``
    (Megatron's own ``DotProductAttention``, which saves the s x s probabilities). ``config_overrides`` go to the
    ``TransformerConfig``.
    """
    _require_meta_session("build_meta_gpt")
    layers = profile.num_layers if num_layers is None else num_layers
    if not 1 <= layers <= profile.num_layers:
        raise ValueError(f"num_layers={layers}: profile {profile.name} has 1..{profile.num_layers} layers")
    if seq_length < 1 or micro_batch_size < 1:
        raise ValueError(f"seq_length={seq_length}, micro_batch_size={micro_batch_size}: both must be >= 1")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}: parameters need a floating-point dtype")
    config = meta_transformer_config(profile, num_layers=layers, seq_length=seq_length,
                                     micro_batch_size=micro_batch_size, recompute=recompute, dtype=dtype,
                                     **config_overrides)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    normalization=config.normalization)
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention={attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
    if attention == "fused":
        spec.submodules.self_attention.submodules.core_attention = FusedDotProductAttention
    with torch.device(META):
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=profile.vocab_size,
            max_sequence_length=seq_length, pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=profile.tie_embeddings,
            position_embedding_type="rope" if profile.position_embedding == "rope" else "learned_absolute",
        )
    model.to(dtype)  # torch's norms and the router are made in fp32
    routing = MetaRouting(moe_routing_seed) if config.num_moe_experts else None
    for module in model.modules():
        if isinstance(module, MoELayer):
            if not isinstance(module.token_dispatcher, MoEAllGatherTokenDispatcher):
                raise ValueError("routing on meta needs moe_token_dispatcher_type='allgather'")
            routing.register(module.token_dispatcher, module.layer_number)
    setattr(model, _BUILD_ATTR, MetaBuild(profile.name, layers, pre_process, post_process, seq_length,
                                          micro_batch_size, recompute, dtype, routing))
    logger.info("built %s on meta: %d of %d layers%s%s, %.3g parameters, seq %d, recompute %s", profile.name, layers,
                profile.num_layers, ", embedding" if pre_process else "", ", head" if post_process else "",
                parameter_count(model), seq_length, recompute)
    return model


def meta_build_of(model: Any) -> MetaBuild:
    """How :func:`build_meta_gpt` built ``model`` (also through Megatron's wrappers: DDP, Float16Module)."""
    try:
        return get_attr_wrapped_model(model, _BUILD_ATTR)
    except RuntimeError:
        raise ValueError(f"{type(model).__name__} was not built by build_meta_gpt") from None


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_batch(model: Any, *, seq_length: int, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """One synthetic micro-batch on meta: ``tokens``, ``labels``, ``position_ids`` (``[b, s]`` int64),
    ``attention_mask`` (``[1, 1, s, s]`` bool), ``loss_mask`` (``[b, s]`` float32); for a stage without the
    embedding also ``input_hidden_states`` (``[s, b, hidden]`` in the parameters' dtype, requiring grad), what the
    previous stage would send."""
    b, s = micro_batch_size, seq_length
    batch = {
        "tokens": torch.empty(b, s, dtype=torch.int64, device=META),
        "labels": torch.empty(b, s, dtype=torch.int64, device=META),
        "position_ids": torch.empty(b, s, dtype=torch.int64, device=META),
        "attention_mask": torch.empty(1, 1, s, s, dtype=torch.bool, device=META),
        "loss_mask": torch.empty(b, s, dtype=torch.float32, device=META),
    }
    build = meta_build_of(model)
    if not build.pre_process:
        hidden = get_attr_wrapped_model(model, "config").hidden_size
        batch["input_hidden_states"] = torch.empty(s, b, hidden, dtype=build.dtype, device=META, requires_grad=True)
    return batch


def meta_loss(loss_mask: torch.Tensor | None, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss function the schedule is handed: with the head, the masked mean of the per-token losses; without
    it, the sum of the stage's output hidden states (its backward sends a gradient of their shape, as the next stage
    would). Nothing data-dependent: ``(loss, report)`` with the report a detached copy (the schedule divides the
    loss in place)."""
    if loss_mask is None:
        loss = output.sum()
        return loss, {"output sum": loss.detach().clone()}
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def meta_forward_step(data_iterator: Iterator[Mapping[str, torch.Tensor]], model: Any) -> tuple[torch.Tensor, Callable]:
    """Megatron's ``forward_step_func`` for :func:`meta_batch` micro-batches."""
    batch = next(data_iterator)
    build = meta_build_of(model)
    if not build.pre_process:
        get_attr_wrapped_model(model, "set_input_tensor")(batch["input_hidden_states"])
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"] if build.post_process else None)
    return output, functools.partial(meta_loss, batch["loss_mask"] if build.post_process else None)


def meta_schedule_step(model: Any, *, micro_batches: int, seq_length: int | None = None,
                       micro_batch_size: int | None = None, iteration: int | None = None,
                       forward_backward_func: Callable[..., Any] | None = None) -> list[dict[str, torch.Tensor]]:
    """One iteration of Megatron's own schedule (``get_forward_backward_func()``; no pipelining at PP1) over
    ``micro_batches`` :func:`meta_batch` micro-batches, forward and backward; returns the schedule's per-micro-batch
    reports (meta scalars). Gradients accumulate in the parameters' ``.grad`` (meta).

    ``seq_length`` / ``micro_batch_size`` default to the build's. ``forward_backward_func``: the schedule to run
    (e.g. a runtime's wrapper of ``get_forward_backward_func()``); call this inside any context the step should run
    in. For an MoE model the routing is drawn from the CPU generator seeded with ``(moe_routing_seed, iteration)``
    (``iteration`` defaults to one more than the last step's, from 0) inside ``torch.random.fork_rng``; the caller's
    RNG state is left as it was. ``MetaRouting.records`` then holds this iteration's tokens per expert.
    """
    _require_meta_session("meta_schedule_step")
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1")
    build = meta_build_of(model)
    seq_length = build.seq_length if seq_length is None else seq_length
    micro_batch_size = build.micro_batch_size if micro_batch_size is None else micro_batch_size
    schedule = forward_backward_func or get_forward_backward_func()
    routing = build.routing
    batches = iter([meta_batch(model, seq_length=seq_length, micro_batch_size=micro_batch_size)
                    for _ in range(micro_batches)])
    with contextlib.ExitStack() as stack:
        seed = 0
        if routing is not None:
            routing.begin_iteration(routing.next_iteration if iteration is None else iteration)
            seed = routing.seed_for(routing.iteration)
            stack.enter_context(apply_patches(meta_routing_patches(routing)))
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.manual_seed(seed)
        stack.enter_context(CudaLiteralsToCpu())  # the schedule counts tokens in a device="cuda" tensor
        return schedule(forward_step_func=meta_forward_step, data_iterator=batches, model=model,
                        num_microbatches=micro_batches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        forward_only=False)
