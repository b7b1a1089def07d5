"""Shims that let Megatron-core's GPT model run on a CPU-only torch build (gloo, no CUDA).

This is the one module besides ``chameleon_dist/device/cuda.py`` allowed to name ``torch.cuda``: it exists
to replace the ``torch.cuda`` calls Megatron-core makes. Nothing here imports Megatron and nothing is
patched at import: :data:`CPU_PATCHES` are definitions, applied through
:func:`chameleon_dist.patching.apply_patches` (``megatron_cpu_session`` does that).

:class:`CudaLiteralsToCpu` is not a patch but a ``TorchFunctionMode`` that turns ``device="cuda"``
literals (e.g. in Megatron's pipeline schedules) into CPU; enter it only around the call that needs it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from chameleon_dist.patching import Patch, upstream_original

_CPU = torch.device("cpu")
_TORCH_VERSIONS = ">=2.6,<2.14"
_MEGATRON_VERSIONS = ">=0.16,<0.17"


def _make_current_device_is(device: torch.device) -> Any:
    def make_replacement(original: Any) -> Any:
        def current_device() -> torch.device:
            """Stand-in for torch.cuda.current_device answering a fixed device (installed by chameleon-dist)."""
            return device

        return current_device

    return make_replacement


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
        "raises. Megatron looks it up on the torch.cuda module, so there is no Megatron attribute to patch. "
        "Returns the CPU device (the meta device in a session for models on meta tensors: current_device_is)."
    ),
    remove_when="Megatron-core takes its device from a configurable accessor, or CPU runs are dropped",
    fingerprint="6e9804168a5c7f8c",
    make_replacement=_make_current_device_is(_CPU),
)


def current_device_is(device: str | torch.device) -> Patch:
    """:data:`CURRENT_DEVICE_IS_CPU` answering ``device``: the record itself for the CPU, else a copy bound to
    ``device`` (the meta device, for Megatron models built on meta tensors: their workspaces, rotary tables and
    buffers are then made on meta too). Same name, target and fingerprint: it is the same reviewed patch."""
    device = torch.device(device)
    if device == _CPU:
        return CURRENT_DEVICE_IS_CPU
    if device.type != "meta":
        raise ValueError(f"current_device={str(device)!r}: the CPU shims answer the CPU or the meta device")
    return dataclasses.replace(CURRENT_DEVICE_IS_CPU, make_replacement=_make_current_device_is(device))


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

def _make_runs_on_cpu(original: Any) -> Any:
    @functools.wraps(original)
    def runs_on_cpu(*args: Any, **kwargs: Any) -> Any:
        """Runs the Megatron function under CudaLiteralsToCpu(cuda_type_names=True) (installed by chameleon-dist)."""
        with CudaLiteralsToCpu(cuda_type_names=True):
            return original(*args, **kwargs)

    return runs_on_cpu


_OPTIMIZER_REMOVE_WHEN = "Megatron-core's optimizers take their device from the parameters (or CPU runs are dropped)"
_OPTIMIZER_CPU_TARGETS: tuple[tuple[str, str, str, str], ...] = (
    ("megatron-grad-scaler-on-cpu", "grad_scaler:MegatronGradScaler.__init__", "6c9849a1e16b717b",
     "The loss scale is made with device='cuda'."),
    ("megatron-dynamic-grad-scaler-on-cpu", "grad_scaler:DynamicGradScaler.__init__", "e842137264937a93",
     "The dynamic loss scaler's minimum, growth and backoff factors are made with device='cuda'."),
    ("megatron-mixed-precision-optimizer-on-cpu", "optimizer:MixedPrecisionOptimizer.__init__", "9bde63c621a02c7c",
     "found_inf, the overflow buffer and the unit scale are made with device='cuda'."),
    ("megatron-float16-optimizer-on-cpu", "optimizer:Float16OptimizerWithFloat16Params.__init__", "fe98719f827f4f1e",
     "Parameters are sorted by tensor.type() == 'torch.cuda.{Half,BFloat16,Float}Tensor'; any other is refused."),
    ("megatron-distributed-optimizer-on-cpu", "distrib_optimizer:DistributedOptimizer.__init__", "9065c18bc9116278",
     "16-bit parameters are recognised by tensor.type() == 'torch.cuda.{Half,BFloat16}Tensor' here and in the "
     "_build_model_and_main_param_groups it calls, which makes the main-parameter shards and refuses any other "
     "type name."),
    ("megatron-grad-norm-on-cpu", "optimizer:get_grad_norm_fp32", "7fa2ba2493d43f1d",
     "The gradient norm is reduced in a tensor made with device='cuda' (the name optimizer.py imported)."),
    ("megatron-clip-grad-on-cpu", "optimizer:clip_grad_by_total_norm_fp32", "8edb9da5365045a5",
     "Asserts grad.type() == 'torch.cuda.FloatTensor' and makes its overflow buffer with device='cuda' (the name "
     "optimizer.py imported)."),
    ("megatron-count-zeros-on-cpu", "optimizer:count_zeros_fp32", "13c3d83b24659503",
     "Counts into a tensor made with device='cuda' (the name optimizer.py imported; log_num_zeros_in_grad)."),
)

OPTIMIZER_CPU_PATCHES: tuple[Patch, ...] = tuple(
    Patch(
        name=name,
        target=f"megatron.core.optimizer.{target}",
        package="megatron-core",
        versions=_MEGATRON_VERSIONS,
        why=f"{what} On CPU the function runs under CudaLiteralsToCpu(cuda_type_names=True): CUDA literals make CPU "
            "tensors and tensor.type() answers the CUDA type's name, so Megatron's mixed-precision and distributed "
            "optimizers (and their loss scalers and gradient clipping) run unchanged on CPU tensors.",
        remove_when=_OPTIMIZER_REMOVE_WHEN,
        fingerprint=fingerprint,
        make_replacement=_make_runs_on_cpu,
    )
    for name, target, fingerprint, what in _OPTIMIZER_CPU_TARGETS
)
"""Megatron's optimizer on CPU: each function that hard-codes CUDA runs under :class:`CudaLiteralsToCpu` with
CUDA type names."""

CPU_PATCHES: tuple[Patch, ...] = (
    CURRENT_DEVICE_IS_CPU,
    MEGATRON_RNG_GET_IS_CPU,
    MEGATRON_RNG_SET_IS_CPU,
    MEGATRON_CAUSAL_MASK_ON_CPU,
    MEGATRON_ROUTER_GATING_LINEAR_ON_CPU,
    *OPTIMIZER_CPU_PATCHES,
)


def cpu_patches(current_device: str | torch.device = "cpu") -> tuple[Patch, ...]:
    """:data:`CPU_PATCHES` with ``torch.cuda.current_device`` answering ``current_device`` (see
    :func:`current_device_is`)."""
    bound = current_device_is(current_device)
    return tuple(bound if patch is CURRENT_DEVICE_IS_CPU else patch for patch in CPU_PATCHES)


def shimmed_current_device() -> torch.device | None:
    """The device the current-device shim answers while it is applied (:func:`current_device_is`); None when
    ``torch.cuda.current_device`` is torch's own (which is then not called: it would initialise CUDA)."""
    current = torch.cuda.current_device
    if upstream_original(current) is current:
        return None
    return torch.device(current())


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    return isinstance(value, torch.device) and value.type == "cuda"


class CudaLiteralsToCpu(TorchFunctionMode):
    """Turn ``device="cuda"`` (keyword or positional ``.to("cuda")``), ``.cuda()`` and ``.pin_memory()``
    into CPU no-ops while active. Enter it only around calls that hard-code CUDA (pipeline schedules).

    With ``cuda_type_names=True`` it also answers ``tensor.type()`` (no argument) for a CPU tensor with the CUDA
    tensor type's name (``"torch.cuda.BFloat16Tensor"`` for a CPU bfloat16 tensor): Megatron's optimizers sort
    parameters by that name and refuse any other. Only for code that merely compares the name."""

    def __init__(self, cuda_type_names: bool = False) -> None:
        super().__init__()
        self.cuda_type_names = cuda_type_names

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if self.cuda_type_names and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # (already a CUDA name when a nested mode answered)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)
        if func is torch.Tensor.to and any(_is_cuda_device(a) for a in args[1:]):
            args = tuple(_CPU if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)
