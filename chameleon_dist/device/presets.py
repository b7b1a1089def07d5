"""Accelerator presets: the figures of a real node that the simulated device models.

Each preset carries the public figures the simulated device's cost model needs (see
:mod:`chameleon_dist.device.model`): peak FLOP/s per dtype (dense; fp32 without tensor cores, as PyTorch
runs fp32 matmuls with TF32 off by default), HBM bandwidth, the device-side launch latency of a small
kernel, the real host-link rates and how much of them each direction keeps while the other copies, each
figure with its source in ``sources``. :meth:`AcceleratorPreset.device_model` turns them into a
``DeviceModel``.
"""

from __future__ import annotations

import dataclasses

# Sources named by the figures below (short forms). The link rates are those of configs/hardware/*.yaml.
_A100_SHEET = "NVIDIA A100 datasheet (A100 80GB PCIe column)"
_H100_SHEET = "NVIDIA H100 datasheet (H100 PCIe column; its tensor figures with sparsity halved to dense)"
_H200_SHEET = "NVIDIA H200 datasheet (H200 SXM column; its tensor figures with sparsity halved to dense)"
_LAUNCH = ("launch_latency_s: ~3 us, the launch overhead of back-to-back null kernels on recent NVIDIA GPUs and "
           "drivers (NVIDIA developer forum, 'Too much time for kernel launch latency', 233645)")
_DUPLEX_A100 = ("duplex_factor: 0.70 = (11 + 24) / (25 + 25): nvbandwidth on A100 PCIe4, one-way ~25 GB/s each "
                "way; both at once H2D ~11 GB/s, D2H ~24 GB/s (NVIDIA/nvbandwidth issues #53 and #11); one "
                "factor for both directions that keeps the measured two-way total")
_DUPLEX_GEN5 = _DUPLEX_A100 + "; no PCIe5 two-way measurement found, the PCIe4 factor is assumed"
_GH200_SHEET = ("NVIDIA GH200 Grace Hopper Superchip datasheet (the 96 GB HBM3 version; its tensor figures with "
                "sparsity halved to dense)")
_GH200_LINK = ("h2d/d2h_bytes_per_s: 375 GB/s host->device and 297 GB/s device->host, measured NVLink-C2C "
               "host-device copy rates on GH200, as reported in public benchmarks: the KTH study of a GH200 with "
               "480 GB LPDDR5X + 96 GB HBM3 (Schieffer, Wahlgren, Ren, Faj, Peng, 'Harnessing Integrated CPU-GPU "
               "System Memory for HPC: a first look into Grace Hopper', arXiv 2407.07850, ICPP '24), as HPCwire "
               "reported its results in July 2024; 42% and 34% of the link's nominal 900 GB/s (450 GB/s each way). "
               "Same range elsewhere: nvbandwidth host_to_device_memcpy_ce ~346 GB/s on a 96 GB GH200, device->host "
               "~15% lower (NVIDIA/nvbandwidth issue #23)")
_DUPLEX_GH200 = ("duplex_factor: 0.50, assumed from one user report that nvbandwidth's bidirectional host<->device "
                 "copy-engine runs on GH200 reach about half of the one-way rates (NVIDIA/nvbandwidth issue #41, "
                 "not confirmed by NVIDIA); replace with a measurement")
_CAPACITY = ("memory_bytes: {gb} GB, the datasheet's decimal figure; CUDA reports {mib} MiB = {real:.1f}e9 bytes "
             "in all ({source}), so the emulated device has ~{short:.0f}% less than a real one's total (a real "
             "one also loses ~0.5-1 GB to the CUDA context)")


# H200 SXM and GH200's GPU: the same dense peaks per dtype (their datasheets' tensor figures halved)
_HOPPER_SXM_PEAKS = (("float32", 67e12), ("bfloat16", 989e12), ("float16", 989e12), ("float8_e4m3fn", 1979e12),
                     ("float8_e5m2", 1979e12), ("float64", 67e12), ("default", 67e12))


def _capacity(gb: int, mib: int, source: str) -> str:
    real = mib * 2**20 / 1e9
    return _CAPACITY.format(gb=gb, mib=f"{mib:,}", real=real, source=source, short=100 * (1 - gb / real))


@dataclasses.dataclass(frozen=True)
class AcceleratorPreset:
    """One accelerator node's public figures.

    ``peak_flop_per_s`` is the dense 16-bit peak (the compute-to-link ratio: ``h2d_flop_per_byte``); ``dtype_peak_flop_per_s``
    holds the peak per dtype name (``"float32"``, ``"bfloat16"``, ...; ``"default"`` for any other dtype).
    ``h2d_bytes_per_s``/``d2h_bytes_per_s`` are real, measured pinned-copy rates (unscaled).
    """

    name: str
    description: str
    peak_flop_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    memory_bytes: int
    dtype_peak_flop_per_s: tuple[tuple[str, float], ...] = ()
    memory_bytes_per_s: float | None = None
    launch_latency_s: float | None = None
    duplex_factor: float = 1.0
    sources: tuple[str, ...] = ()

    @property
    def h2d_flop_per_byte(self) -> float:
        return self.peak_flop_per_s / self.h2d_bytes_per_s

    @property
    def d2h_flop_per_byte(self) -> float:
        return self.peak_flop_per_s / self.d2h_bytes_per_s

    def dtype_peaks(self) -> dict[str, float]:
        """Peak FLOP/s per dtype name, with ``"default"`` (the 16-bit peak when the preset names none)."""
        peaks = dict(self.dtype_peak_flop_per_s)
        peaks.setdefault("default", self.peak_flop_per_s)
        return peaks

    def device_model(self):
        """This preset's figures as a :class:`~chameleon_dist.device.model.DeviceModel`."""
        from chameleon_dist.device.model import DeviceModel

        return DeviceModel.resolve(preset=self)


PRESETS: tuple[AcceleratorPreset, ...] = (
    AcceleratorPreset(
        "ascend-910b", "Ascend 910B-class NPU node (313 TFLOPS fp16, ~23 GB/s host link)",
        313e12, 23e9, 23e9, 64 * 10**9,
        dtype_peak_flop_per_s=(("float16", 313e12), ("bfloat16", 313e12), ("float32", 313e12 / 4),
                               ("default", 313e12 / 4)),
        memory_bytes_per_s=1.6e12, launch_latency_s=3e-6, duplex_factor=0.70,
        sources=(
            "float16: 313 TFLOPS dense, Huawei's public specification",
            "bfloat16: assumed equal to fp16 (no separate public figure found)",
            "float32/default: no public fp32 figure found; estimate = fp16 / 4, replace with a measurement",
            "memory_bytes_per_s: 1.6 TB/s, the commonly cited figure for 64 GB HBM2e (public figures vary "
            "from 1.2 to 1.6 TB/s)",
            "memory_bytes: 64 GB HBM, Huawei's public specification (the Chameleon paper's testbed, arXiv "
            "2509.11076); no CUDA-style reported total applies",
            "h2d/d2h_bytes_per_s: ~23 GB/s pinned host<->device copies on the 910B's PCIe link, as measured for "
            "MindSpeed",
            "launch_latency_s: no public Ascend figure found; the NVIDIA ~3 us is assumed",
            _DUPLEX_GEN5.replace("no PCIe5", "no 910B"),
        ),
    ),
    AcceleratorPreset(
        "h100-pcie", "H100 PCIe-class node (756 TFLOPS bf16, PCIe5 ~55 GB/s)",
        756e12, 55e9, 55e9, 80 * 10**9,
        dtype_peak_flop_per_s=(("float32", 51e12), ("bfloat16", 756e12), ("float16", 756e12),
                               ("float8_e4m3fn", 1513e12), ("float8_e5m2", 1513e12), ("float64", 51e12),
                               ("default", 51e12)),
        memory_bytes_per_s=2.0e12, launch_latency_s=3e-6, duplex_factor=0.70,
        sources=(
            f"float32/default: 51 TFLOPS (no tensor cores); float64: 51 TFLOPS (tensor cores); {_H100_SHEET}",
            f"bfloat16/float16: 756 TFLOPS dense (1,513 with sparsity); float8: 1,513 dense; {_H100_SHEET}",
            f"memory_bytes_per_s: 2.0 TB/s HBM2e; {_H100_SHEET}",
            "h2d/d2h_bytes_per_s: ~55 GB/s pinned copies on PCIe5 x16, measured (CUDA bandwidthTest)",
            _capacity(80, 81559, "nvidia-smi on H100 80GB, as listed in modal-labs/modal-client PR #2797; "
                      "the PCIe card's own total not found, the same 80 GB is assumed to report alike"),
            _LAUNCH,
            _DUPLEX_GEN5,
        ),
    ),
    AcceleratorPreset(
        "a100-pcie", "A100 80GB PCIe4-class node (312 TFLOPS bf16, ~25 GB/s)",
        312e12, 25e9, 25e9, 80 * 10**9,
        dtype_peak_flop_per_s=(("float32", 19.5e12), ("bfloat16", 312e12), ("float16", 312e12),
                               ("float64", 19.5e12), ("default", 19.5e12)),
        memory_bytes_per_s=1.935e12, launch_latency_s=3e-6, duplex_factor=0.70,
        sources=(
            f"float32/default: 19.5 TFLOPS (no tensor cores; TF32 156); float64: 19.5 (tensor cores); {_A100_SHEET}",
            f"bfloat16/float16: 312 TFLOPS dense (624 with sparsity); {_A100_SHEET}",
            f"memory_bytes_per_s: 1,935 GB/s HBM2e; {_A100_SHEET}",
            "h2d/d2h_bytes_per_s: ~25 GB/s pinned copies on PCIe4 x16, measured (CUDA bandwidthTest, nvbandwidth)",
            _capacity(80, 81920, "nvidia-smi on A100 80GB, as listed in modal-labs/modal-client PR #2797"),
            _LAUNCH,
            _DUPLEX_A100,
        ),
    ),
    AcceleratorPreset(
        "h200", "H200-class node (989 TFLOPS bf16, PCIe5 ~55 GB/s, 141 GB)",
        989e12, 55e9, 55e9, 141 * 10**9,
        dtype_peak_flop_per_s=_HOPPER_SXM_PEAKS,
        memory_bytes_per_s=4.8e12, launch_latency_s=3e-6, duplex_factor=0.70,
        sources=(
            f"float32/default: 67 TFLOPS (no tensor cores); float64: 67 TFLOPS (tensor cores); {_H200_SHEET}",
            f"bfloat16/float16: 989 TFLOPS dense (1,979 with sparsity); float8: 1,979 dense; {_H200_SHEET}",
            f"memory_bytes_per_s: 4.8 TB/s HBM3e; {_H200_SHEET}",
            "h2d/d2h_bytes_per_s: ~55 GB/s pinned copies on PCIe5 x16, measured (CUDA bandwidthTest)",
            _capacity(141, 143771, "nvidia-smi on H200, as posted in NVIDIA/cuda-samples issue #311"),
            _LAUNCH,
            _DUPLEX_GEN5,
        ),
    ),
    AcceleratorPreset(
        "gh200", "GH200 Grace Hopper node (989 TFLOPS bf16, NVLink-C2C 375/297 GB/s, 96 GB HBM3)",
        989e12, 375e9, 297e9, 96 * 10**9,
        dtype_peak_flop_per_s=_HOPPER_SXM_PEAKS,
        memory_bytes_per_s=4.0e12, launch_latency_s=3e-6, duplex_factor=0.50,
        sources=(
            f"float32/default: 67 TFLOPS (no tensor cores); float64: 67 TFLOPS (tensor cores); {_GH200_SHEET}",
            f"bfloat16/float16: 989 TFLOPS dense (1,979 with sparsity; the H100 SXM figure: GH200's GPU is an "
            f"H100-class Hopper); float8: 1,979 dense; {_GH200_SHEET}",
            f"memory_bytes_per_s: 4.0 TB/s HBM3 (the 144 GB HBM3e version: 4.9 TB/s, not modelled); {_GH200_SHEET}",
            f"memory_bytes: 96 GB HBM3; {_GH200_SHEET}; chosen over the 144 GB HBM3e version because the measured "
            "link rates below come from a 96 GB HBM3 system (no CUDA-reported total found for it)",
            _GH200_LINK,
            _LAUNCH,
            _DUPLEX_GH200,
        ),
    ),
)


def get_preset(name: str) -> AcceleratorPreset:
    for preset in PRESETS:
        if preset.name == name:
            return preset
    known = ", ".join(p.name for p in PRESETS)
    raise ValueError(f"unknown device.preset {name!r}; choose one of: {known}")
