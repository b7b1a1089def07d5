"""Shims that let Megatron-core's GPT model run on a CPU-only torch build (gloo, no CUDA).

This is the one module besides ``chameleon_dist/device/cuda.py`` allowed to name ``torch.cuda``: it exists
to replace the ``torch.cuda`` calls Megatron-core makes. Nothing here imports Megatron and nothing is
patched at import: :data:`CPU_PATCHES` are definitions, applied through
:func:`chameleon_dist.patching.apply_patches` (``megatron_cpu_session`` does that).

:class:`CudaLiteralsToCpu` is not a patch but a ``TorchFunctionMode`` that turns ``device="cuda"``
literals (e.g. in Megatron's pipeline schedules) into CPU; enter it only around the call that needs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from chameleon_dist.patching import Patch

_CPU = torch.device("cpu")
_TORCH_VERSIONS = ">=2.6,<2.14"
_MEGATRON_VERSIONS = ">=0.16,<0.17"


def _make_current_device(original: Any) -> Any:
    def current_device() -> torch.device:
        """CPU stand-in for torch.cuda.current_device (installed by chameleon-dist)."""
        return _CPU

    return current_device


def _make_get_rng_state(original: Any) -> Any:
    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        """CPU stand-in for Megatron's CUDA RNG state getter (installed by chameleon-dist)."""
        if graph_safe:
            raise RuntimeError(
                "graph-safe (CUDA graph) RNG state is not available on CPU: set use_cudagraphable_rng=False "
                "and cuda_graph_impl='none' in the TransformerConfig"
            )
        return torch.get_rng_state()

    return _get_cuda_rng_state


def _make_set_rng_state(original: Any) -> Any:
    def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        """CPU stand-in for Megatron's CUDA RNG state setter (installed by chameleon-dist)."""
        if graph_safe:
            raise RuntimeError(
                "graph-safe (CUDA graph) RNG state is not available on CPU: set use_cudagraphable_rng=False "
                "and cuda_graph_impl='none' in the TransformerConfig"
            )
        torch.set_rng_state(new_state)

    return _set_cuda_rng_state


def _make_default_causal_mask(original: Any) -> Any:
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        """CPU causal mask, True above the diagonal (installed by chameleon-dist)."""
        return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)

    return get_default_causal_mask


def _make_router_gating_linear(original: Any) -> Any:
    def router_gating_linear(
        inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, router_dtype: torch.dtype
    ) -> torch.Tensor:
        """Router logits from plain torch ops, autograd included (installed by chameleon-dist)."""
        rows = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
        transposed = weight.to(router_dtype).t()
        if bias is None:
            logits = torch.mm(rows, transposed)
        else:
            logits = torch.addmm(bias.to(router_dtype), rows, transposed)
        return logits.view(*inp.shape[:-1], logits.shape[-1])

    return router_gating_linear


CURRENT_DEVICE_IS_CPU = Patch(
    name="cuda-current-device-is-cpu",
    target="torch.cuda:current_device",
    package="torch",
    versions=_TORCH_VERSIONS,
    why=(
        "Megatron-core allocates with device=torch.cuda.current_device() (GlobalMemoryBuffer used by "
        "attention, KV/inference buffers, pipeline p2p shape exchange); on a CPU-only torch build the call "
        "raises. Megatron looks it up on the torch.cuda module, so there is no Megatron attribute to patch."
    ),
    remove_when="Megatron-core takes its device from a configurable accessor, or CPU runs are dropped",
    fingerprint="6e9804168a5c7f8c",
    make_replacement=_make_current_device,
)

MEGATRON_RNG_GET_IS_CPU = Patch(
    name="megatron-cuda-rng-get-is-cpu",
    target="megatron.core.tensor_parallel.random:_get_cuda_rng_state",
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "Activation recomputation (CheckpointFunction) and the RNG tracker save the CUDA RNG state through "
        "this function; on CPU it is mapped to the CPU generator so recompute replays the same state."
    ),
    remove_when="Megatron-core's RNG helpers accept a CPU device",
    fingerprint="aa26caaa069c5c4f",
    make_replacement=_make_get_rng_state,
)

MEGATRON_RNG_SET_IS_CPU = Patch(
    name="megatron-cuda-rng-set-is-cpu",
    target="megatron.core.tensor_parallel.random:_set_cuda_rng_state",
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why="Counterpart of megatron-cuda-rng-get-is-cpu: restoring the saved state goes to the CPU generator.",
    remove_when="Megatron-core's RNG helpers accept a CPU device",
    fingerprint="b179c9d95438b61c",
    make_replacement=_make_set_rng_state,
)

MEGATRON_CAUSAL_MASK_ON_CPU = Patch(
    name="megatron-default-causal-mask-on-cpu",
    target="megatron.core.fusions.fused_softmax:get_default_causal_mask",
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "With attention_mask=None and a causal mask type, the unfused softmax builds its mask with "
        'device="cuda"; the replacement builds the same mask on CPU.'
    ),
    remove_when="Megatron-core builds the default mask on the input's device",
    fingerprint="4638b2c6665fc284",
    make_replacement=_make_default_causal_mask,
)

MEGATRON_ROUTER_GATING_LINEAR_ON_CPU = Patch(
    name="megatron-router-gating-linear-on-cpu",
    target="megatron.core.transformer.moe.router:router_gating_linear",
    package="megatron-core",
    versions=_MEGATRON_VERSIONS,
    why=(
        "The MoE router computes its logits through an autograd Function in moe_utils whose forward and "
        "backward test the name te_general_gemm, bound only when Transformer Engine imports; without it "
        "every MoE forward raises NameError. The replacement (for the name router.py imported) is a matmul "
        "on the 2-D view of the input in the router dtype, differentiated by autograd; it saves the "
        "router-dtype copies for backward where upstream saves the originals (the same tensors in fp32)."
    ),
    remove_when="Megatron-core binds te_general_gemm (to None) when Transformer Engine is missing",
    fingerprint="0f5202718b1c7c59",
    make_replacement=_make_router_gating_linear,
)

CPU_PATCHES: tuple[Patch, ...] = (
    CURRENT_DEVICE_IS_CPU,
    MEGATRON_RNG_GET_IS_CPU,
    MEGATRON_RNG_SET_IS_CPU,
    MEGATRON_CAUSAL_MASK_ON_CPU,
    MEGATRON_ROUTER_GATING_LINEAR_ON_CPU,
)


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    return isinstance(value, torch.device) and value.type == "cuda"


class CudaLiteralsToCpu(TorchFunctionMode):
    """Turn ``device="cuda"`` (keyword or positional ``.to("cuda")``), ``.cuda()`` and ``.pin_memory()``
    into CPU no-ops while active. Enter it only around calls that hard-code CUDA (pipeline schedules)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)
        if func is torch.Tensor.to and any(_is_cuda_device(a) for a in args[1:]):
            args = tuple(_CPU if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)
