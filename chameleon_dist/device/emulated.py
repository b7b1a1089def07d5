"""``EmulatedDevice``: the CPU stand-in for an accelerator (tests, demo, CI): ``StreamDevice``, the device
logic a GPU runs, over the simulated backend (NOTE [One device code path] in ``device/backend.py``).

What it models: a device clock that lags the host (each op a roofline cost from the accelerator's figures
plus a launch latency; the host's own work measured, or a fixed cost per op), copy links at their real
rates (slower while both directions copy), memory as the caching allocator reports it (512-byte blocks tied
to their allocation stream, out-of-memory at the allocation), and a hazard checker for every access the
clock would let race; with ``caching_allocator`` the caching allocator's segments, per-stream pools and
fragmentation (``expandable_segments`` as an option: NOTE [The caching allocator model] in
``device/simulated/caching.py``). What it does not model: cache and occupancy effects inside kernels,
overlap of kernels on different compute streams competing for the same SMs, the CUDA context and NCCL
buffers, and real silicon. Every figure it reports is emulated."""

from __future__ import annotations

import math

from chameleon_dist.device.model import DeviceModel
from chameleon_dist.device.simulated.backend import SimulatedBackend
from chameleon_dist.device.stream_device import StreamDevice
from chameleon_dist.units import format_bytes


class EmulatedDevice(StreamDevice):
    """A simulated GPU of ``capacity_bytes`` on the CPU.

    ``preset`` (e.g. "h100-pcie") gives every figure of that accelerator (peak FLOP/s per dtype, memory
    bandwidth, launch latency, link rates); an explicit figure overrides the preset's. Without a preset the
    compute figures are this CPU's measured rates (``cpu_flop_per_s`` skips measuring the matmul rate) and a
    link direction built without a bandwidth is instant (its ``*_bytes_per_s`` reads ``math.inf``).
    ``host_op_s``: fixed host seconds per op for runs that repeat exactly (None: the host's time is
    measured). ``check_hazards``: raise ``StreamHazardError`` on a racing access (NOTE [Stream hazards]).
    ``meta_tensors``: the model's tensors are meta tensors (sizes, no data): LLM shapes run through the same
    runtime, timed and metered from sizes (NOTE [Meta tensors] in ``device/simulated/backend.py``).
    ``caching_allocator``: blocks live in the caching allocator's segments and per-stream pools, and the
    capacity bounds reserved bytes (off: every block its own segment); ``expandable_segments`` with it."""

    def __init__(
        self,
        capacity_bytes: int,
        h2d_bytes_per_s: float | None = None,
        d2h_bytes_per_s: float | None = None,
        preset: str | None = None,
        host_memory_budget_bytes: int | None = None,
        cpu_flop_per_s: float | None = None,
        *,
        peak_flop_per_s: float | None = None,
        memory_bytes_per_s: float | None = None,
        launch_latency_s: float | None = None,
        host_op_s: float | None = None,
        duplex_factor: float | None = None,
        check_hazards: bool = True,
        model: DeviceModel | None = None,
        meta_tensors: bool = False,
        caching_allocator: bool = False,
        expandable_segments: bool = False,
    ) -> None:
        if model is None:
            model = DeviceModel.resolve(
                preset=preset, peak_flop_per_s=peak_flop_per_s if peak_flop_per_s is not None else cpu_flop_per_s,
                memory_bytes_per_s=memory_bytes_per_s, launch_latency_s=launch_latency_s,
                h2d_bytes_per_s=h2d_bytes_per_s, d2h_bytes_per_s=d2h_bytes_per_s, host_op_s=host_op_s,
                duplex_factor=duplex_factor,
            )
        self.model = model
        backend = SimulatedBackend(int(capacity_bytes), model, check_hazards=check_hazards, meta_tensors=meta_tensors,
                                   caching_allocator=caching_allocator, expandable_segments=expandable_segments)
        super().__init__(
            backend, host_memory_budget_bytes,
            d2h_bytes_per_s=math.inf if model.d2h_bytes_per_s is None else model.d2h_bytes_per_s,
            h2d_bytes_per_s=math.inf if model.h2d_bytes_per_s is None else model.h2d_bytes_per_s,
        )
        described = (f", {model.preset}" if model.preset else "") + (", meta tensors" if meta_tensors else "")
        self.name = f"emulated ({format_bytes(self.capacity_bytes)}{described})"
        self.h2d = backend.h2d_link
        self.d2h = backend.d2h_link
        self.clock = backend.clock
        self.hazards = backend.hazards

    @property
    def meta_tensors(self) -> bool:
        return self.backend.meta_tensors

    @property
    def preset(self) -> str | None:
        return self.model.preset

    def describe(self) -> str:
        """The modelled figures, for logs and reports (every one emulated)."""
        return self.model.describe()
