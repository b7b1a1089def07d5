"""An opt-in patch that lets DeepSpeed train in fp16 on a CPU (gloo, the emulated device).

DeepSpeed's CPU accelerator reports fp16 as supported only when oneDNN has fp16 kernels for the CPU
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX), and ``deepspeed.initialize`` then
refuses an fp16 config with "Type fp16 is not supported on your device". torch itself computes fp16 on any
CPU (slower), so DeepSpeed's fp16 machinery (loss scaling, overflow checks, skipped steps) runs there too.
Nothing here imports DeepSpeed; :data:`CPU_FP16` is a definition applied through
:func:`chameleon_dist.patching.apply_patches` (``launch/train_deepspeed.py`` does that on CPU for an fp16
config).
"""

from __future__ import annotations

from typing import Any

from chameleon_dist.patching import Patch


def _make_fp16_supported(original: Any) -> Any:
    def is_fp16_supported(self: Any) -> bool:
        """fp16 runs on every CPU through torch's own kernels (installed by chameleon-dist)."""
        return True

    return is_fp16_supported


CPU_FP16 = Patch(
    name="deepspeed-cpu-fp16-supported",
    target="deepspeed.accelerator.cpu_accelerator:CPU_Accelerator.is_fp16_supported",
    package="deepspeed",
    versions=">=0.19,<0.20",
    why=(
        "The CPU accelerator says fp16 is unsupported unless oneDNN has fp16 kernels for the CPU, and "
        "deepspeed.initialize refuses fp16 configs then; torch computes fp16 on any CPU, so the fp16 path "
        "(dynamic loss scaling, overflow, skipped steps) can be tested on CPU machines."
    ),
    remove_when="DeepSpeed's CPU accelerator reports fp16 from torch's kernels, or fp16 is tested on GPUs only",
    fingerprint="fda4ce338cbf79a3",
    make_replacement=_make_fp16_supported,
)

CPU_PATCHES: tuple[Patch, ...] = (CPU_FP16,)
