"""A small Megatron-core ``GPTModel`` that trains on CPU in one process (gloo), deterministically.

Typical use::

    with megatron_cpu_session(seed=1234):
        shape = TransformerShape(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 vocab_size=128, seq_length=32, micro_batch_size=2)
        model = build_gpt(shape, seed=1234)
        loss = gpt_loss(model, synthetic_batch(shape, step=0, seed=1234))
        loss.backward()

The session applies :data:`~chameleon_dist.integrations.megatron.cuda_on_cpu.CPU_PATCHES`, creates the
process group (unless one exists) and Megatron's model-parallel state, and undoes all of it on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from chameleon_dist.integrations.megatron.cuda_on_cpu import cpu_patches
from chameleon_dist.models.shape import TransformerShape
from chameleon_dist.patching import PatchSet, apply_patches

with warnings.catch_warnings():
    # Megatron warns at import that Transformer Engine / Apex are missing; on CPU that is expected.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

logger = logging.getLogger(__name__)

_DROPOUT_FIELDS = ("hidden_dropout", "attention_dropout")

MOE_CPU_SETTINGS: dict[str, Any] = {
    "moe_router_topk": 2,
    "moe_aux_loss_coeff": 1e-2,
    "add_bias_linear": False,  # the local MoE spec has no bias path in its experts
    "moe_token_dispatcher_type": "allgather",
    "moe_grouped_gemm": False,  # grouped GEMM needs Transformer Engine
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
}
"""TransformerConfig fields ``build_gpt(num_experts=...)`` sets for a CPU MoE (overrides still win)."""


@dataclasses.dataclass(frozen=True)
class CpuSession:
    """What :func:`megatron_cpu_session` set up."""

    seed: int
    rank: int
    world_size: int
    created_process_group: bool
    patches: PatchSet


def _init_process_group(stack: contextlib.ExitStack) -> bool:
    """Create a gloo group unless one exists; return whether we created it (and registered its teardown)."""
    if dist.is_initialized():
        return False
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    else:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="chameleon-gloo-"))
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    stack.callback(dist.destroy_process_group)
    return True


@contextlib.contextmanager
def megatron_cpu_session(
    seed: int = 1234,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    current_device: str | torch.device = "cpu",
) -> Iterator[CpuSession]:
    """Run Megatron-core on CPU: CPU patches, gloo process group, model-parallel state, RNG tracker.

    Under torchrun (``MASTER_ADDR``/``MASTER_PORT`` set) the gloo group spans every rank; else it is a
    group of one. The global CPU RNG is seeded with ``seed`` on entry and restored on exit. Everything created here is
    torn down on exit (also on error), so sessions can follow one another in the same process.
    ``current_device="meta"``: the current-device shim answers the meta device (for models built on meta
    tensors, ``meta_models.megatron_meta_session``).
    """
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron model-parallel state is already initialised: exit the other megatron_cpu_session (or "
            "call parallel_state.destroy_model_parallel()) before entering a new one"
        )
    with contextlib.ExitStack() as stack:
        patches = stack.enter_context(apply_patches(cpu_patches(current_device)))
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.manual_seed(seed)
        created = _init_process_group(stack)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
        )
        stack.callback(parallel_state.destroy_model_parallel)
        # The inference tracker never forks RNG states (there is no CUDA RNG to fork): dropout must be 0.
        megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        session = CpuSession(
            seed=seed,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            created_process_group=created,
            patches=patches,
        )
        logger.info(
            "megatron CPU session: rank %d/%d, tp=%d, pp=%d, seed=%d",
            session.rank,
            session.world_size,
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            seed,
        )
        yield session


def transformer_config(shape: TransformerShape, **overrides: Any) -> TransformerConfig:
    """The CPU-safe fp32 ``TransformerConfig`` for ``shape``; ``overrides`` are TransformerConfig fields."""
    for field in _DROPOUT_FIELDS:
        if overrides.get(field, 0.0) != 0.0:
            raise ValueError(
                f"{field}={overrides[field]} is not supported on CPU: the RNG tracker used there does not fork "
                f"RNG states; set {field}=0.0"
            )
    settings: dict[str, Any] = {
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_attention_heads,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        "use_cpu_initialization": True,
        "params_dtype": torch.float32,
        "pipeline_dtype": torch.float32,
        "batch_p2p_comm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_dropout_fusion": False,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "cuda_graph_scope": [],  # no CUDA graphs; an empty list also avoids the deprecated "full" default
    }
    settings.update(overrides)
    return TransformerConfig(**settings)


def build_gpt(
    shape: TransformerShape,
    seed: int = 1234,
    *,
    gpt_kwargs: Mapping[str, Any] | None = None,
    vp_stage: int | None = None,
    num_experts: int | None = None,
    max_sequence_length: int | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """Build a ``GPTModel`` (local layer spec, fp32, no fusions) inside a :func:`megatron_cpu_session`.

    Parameters depend only on ``shape``, ``seed`` and the overrides: building twice gives identical
    parameters. The caller's CPU RNG state is left untouched. ``config_overrides`` go to the
    ``TransformerConfig`` (e.g. ``recompute_granularity="full"``), ``gpt_kwargs`` to ``GPTModel``. Under
    interleaving, build one chunk per ``vp_stage`` (0 .. vpp-1).

    ``num_experts`` makes every MLP a mixture of experts (local MoE layer spec, no grouped GEMM) and sets
    :data:`MOE_CPU_SETTINGS` in the config, under ``config_overrides`` (e.g. ``moe_router_topk=1``).
    ``normalization="RMSNorm"`` selects torch's RMSNorm in the local spec; with ``sequence_parallel=True`` the
    norms are :class:`SequenceParallelNorm` (the local spec's torch norms refuse sequence parallelism, since their
    weights' gradients would never be all-reduced over the tensor-parallel ranks). ``max_sequence_length``: the
    position embedding's table (default ``shape.seq_length``).
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_gpt needs Megatron's model-parallel state: enter megatron_cpu_session() first")
    layer_spec = _layer_spec(num_experts, config_overrides)
    if num_experts is not None:
        config_overrides = {**MOE_CPU_SETTINGS, "num_moe_experts": num_experts, **config_overrides}
    config = transformer_config(shape, **config_overrides)
    if config.sequence_parallel:
        layer_spec = _sequence_parallel_block(layer_spec, config, vp_stage)
    interleaved = vp_stage is not None
    kwargs: dict[str, Any] = {
        "pre_process": parallel_state.is_pipeline_first_stage(ignore_virtual=not interleaved, vp_stage=vp_stage),
        "post_process": parallel_state.is_pipeline_last_stage(ignore_virtual=not interleaved, vp_stage=vp_stage),
    }
    if interleaved:
        kwargs["vp_stage"] = vp_stage
    kwargs.update(gpt_kwargs or {})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=shape.vocab_size,
            max_sequence_length=shape.seq_length if max_sequence_length is None else max_sequence_length,
            **kwargs,
        )
    return model


def _layer_spec(num_experts: int | None, config_overrides: Mapping[str, Any]) -> Any:
    """The local layer spec: dense, or with ``num_experts`` experts per MLP."""
    if "num_moe_experts" in config_overrides:
        raise ValueError("pass num_experts= to build_gpt instead of the num_moe_experts override: it also "
                         "selects the MoE layer spec")
    normalization = config_overrides.get("normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization={normalization!r}: the local spec runs LayerNorm or RMSNorm")
    if num_experts is None:
        return get_gpt_layer_local_spec(normalization=normalization)
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1 (or None for dense MLPs)")
    if config_overrides.get("moe_grouped_gemm", False):
        raise ValueError("moe_grouped_gemm=True needs Transformer Engine's grouped GEMM; leave moe_grouped_gemm=False")
    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization=normalization)


class SequenceParallelNorm:
    """The local spec's torch ``LayerNorm`` / ``RMSNorm`` (``config.normalization``), with its parameters marked
    ``sequence_parallel`` as Megatron's fused norms mark theirs: under sequence parallelism each tensor-parallel
    rank normalises its part of the sequence, and ``finalize_model_grads`` all-reduces the gradients of the
    parameters so marked. (``WrappedTorchNorm`` refuses ``sequence_parallel`` for want of that mark.)"""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> torch.nn.Module:
        norm_class = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_class(normalized_shape=hidden_size, eps=eps)
        for parameter in norm.parameters():
            parameter.sequence_parallel = config.sequence_parallel
        return norm


def _sequence_parallel_block(layer_spec: ModuleSpec, config: TransformerConfig, vp_stage: int | None) -> Any:
    """The block of this stage's layers, with :class:`SequenceParallelNorm` where the local spec has torch norms."""
    changes = {name: SequenceParallelNorm for name in ("input_layernorm", "pre_mlp_layernorm")
               if getattr(layer_spec.submodules, name, None) is WrappedTorchNorm}
    layer_spec = dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, **changes))
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelNorm)


def synthetic_batch(shape: TransformerShape, step: int, seed: int) -> dict[str, torch.Tensor]:
    """A deterministic micro-batch made locally from ``(seed, step)``; nothing is downloaded.

    Each sequence follows ``next = (a * token + c) mod vocab_size`` from a random start, with ``a`` and
    ``c`` fixed by ``seed``: a next-token rule the model can learn, so the loss falls. Keys: ``tokens``,
    ``labels`` (``[b, s]`` int64), ``position_ids`` (``[b, s]``), ``attention_mask`` (``[1, 1, s, s]`` bool,
    True = masked), ``loss_mask`` (``[b, s]`` float32).
    """
    b, s, vocab = shape.micro_batch_size, shape.seq_length, shape.vocab_size
    rule = torch.Generator().manual_seed(seed)
    multiplier = 2 * int(torch.randint(0, max(vocab // 2, 1), (1,), generator=rule)) + 1
    offset = int(torch.randint(0, vocab, (1,), generator=rule))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    seq = torch.empty(b, s + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, vocab, (b,), generator=gen)
    for i in range(s):
        seq[:, i + 1] = (seq[:, i] * multiplier + offset) % vocab
    return {
        "tokens": seq[:, :-1].contiguous(),
        "labels": seq[:, 1:].contiguous(),
        "position_ids": torch.arange(s, dtype=torch.int64).unsqueeze(0).expand(b, s).contiguous(),
        "attention_mask": torch.ones(s, s, dtype=torch.bool).triu(diagonal=1).view(1, 1, s, s),
        "loss_mask": torch.ones(b, s, dtype=torch.float32),
    }


def gpt_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the unmasked tokens of ``batch`` (a scalar).

    For a model holding the whole network (no pipeline split); a pipeline stage uses Megatron's schedules.
    """
    per_token = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
    )
    loss_mask = batch.get("loss_mask")
    if loss_mask is None:
        return per_token.float().mean()
    loss_mask = loss_mask.to(per_token.dtype)
    return (per_token.float() * loss_mask).sum() / loss_mask.sum()
