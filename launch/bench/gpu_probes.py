"""The GPU check's probes (``launch/gpu_check.py``, part ``probes``): what only a GPU can tell about the runtime,
each probe on the same code path over the emulated device in ``--dry-run`` (the test suite runs it).

1. ``relief_enforced``: Chameleon at a capacity below the no-swap peak, the capacity enforced (on CUDA the
   allocator raises at it: ``device.enforce_capacity``) and no iteration retry (``executor.max_oom_retries: 0``):
   capacities from loose to tight are tried until one runs every iteration with at least one op relieved inside
   the op (``device.dispatch.relieved_ops``) and no retry; its losses, parameters and buffers must be
   bit-identical (``torch.equal``) to the run without swap.
2. ``side_stream_batchnorm``: ``SideStreamNet`` (a section on a side stream in forward, a backward that enters a
   side stream, BatchNorm) with swap against without: losses, parameters and running statistics bit-identical.
3. ``pinned_buffers``: every runtime above got page-locked host buffers only (no pageable fallback: a failed
   ``cudaHostRegister``, NOTE in ``device/cuda.py``). The emulated device does not model pinning (reported so).
4. ``copy_rates``: measured D2H, H2D and duplex (both at once, on two streams) copy rates over the backend's own
   streams, events and host buffers, beside the preset's figures (one-way; duplex = one-way x duplex_factor).
5. ``host_time_per_op``: Chameleon's added host time per op: the median host seconds of a Stable iteration with
   swap less the same iteration without Chameleon swapping, over the iteration's op count.

    python -m launch.bench.gpu_probes --json runs/gpu_probes.json            # CUDA: about a minute
    python -m launch.bench.gpu_probes --json /tmp/gpu_probes.json --dry-run  # CPU, emulated device, seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from chameleon_dist import Chameleon
from chameleon_dist.device import EmulatedDevice
from chameleon_dist.device.presets import PRESETS, get_preset
from launch.models.gpu_probe_models import SideStreamNet, Tower, model_state

MIB = 2**20
DRY_PRESET = "h200"  # the GPU the check runs on; its figures drive the emulated device in the dry run
DRY_HOST_OP_S = 1e-6  # fixed host time per op on the emulated clock: the device figures repeat exactly
RELIEF_FRACTIONS = (0.8, 0.65, 0.5, 0.4, 0.3, 0.2)
"""Capacities tried by ``relief_enforced``, as resident bytes + this share of the no-swap activation peak."""
SHAPES = {"dry": dict(width=64, depth=3, batch=128, iterations=4, copy_mib=8),
          "cuda": dict(width=1024, depth=6, batch=4096, iterations=6, copy_mib=256)}
"""The probes' sizes on a GPU and in the dry run (which checks the code path only: its batch of 128 keeps every
activation far above ``min_swap_bytes``, the side-stream probe's quarter batch too)."""
BASE_CONFIG = {"min_swap_bytes": 4096, "memory_budget": 1.0, "profiler": {"warmup_iterations": 2, "policy_trials": 2},
               "executor": {"prefetch_depth": 2}}


class Probes:
    """The devices, models and batches of one probe run (``dry``: the emulated device)."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.shape = SHAPES["dry" if dry else "cuda"]
        self.torch_device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
        self.preset = get_preset(DRY_PRESET) if dry else gpu_preset()
        self.runtimes: list[Chameleon] = []  # every runtime built (their host allocators are checked)

    def device(self, capacity_bytes: int | None = None, enforce: bool = False):
        if self.dry:
            # (without a capacity: the preset's memory, as a GPU has; sys.maxsize overflows the generator's int64
            # arithmetic at memory_budget 1.0)
            return EmulatedDevice(capacity_bytes or self.preset.memory_bytes, preset=DRY_PRESET, host_op_s=DRY_HOST_OP_S)
        from chameleon_dist.device import CudaDevice

        return CudaDevice(capacity_bytes=capacity_bytes, enforce_capacity=enforce)

    def batches(self, count: int | None = None, batch: int | None = None) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        shape = (batch or self.shape["batch"], self.shape["width"])
        return [torch.randn(shape, generator=generator).to(self.torch_device)
                for _ in range(count or self.shape["iterations"])]

    def tower(self) -> Tower:
        torch.manual_seed(0)
        return Tower(self.shape["width"], self.shape["depth"]).to(self.torch_device)

    def train(self, model, device, batches, config: dict, enabled: bool = True) -> dict:
        """``run_iteration`` per batch (SGD inside it); losses, final state, reports, ops relieved, host seconds."""
        runtime = Chameleon({**config, "enabled": enabled}, device=device)
        self.runtimes.append(runtime)
        runtime.attach(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses, reports, host_s = [], [], []
        for batch in batches:
            x = device.track(batch.clone())

            def closure():
                loss = model(x)
                loss.backward()
                return loss.detach()

            device.synchronize()
            start_s = time.perf_counter()
            losses.append(runtime.run_iteration(closure, optimizer=optimizer).clone())
            host_s.append(time.perf_counter() - start_s)
            optimizer.zero_grad(set_to_none=True)
            reports.append(runtime.last_report.to_dict())
        device.synchronize()
        return {"losses": losses, "state": [t.clone() for t in model_state(model)], "reports": reports,
                "relieved_ops": device.dispatch.relieved_ops, "host_s": host_s}

    def resident_bytes(self, model) -> int:
        """Device bytes in use before an iteration with ``model`` resident (its parameters and buffers; on CUDA
        everything this process holds, which the allocator counts against the capacity)."""
        if self.dry:
            return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        return torch.cuda.memory_allocated(self.torch_device)

    def reset_peaks(self) -> None:
        if not self.dry:
            torch.cuda.reset_peak_memory_stats(self.torch_device)

    def release(self) -> None:
        """Before and after a run with the capacity enforced: the whole GPU again, and the cache emptied (the
        allocator holds the enforced capacity against its reserved bytes)."""
        if not self.dry:
            torch.cuda.synchronize()
            torch.cuda.set_per_process_memory_fraction(1.0, self.torch_device)
            torch.cuda.empty_cache()


def identical(a: dict, b: dict) -> dict:
    losses = sum(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
    state = sum(torch.equal(x, y) for x, y in zip(a["state"], b["state"]))
    return {"losses_equal": losses, "losses_compared": len(b["losses"]), "state_equal": state,
            "state_compared": len(b["state"]),
            "bit_identical": losses == len(a["losses"]) == len(b["losses"]) and state == len(a["state"]) == len(b["state"])}


def _figures(run: dict) -> dict:
    reports = run["reports"]
    return {"stages": [r["stage"] for r in reports], "peaks_bytes": [r["peak_device_bytes"] for r in reports],
            "oom_retries": sum(r["oom_retries"] for r in reports), "passive_swaps": sum(r["passive_swaps"] for r in reports),
            "pressure_waits": sum(r["pressure_waits"] for r in reports),
            "swap_out_bytes": sum(r["swap_out_bytes"] for r in reports),
            "recomputed_bytes": sum(r["recomputed_bytes"] for r in reports), "relieved_ops": run["relieved_ops"]}


def probe_relief_enforced(p: Probes) -> dict:
    batches = p.batches()
    p.reset_peaks()
    model = p.tower()
    start_bytes = p.resident_bytes(model)
    reference = p.train(model, p.device(), batches, BASE_CONFIG, enabled=False)
    activation_bytes = max(r["peak_device_bytes"] for r in reference["reports"]) - start_bytes
    config = {**BASE_CONFIG, "executor": {**BASE_CONFIG["executor"], "max_oom_retries": 0}}
    attempts = []
    for fraction in RELIEF_FRACTIONS:
        p.release()  # (cached blocks of earlier runs count against an enforced capacity on CUDA)
        model = p.tower()
        capacity_bytes = p.resident_bytes(model) + int(fraction * activation_bytes)
        attempt = {"fraction": fraction, "capacity_bytes": capacity_bytes}
        try:
            run = p.train(model, p.device(capacity_bytes, enforce=True), batches, config)
            attempt.update(_figures(run), **identical(run, reference), error="")
        except torch.OutOfMemoryError as exc:
            attempt.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            p.release()
        attempts.append(attempt)
        if not attempt["error"] and attempt["relieved_ops"] > 0:
            break
    chosen = attempts[-1]
    ok = not chosen["error"] and chosen["relieved_ops"] > 0 and chosen["oom_retries"] == 0 and chosen["bit_identical"]
    return {"ok": bool(ok), "activation_peak_bytes": activation_bytes, "attempts": attempts,
            "rule": "at least one op relieved, no iteration retried (max_oom_retries 0), bit-identical to no swap"}


def probe_side_stream_batchnorm(p: Probes) -> dict:
    batches = p.batches(6, p.shape["batch"] // 4)  # into Stable (warmup_iterations 2, policy_trials 2)
    runs = {}
    for name, enabled in (("without", False), ("with", True)):
        device = p.device()
        torch.manual_seed(0)
        model = SideStreamNet(device.backend, p.shape["width"], p.shape["depth"]).to(p.torch_device)
        runs[name] = p.train(model, device, batches, BASE_CONFIG, enabled=enabled)
    same = identical(runs["with"], runs["without"])
    figures = _figures(runs["with"])
    return {"ok": bool(same["bit_identical"] and figures["swap_out_bytes"] > 0), **same, **figures}


def probe_pinned_buffers(p: Probes) -> dict:
    allocators = [r.device.backend.host_allocator() for r in p.runtimes]
    counted = [a for a in allocators if a is not None and hasattr(a, "fallback_buffers")]
    if not counted:
        return {"ok": True, "modelled": False,
                "note": "the emulated device's host buffers are plain CPU tensors: pinning is not modelled"}
    fallback = sum(a.fallback_buffers for a in counted)
    return {"ok": fallback == 0 and not any(a.pinning_failed for a in counted), "modelled": True,
            "runtimes": len(counted), "fallback_buffers": fallback,
            "registered_buffers": sum(a.registered_buffers for a in counted),
            "pinning_failed": any(a.pinning_failed for a in counted)}


def measure_copy_rates(device, nbytes: int, repeats: int = 3, chunks: int = 8) -> dict:
    """D2H, H2D and duplex rates (bytes/s, best of ``repeats``) over the backend's streams and timing events,
    between device blocks and host buffers from the backend's host allocator (pinned on CUDA). Duplex: both
    directions at once on two streams, each moving ``nbytes`` in ``chunks`` copies queued alternately (so each
    direction's copies run while the other's do, not only the first of them), timed per direction."""
    backend = device.backend
    allocate_host = backend.host_allocator() or (lambda n: torch.empty(n, dtype=torch.uint8))
    with device.active():
        device_a, device_b = backend.allocate(nbytes), backend.allocate(nbytes)
        with backend.host_side():
            host_a, host_b = allocate_host(nbytes), allocate_host(nbytes)
        d2h, h2d = backend.new_stream("probe-d2h"), backend.new_stream("probe-h2d")
        step = -(-nbytes // chunks)
        pieces = [slice(i, min(i + step, nbytes)) for i in range(0, nbytes, step)]

        def timed(directions: list[tuple]) -> list[float]:
            """(stream, destination, source) per direction, chunk by chunk in turn; each direction's seconds."""
            gate = backend.new_event()
            gate.record(backend.current_stream())
            marks = []
            for stream, _, _ in directions:
                stream.wait_event(gate)
                start = backend.new_event(timing=True)
                start.record(stream)
                marks.append([start, None])
            for piece in pieces:
                for stream, destination, source in directions:
                    with backend.use_stream(stream):
                        backend.copy(destination[piece], source[piece])
            for (stream, _, _), mark in zip(directions, marks):
                mark[1] = backend.new_event(timing=True)
                mark[1].record(stream)
            for _, end in marks:
                end.synchronize()
            return [backend.elapsed_s(start, end) for start, end in marks]

        best = {"d2h": float("inf"), "h2d": float("inf"), "duplex_d2h": float("inf"), "duplex_h2d": float("inf")}
        for _ in range(repeats):
            best["d2h"] = min(best["d2h"], *timed([(d2h, host_a, device_a)]))
            best["h2d"] = min(best["h2d"], *timed([(h2d, device_b, host_b)]))
            d2h_s, h2d_s = timed([(d2h, host_a, device_a), (h2d, device_b, host_b)])
            best["duplex_d2h"], best["duplex_h2d"] = min(best["duplex_d2h"], d2h_s), min(best["duplex_h2d"], h2d_s)
        device.synchronize()
    return {f"{name}_bytes_per_s": nbytes / seconds for name, seconds in best.items()}


def probe_copy_rates(p: Probes) -> dict:
    nbytes = p.shape["copy_mib"] * MIB
    measured = measure_copy_rates(p.device(), nbytes)
    preset = p.preset
    expected = None if preset is None else {
        "d2h_bytes_per_s": preset.d2h_bytes_per_s, "h2d_bytes_per_s": preset.h2d_bytes_per_s,
        "duplex_d2h_bytes_per_s": preset.d2h_bytes_per_s * preset.duplex_factor,
        "duplex_h2d_bytes_per_s": preset.h2d_bytes_per_s * preset.duplex_factor}
    ratio = None if expected is None else {k: measured[k] / expected[k] for k in measured}
    return {"ok": all(v > 0 for v in measured.values()), "bytes": nbytes, "measured": measured,
            "preset": None if preset is None else preset.name, "preset_figures": expected,
            "measured_over_preset": ratio}


def probe_host_time_per_op(p: Probes) -> dict:
    batches = p.batches(8)  # Stable from the fifth on
    runs = {name: p.train(p.tower(), p.device(), batches, BASE_CONFIG, enabled=enabled)
            for name, enabled in (("without", False), ("with", True))}
    stable = [i for i, r in enumerate(runs["with"]["reports"]) if r["stage"] == "stable"]
    if not stable:
        return {"ok": False, "error": "no Stable iteration", "stages": [r["stage"] for r in runs["with"]["reports"]]}
    ops = statistics.median(runs["with"]["reports"][i]["num_ops"] for i in stable)
    with_s = statistics.median(runs["with"]["host_s"][i] for i in stable)
    without_s = statistics.median(runs["without"]["host_s"][i] for i in stable)
    return {"ok": True, "stable_iterations": len(stable), "ops_per_iteration": ops,
            "host_s_per_iteration_with": with_s, "host_s_per_iteration_without": without_s,
            "added_host_s_per_op": (with_s - without_s) / ops, "host_s_per_op_without": without_s / ops,
            **identical(runs["with"], runs["without"])}


PROBES = {"relief_enforced": probe_relief_enforced, "side_stream_batchnorm": probe_side_stream_batchnorm,
          "pinned_buffers": probe_pinned_buffers, "copy_rates": probe_copy_rates,
          "host_time_per_op": probe_host_time_per_op}
"""In order: ``pinned_buffers`` reads the host allocators of the runtimes the probes before it built."""


def gpu_preset():
    """The preset of this GPU (``preset_for``), or None."""
    return preset_for(torch.cuda.get_device_properties(torch.cuda.current_device()).name)


def preset_for(gpu_name: str):
    """The preset whose model is named in ``gpu_name`` (NVIDIA H200 -> h200; gh200 is tried before h200), or None."""
    name = gpu_name.lower()
    for preset in sorted(PRESETS, key=lambda p: -len(p.name.split("-")[0])):
        if preset.name.split("-")[0] in name:
            return preset
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the emulated device on the CPU (tests)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--probes", default=",".join(PROBES), help="comma-separated subset, in their order")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run")
    if not args.dry_run:  # bit-identity needs deterministic kernels (cuBLAS reads this at its first handle)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    wanted = [name for name in args.probes.split(",") if name]
    if set(wanted) - set(PROBES):
        parser.error(f"unknown --probes {sorted(set(wanted) - set(PROBES))}: choose from {', '.join(PROBES)}")
    probes = Probes(args.dry_run)
    results = {"emulated": args.dry_run, "torch": torch.__version__, "probes": {}}
    for name in (n for n in PROBES if n in wanted):
        started = time.monotonic()
        try:
            result = PROBES[name](probes)
        except Exception as exc:  # a probe that raises is recorded; the next one runs
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        result["elapsed_s"] = round(time.monotonic() - started, 2)
        results["probes"][name] = result
        print(f"[gpu_probes] {name}: {'ok' if result['ok'] else 'FAILED'} ({result['elapsed_s']} s)", flush=True)
        results["ok"] = all(r["ok"] for r in results["probes"].values())
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0 if results.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
