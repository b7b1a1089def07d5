"""Accelerator presets for the emulated link, scaled to this CPU's measured matmul throughput.

On a real node what matters for swapping is the ratio of compute to host-link bandwidth (FLOP per link
byte: ~13,000-18,000 on Ascend 910B, A100, H100 and H200 PCIe nodes). The emulated device computes on
this CPU, so its link is slowed to keep that ratio against the CPU's own matmul rate:
``link_bytes_per_s = cpu_matmul_flop_per_s / (accel_peak_flop_per_s / accel_link_bytes_per_s)``.
Figures are public peak numbers (dense, 16-bit) and measured pinned-copy bandwidths.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AcceleratorPreset:
    name: str
    description: str
    peak_flop_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    memory_bytes: int

    @property
    def h2d_flop_per_byte(self) -> float:
        return self.peak_flop_per_s / self.h2d_bytes_per_s

    @property
    def d2h_flop_per_byte(self) -> float:
        return self.peak_flop_per_s / self.d2h_bytes_per_s


PRESETS: tuple[AcceleratorPreset, ...] = (
    AcceleratorPreset("ascend-910b", "Ascend 910B-class NPU node (313 TFLOPS fp16, ~23 GB/s host link)",
                      313e12, 23e9, 23e9, 64 * 10**9),
    AcceleratorPreset("h100-pcie", "H100 PCIe-class node (756 TFLOPS bf16, PCIe5 ~55 GB/s)",
                      756e12, 55e9, 55e9, 80 * 10**9),
    AcceleratorPreset("a100-pcie", "A100 80GB PCIe4-class node (312 TFLOPS bf16, ~25 GB/s)",
                      312e12, 25e9, 25e9, 80 * 10**9),
    AcceleratorPreset("h200", "H200-class node (989 TFLOPS bf16, PCIe5 ~55 GB/s, 141 GB)",
                      989e12, 55e9, 55e9, 141 * 10**9),
)


def get_preset(name: str) -> AcceleratorPreset:
    for preset in PRESETS:
        if preset.name == name:
            return preset
    known = ", ".join(p.name for p in PRESETS)
    raise ValueError(f"unknown device.preset {name!r}; choose one of: {known}")


def measure_matmul_flop_per_s(duration_s: float = 0.3, size: int = 512) -> float:
    """This CPU's fp32 matmul throughput in FLOP/s, measured for about ``duration_s``."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    a @ b  # warm-up
    runs = 0
    start_s = time.perf_counter()
    while True:
        a @ b
        runs += 1
        elapsed_s = time.perf_counter() - start_s
        if elapsed_s >= duration_s:
            break
    return 2 * size**3 * runs / elapsed_s


@dataclasses.dataclass(frozen=True)
class LinkCalibration:
    preset: AcceleratorPreset
    cpu_flop_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float

    def describe(self) -> str:
        return (
            f"emulated link calibrated to {self.preset.name}: CPU matmul {self.cpu_flop_per_s / 1e9:.1f} GFLOP/s, "
            f"{self.preset.h2d_flop_per_byte:,.0f} FLOP per link byte -> H2D {self.h2d_bytes_per_s / 1e6:.2f} MB/s, "
            f"D2H {self.d2h_bytes_per_s / 1e6:.2f} MB/s (emulated)"
        )


def calibrate(preset_name: str, cpu_flop_per_s: float | None = None) -> LinkCalibration:
    """Scale ``preset_name``'s link to this CPU (measures the CPU when ``cpu_flop_per_s`` is None)."""
    preset = get_preset(preset_name)
    flops = cpu_flop_per_s if cpu_flop_per_s is not None else measure_matmul_flop_per_s()
    calibration = LinkCalibration(
        preset=preset,
        cpu_flop_per_s=flops,
        h2d_bytes_per_s=flops / preset.h2d_flop_per_byte,
        d2h_bytes_per_s=flops / preset.d2h_flop_per_byte,
    )
    logger.info(calibration.describe())
    return calibration
