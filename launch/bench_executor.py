"""Hidden transfers (issue 5): iteration time and stall with Chameleon against an unconstrained run on the
same simulated device (an accelerator preset at its real rates, on the device clock); the same ratios for
the baseline executor (swap every eligible tensor, bring it back on demand) and for PyTorch's ``save_on_cpu``.

Every variant trains its own copy of one plain-PyTorch GPT (identical initialisation, the same batches,
plain SGD) on its own ``EmulatedDevice`` built from ``--preset`` at the preset's real link rate, with
``--host-op-s`` host seconds per op (default 2e-5: every run repeats exactly; ``measured``: the host's own
time). See launch/device_clock.py for what every figure means; all are emulated device-clock figures.

1. unconstrained: ``enabled: false`` (metering and the cheap signature only, nothing swapped), capacity
   unbounded: the reference time.
2. chameleon: capacity = the unswapped peak minus ``--hide-share`` of the bytes the link moves in one
   forward pass's device time (the compute stream's busy seconds in the unconstrained forward), or
   ``--capacity-fraction`` x the peak: swapping is needed, and what must leave the device fits in the
   link's time. WarmUp + GenPolicy trials run in the untimed rounds (more rounds while the runtime is not
   in Stable, up to twice as many), then the timed rounds follow.
3. baseline: the same capacity, ``profiler.warmup_iterations: 0`` (no trace, hence no policy: every saved
   tensor >= ``min_swap_bytes`` leaves the device and comes back on demand with a look-ahead of
   ``executor.prefetch_depth``). ``warmup_iterations`` huge would keep it too, but then every iteration
   records a detailed trace, whose cost is not the executor's; see ``--baseline-profiled``.
4. save_on_cpu semantics emulated (synchronous copies, no prefetch): ``torch.autograd.graph.save_on_cpu``
   is a no-op for CPU tensors, so a ``saved_tensors_hooks`` pair does what it does on a GPU: every saved
   activation goes to the host when autograd saves it and comes back when backward unpacks it, each copy
   waited for at once over the emulated link. Capacity unbounded (it cannot choose what to keep); no
   runtime, only ``device.active()`` metering, its iteration timed by two marks on the compute stream.
   Two simplifications, both in its favour: views that share a storage share one copy (PyTorch copies
   every saved tensor on its own), and parameters saved by matmuls stay (PyTorch copies them too).

Gradients stay allocated between steps (``zero_grad(set_to_none=False)``, like a framework's gradient
buffer), so the peak is where activations are live, not where fresh gradients pile up at the end of
backward. One torch thread by default: on a shared 2-core machine two threads stall each other.

Iterations are interleaved in rounds (Williams-balanced orders; with a fixed host cost the order changes
nothing, with the measured one it spreads the machine's noise). Per variant: median iteration device time,
the median over rounds of its time over the unconstrained time of the same round, stall as a share of the
unconstrained time, the host-bound share (device idle waiting for the host), bytes swapped out per
iteration and their share of the saved activation bytes next to the physical bound (the share the link
could move in the forward's compute shadow), peak device memory. Losses of every step and the final
parameters are compared with ``torch.equal`` to the unconstrained run's.

    .venv/bin/python -m launch.bench_executor --json runs/bench_executor.json   # a few minutes on 2 cores
    .venv/bin/python -m launch.bench_executor --host-op-s measured              # the host's measured time
    .venv/bin/python -m launch.bench_executor --small                           # seconds (smoke test)
    .venv/bin/python -m launch.bench_executor --shape llm-like                  # wider layers (see SHAPES)

launch/bench_sweep.py runs this benchmark over hide-shares and links (it imports the pieces from here).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator

from launch.device_clock import (
    DeviceSpan, add_device_arguments, clock_delta, clock_mark, device_figures, host_bound_label,
    iteration_figures, make_device, median_of, physical_bound, restart_host_clock,
)
from launch.harness import quartiles, run_benchmark
from launch.saved_activations import SavedActivations
from launch.toy_gpt import GPT, forward_matmul_flop

import torch
from torch import nn
from torch.nn import functional as F

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.factory import UNBOUNDED_CAPACITY_BYTES
from chameleon_dist.device.meter import storage_key
from chameleon_dist.policy.candidates import find_candidates
from chameleon_dist.policy.model import Decision

MIB = 2**20
VARIANTS = ("unconstrained", "chameleon", "baseline", "save_on_cpu")
WILLIAMS_4 = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))  # harness.balanced_orders(4): each before each other once
REPORT_KEYS = ("swap_out_bytes", "swap_in_bytes", "stage", "policy", "passive_swaps", "oom_retries",
               "on_demand_fetches", "pressure_waits", "unmatched", "stage_transition")
"""The ``IterationReport.to_dict()`` keys a Chameleon variant's record keeps as they are (beside its times and
``peak_bytes``, the report's ``peak_device_bytes``)."""
SAVE_ON_CPU_LABEL = "save_on_cpu semantics emulated (synchronous copies, no prefetch)"
# GPT shapes (``--shape``; --layers and the others override one value). "executor": this benchmark's own model
# (~380 forward matmul FLOP per saved-activation byte). "llm-like": the most compute per saved byte a shared 2-core
# CPU trains in about a second per iteration: ~725 in fp32, twice the executor shape's (Llama2-7B at seq 4096 in
# bf16 does ~3,400: fp32 activations take twice the bytes, and the count grows with the hidden size, ~0.375 x
# hidden + seq / 16 here, so the budget goes to the hidden size rather than to the sequence); two layers, so that
# one layer's activations can travel while the other computes. With 16 tokens its matmuls are memory-bound on
# the simulated device (reading the weights takes longer than their FLOPs), so the link moves a larger share of
# the activations during one forward pass than the FLOP count alone says. "small": the smoke test's.
SHAPES = {
    "executor": {"layers": 4, "hidden": 1024, "heads": 8, "seq": 32, "batch": 1, "vocab": 512},
    "llm-like": {"layers": 2, "hidden": 2048, "heads": 16, "seq": 16, "batch": 1, "vocab": 512},
    "small": {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "batch": 1, "vocab": 128},
}


# ---- model --------------------------------------------------------------------------------------
def make_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(args.vocab, args.hidden, args.heads, args.layers)


def model_flop(args: argparse.Namespace) -> dict:
    """Matmul FLOP of one forward pass and of forward + backward for ``args``' shape (launch/toy_gpt.py)."""
    forward = forward_matmul_flop(args.vocab, args.hidden, args.layers, args.seq, args.batch)
    return {"forward_matmul_flop": forward, "iteration_matmul_flop": 3 * forward}


def add_model_arguments(parser: argparse.ArgumentParser, default_shape: str) -> None:
    """``--shape`` and the per-value overrides (--layers, --hidden, --heads, --seq, --batch, --vocab)."""
    parser.add_argument("--shape", default=default_shape, choices=list(SHAPES),
                        help="GPT shape; the options below override single values (default %(default)s)")
    for name in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None, help="default: from --shape")


def apply_shape(args: argparse.Namespace) -> None:
    """Fill the shape values not given on the command line from ``SHAPES[args.shape]``."""
    for name, value in SHAPES[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def host_batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)


# ---- save_on_cpu on the emulated device -------------------------------------------------------------
class _HostCopy:
    """One storage on the host; after its first unpack, its bytes on the device again (shared by views)."""

    __slots__ = ("host", "nbytes", "version", "device_bytes", "_pool", "__weakref__")

    def __init__(self, host: torch.Tensor, version: int, pool) -> None:
        self.host: torch.Tensor | None = host
        self.nbytes = host.numel()
        self.version = version
        self.device_bytes: torch.Tensor | None = None
        self._pool = pool

    def __del__(self) -> None:
        if self.host is not None:
            self._pool.release(self.host)


class SaveOnCpuEmulation:
    """``save_on_cpu`` on an ``EmulatedDevice``: pack copies the saved activation's storage to the host and
    waits for it; unpack copies it back and waits, then rebuilds the exact view (``set_``), like the
    executor's records. Parameters and non-device tensors are saved as they are."""

    def __init__(self, device: EmulatedDevice, model: nn.Module) -> None:
        self.device = device
        self.parameter_keys = {storage_key(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
        self.swap_out_bytes = 0
        self.swap_in_bytes = 0
        # storage key -> (the storage, its copy), both weakly: a copy lives as long as a saved tensor's packed
        # form holds it, as PyTorch's copies do. (Holding the copy here kept it, and its restored device bytes,
        # until another storage took the same key, at a point that changes from process to process with the
        # addresses malloc hands out: the peak differed between runs with the same fixed host cost.)
        self._copies: dict[int, tuple[weakref.ReferenceType, weakref.ReferenceType]] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.swap_out_bytes = self.swap_in_bytes = 0
        self._copies.clear()
        try:
            with self.device.active(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._copies.clear()

    def _pack(self, tensor: torch.Tensor):
        if (type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.requires_grad and tensor.is_leaf
                or not self.device.is_device_tensor(tensor)):
            return tensor
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        if key in self.parameter_keys:
            return tensor
        known = self._copies.get(key)
        copy = known[1]() if known is not None and known[0]() is storage else None
        if copy is None or copy.version != tensor._version:
            handle = self.device.copy_to_host(storage)
            if handle is None:  # host budget full: stays on the device
                return tensor
            copy = _HostCopy(self.device.wait(handle), tensor._version, self.device.host_pool)
            self._copies[key] = (weakref.ref(storage), weakref.ref(copy))
            self.swap_out_bytes += copy.nbytes
        return (copy, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        copy, dtype, size, stride, offset = packed
        if copy.device_bytes is None:
            copy.device_bytes = self.device.wait(self.device.copy_to_device(copy.host))
            self.device.release_host(copy.host)
            copy.host = None
            self.swap_in_bytes += copy.nbytes
        return torch.empty(0, dtype=dtype).set_(copy.device_bytes.untyped_storage(), offset, size, stride)


# ---- variants -----------------------------------------------------------------------------------
class Variant:
    """One model, optimizer and device; ``step`` trains on the given batch and returns the step's record."""

    def __init__(self, name: str, args: argparse.Namespace, device: EmulatedDevice, config: dict | None) -> None:
        self.name = name
        self.device = device
        self.model = make_model(args)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr)
        self.chameleon: Chameleon | None = None
        self.emulation: SaveOnCpuEmulation | None = None
        if config is not None:
            self.chameleon = Chameleon(config, device=device)
            self.chameleon.attach(self.model)
        else:
            device.track_module(self.model)
            self.emulation = SaveOnCpuEmulation(device, self.model)
        self.losses: list[torch.Tensor] = []
        self.records: list[dict] = []
        self.first_round = 0  # the round of its first step (``join_from``); records[i] is round first_round + i

    def join_from(self, reference: "Variant", round_index: int) -> None:
        """Start at round ``round_index`` from ``reference``'s parameters (it played the rounds before, on the
        same batches): a variant that learns nothing from those rounds skips them. Its losses and final
        parameters are then compared from that round on. Gradients are not copied: between steps the
        reference's are zero, and this variant's first step allocates its own inside its iteration (metered),
        like every variant's first step."""
        assert not self.records, "join before the first step"
        with torch.no_grad():
            for mine, theirs in zip(self.model.parameters(), reference.model.parameters(), strict=True):
                assert theirs.grad is None or not theirs.grad.any(), "the reference is between steps"
                mine.copy_(theirs)
        self.first_round = round_index

    def _closure(self, batch: torch.Tensor) -> Callable[[], torch.Tensor]:
        def closure() -> torch.Tensor:
            data = batch.clone()  # the batch arrives on the device inside the iteration (metered)
            logits = self.model(data[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
            loss.backward()
            return loss.detach()

        return closure

    def step(self, batch: torch.Tensor) -> dict:
        """One iteration; its record's times are device seconds (launch/device_clock.py)."""
        gc.collect()
        closure = self._closure(batch)
        device = self.device
        if self.chameleon is not None:
            before = clock_mark(device)
            restart_host_clock(device)
            loss = self.chameleon.run_iteration(closure, optimizer=self.optimizer)
            r = self.chameleon.last_report.to_dict()
            record = {"iteration_s": r["iteration_s"], "stall_s": r["stall_s"], "peak_bytes": r["peak_device_bytes"],
                      **{key: r[key] for key in REPORT_KEYS},
                      **iteration_figures(r["iteration_s"], r["stall_s"], clock_delta(device, before), device)}
        else:
            device.reset_peak()
            span = DeviceSpan(device).start()
            restart_host_clock(device)
            with self.emulation.active():
                loss = closure()
                self.optimizer.step()
            f = span.stop()
            record = {"iteration_s": f["elapsed_s"], "stall_s": f["stall_s"],
                      "peak_bytes": device.peak_bytes(), "swap_out_bytes": self.emulation.swap_out_bytes,
                      "swap_in_bytes": self.emulation.swap_in_bytes, "stage": "", "policy": "", "passive_swaps": 0,
                      "oom_retries": 0, "on_demand_fetches": 0, "pressure_waits": 0, "unmatched": 0,
                      "stage_transition": None, **iteration_figures(f["elapsed_s"], f["stall_s"], f, device)}
        self.optimizer.zero_grad(set_to_none=False)  # gradients stay in place, like a framework grad buffer
        self.losses.append(loss.clone())  # a copy made outside the iteration: not device memory
        self.records.append(record)
        return record


def measure_unswapped(args: argparse.Namespace, measured_iterations: int = 2) -> dict:
    """Peak device bytes without swapping (enabled: false, unbounded), the forward pass's device time (the compute
    stream's busy seconds between a mark before it and one after the loss: the compute's shadow) and its elapsed
    device time (the two marks apart), the iteration's device time, compute-busy time and host-bound share
    (medians over ``measured_iterations`` after the WarmUp iterations) and the sizes of the saved activation
    storages, noted in the first (WarmUp) iteration only: with a saved-tensor hook installed, autograd hands the
    hook a ``detach`` of every saved output, one more op each, which would lengthen the timed iterations."""
    device = make_device(args, UNBOUNDED_CAPACITY_BYTES)
    chameleon = Chameleon({"enabled": False}, device=device)
    model = chameleon.attach(make_model(args))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    warmup = chameleon.config.profiler.warmup_iterations
    peaks, forwards, iterations = [], [], []
    saved = SavedActivations(model.parameters(), device.is_device_tensor)

    for step in range(warmup + measured_iterations):
        batch = host_batch(args, step)

        def closure() -> torch.Tensor:
            span = DeviceSpan(device).start(stall=False)  # inside the iteration: resolve nothing
            data = batch.clone()
            with saved.hooks() if step == 0 else contextlib.nullcontext():
                loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
            forwards.append(span.stop())
            loss.backward()
            return loss.detach()

        gc.collect()
        before = clock_mark(device)
        restart_host_clock(device)
        chameleon.run_iteration(closure, optimizer=optimizer)
        optimizer.zero_grad(set_to_none=False)  # gradients stay in place, like a framework grad buffer
        r = chameleon.last_report
        peaks.append(r.peak_device_bytes)
        iterations.append({"iteration_s": r.iteration_s, **iteration_figures(r.iteration_s, r.stall_s,
                                                                              clock_delta(device, before))})
    measured = iterations[warmup:]
    return {"peak_bytes": max(peaks[1:]), "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "forward_device_s": statistics.median(f["compute_busy_s"] for f in forwards[warmup:]),
            "forward_elapsed_s": statistics.median(f["elapsed_s"] for f in forwards[warmup:]),
            "iteration_s": median_of(measured, "iteration_s"), "iteration_busy_s": median_of(measured, "compute_busy_s"),
            "host_bound_share": median_of(measured, "host_bound_share"),
            "saved_storage_bytes": sorted(saved.bytes_by_storage.values(), reverse=True)}


# ---- statistics -----------------------------------------------------------------------------------
def summarize(variants: dict[str, Variant], timed: range, capacity_bytes: int,
              stable_figures_for: tuple[str, ...] = ("chameleon",)) -> dict:
    """Per variant, over the ``timed`` rounds: times, ratios to "unconstrained" (the same round), stall, swapped
    bytes, peak, stages, and bit-identity (losses from its first round on, final parameters) against
    "unconstrained"; the variants in ``stable_figures_for`` also get the figures over their Stable rounds."""
    reference = variants["unconstrained"]
    ref_times = [reference.records[i]["iteration_s"] for i in timed]
    ref_params = [p.detach() for p in reference.model.parameters()]
    out = {}
    for name, v in variants.items():
        ref_losses = reference.losses[v.first_round:]
        rows = [v.records[i - v.first_round] for i in timed]
        times = [r["iteration_s"] for r in rows]
        ratios = [t / u for t, u in zip(times, ref_times)]
        stall_shares = [r["stall_s"] / u for r, u in zip(rows, ref_times)]
        losses_equal = sum(torch.equal(a, b) for a, b in zip(v.losses, ref_losses))
        params_equal = sum(torch.equal(a, b.detach()) for a, b in zip(ref_params, v.model.parameters()))
        stages = [r["stage"] for r in rows]
        out[name] = {
            "median_iteration_s": statistics.median(times),
            "min_iteration_s": min(times),
            "max_iteration_s": max(times),
            "ratio": statistics.median(ratios),  # paired per round, median over rounds
            "ratio_of_medians": statistics.median(times) / statistics.median(ref_times),
            "ratio_iqr": quartiles(ratios),
            "median_stall_s": statistics.median(r["stall_s"] for r in rows),
            "stall_share": statistics.median(stall_shares),  # stall / unconstrained time of the same round
            "swap_out_mib": statistics.median(r["swap_out_bytes"] for r in rows) / MIB,
            "swap_in_mib": statistics.median(r["swap_in_bytes"] for r in rows) / MIB,
            "peak_mib": max(r["peak_bytes"] for r in rows) / MIB,
            "capacity_mib": None if name in ("unconstrained", "save_on_cpu") else capacity_bytes / MIB,
            "stages": {s: stages.count(s) for s in sorted(set(stages)) if s},
            "policies": sorted({r["policy"] for r in rows if r["policy"]}),
            "passive_swaps": sum(r["passive_swaps"] for r in rows),
            "oom_retries": sum(r["oom_retries"] for r in rows),
            "on_demand_fetches": statistics.median(r["on_demand_fetches"] for r in rows),
            "pressure_waits": sum(r["pressure_waits"] for r in rows),
            "unmatched": max(r["unmatched"] for r in rows),
            "transitions": [(v.first_round + i, rec["stage_transition"]) for i, rec in enumerate(v.records)
                            if rec["stage_transition"]],
            "losses_equal": losses_equal,
            "losses_compared": len(ref_losses),
            "parameters_equal": params_equal,
            "parameters_compared": len(ref_params),
            "bit_identical": losses_equal == len(ref_losses) == len(v.losses) and params_equal == len(ref_params),
            "iteration_s": times,
            "stall_s": [r["stall_s"] for r in rows],
            "compute_busy_s": median_of(rows, "compute_busy_s"),
            "host_bound_share": median_of(rows, "host_bound_share"),
            "host_bound_shares": [r["host_bound_share"] for r in rows],
            "d2h_busy_s": median_of(rows, "d2h_busy_s"),
            "device_ops": median_of(rows, "device_ops"),
        }
        stable = [i for i, r in enumerate(rows) if r["stage"] == "stable"]
        if name in stable_figures_for:  # the same figures over the rounds it ran in Stable only
            out[name]["stable_rounds"] = len(stable)
            out[name]["ratio_stable"] = statistics.median(ratios[i] for i in stable) if stable else None
            out[name]["stall_share_stable"] = statistics.median(stall_shares[i] for i in stable) if stable else None
    return out


# ---- capacity -------------------------------------------------------------------------------------
REDUCTION_CAP = 0.75  # a capacity takes off the peak at most this share of (unswapped peak - swap floor)


def measure_swap_floor_bytes(args: argparse.Namespace) -> int:
    """The lowest peak any swap could reach: every swap candidate (saved storage >= min_swap_bytes) off the device
    from its last forward use to its first backward use, copies instant. From the detailed trace of the second
    WarmUp iteration (gradients allocated, as in every later one) of a swap-everything run; the windows are op
    indices, so the link and the clock do not matter. (The policy generator computes the same floor to explain an
    infeasible budget; it is not public.)"""
    variant = Variant("floor", args, make_device(args, UNBOUNDED_CAPACITY_BYTES), {"min_swap_bytes": args.min_swap_bytes})
    for step in range(max(2, variant.chameleon.config.profiler.warmup_iterations)):
        variant.step(host_batch(args, step))
    trace = variant.chameleon.last_trace
    leaves = [0] * (len(trace.ops) + 1)  # bytes off the device from this op on
    for candidate in find_candidates(trace, args.min_swap_bytes):
        leaves[candidate.last_forward_use + 1] += candidate.nbytes
        leaves[candidate.first_backward_use] -= candidate.nbytes
    off_bytes, floor_bytes = 0, 0
    for i, live_bytes in enumerate(trace.no_swap_memory_curve()):
        off_bytes += leaves[i]
        floor_bytes = max(floor_bytes, live_bytes - off_bytes)
    return floor_bytes


def plan_capacity(unswapped: dict, floor_bytes: int, link_in_forward_bytes: float, share: float) -> dict:
    """A capacity: the unswapped peak minus ``share`` x the link's bytes in one forward pass's device time, at most
    ``REDUCTION_CAP`` of (unswapped peak - swap floor). On an accelerator's real link the forward's shadow often
    holds more than every saved byte (the physical bound is 100%): then the cap decides, and the plan says so."""
    wanted_bytes = share * link_in_forward_bytes
    reduction_bytes = min(wanted_bytes, REDUCTION_CAP * max(0, unswapped["peak_bytes"] - floor_bytes))
    capacity_bytes = int(unswapped["peak_bytes"] - reduction_bytes)
    saved_bytes = sum(unswapped["saved_storage_bytes"])
    return {"capacity_bytes": capacity_bytes, "capacity_fraction": capacity_bytes / unswapped["peak_bytes"],
            "reduction_needed_bytes": unswapped["peak_bytes"] - capacity_bytes,
            "reduction_share_of_saved": (unswapped["peak_bytes"] - capacity_bytes) / saved_bytes,
            "reduction_capped": reduction_bytes < wanted_bytes,
            "effective_hide_share": reduction_bytes / link_in_forward_bytes if link_in_forward_bytes > 0 else 0.0,
            "link_bytes_in_forward": link_in_forward_bytes, "swap_floor_bytes": floor_bytes}


# ---- run ----------------------------------------------------------------------------------------
def chameleon_config(args: argparse.Namespace, allow_recompute: bool | None = None) -> dict:
    """The Chameleon variant's config: the whole capacity as budget, ``args``' min_swap_bytes, prefetch depth
    and policy trials; ``allow_recompute`` sets ``executor.allow_recompute`` (None: the default)."""
    executor = {"prefetch_depth": args.prefetch_depth}
    if allow_recompute is not None:
        executor["allow_recompute"] = allow_recompute
    return {"min_swap_bytes": args.min_swap_bytes, "memory_budget": 1.0, "executor": executor,
            "profiler": {"policy_trials": args.policy_trials}}


def baseline_config(args: argparse.Namespace) -> dict:
    """The swap-everything baseline's config: no trace, hence no policy (``--baseline-profiled``: WarmUp forever)."""
    warmup = 10**6 if getattr(args, "baseline_profiled", False) else 0
    return {"min_swap_bytes": args.min_swap_bytes, "memory_budget": 1.0,
            "executor": {"prefetch_depth": args.prefetch_depth}, "profiler": {"warmup_iterations": warmup}}


def link_figures(d2h_bytes_per_s: float, unswapped: dict) -> dict:
    """What the link can move in the unswapped run's forward and iteration device times, and the physical bound:
    the share of the saved activation bytes it moves in the forward's compute shadow (launch/device_clock.py)."""
    saved_bytes = sum(unswapped["saved_storage_bytes"])
    return {
        "emulated": True, "d2h_bytes_per_s": d2h_bytes_per_s, "saved_activation_bytes": saved_bytes,
        "forward_device_s": unswapped["forward_device_s"], "forward_elapsed_s": unswapped["forward_elapsed_s"],
        "link_bytes_in_forward": d2h_bytes_per_s * unswapped["forward_device_s"],
        "link_bytes_in_iteration": d2h_bytes_per_s * unswapped["iteration_s"],
        "physical_bound": physical_bound(d2h_bytes_per_s, unswapped["forward_device_s"], saved_bytes),
        "bound_with_host_gaps": physical_bound(d2h_bytes_per_s, unswapped["forward_elapsed_s"], saved_bytes),
        "unconstrained_host_bound_share": unswapped["host_bound_share"],
    }


def add_moved_shares(summary: dict, saved_bytes: int, bound: float) -> None:
    """Each variant's share of the saved activation bytes moved to the host per iteration, beside the bound."""
    for v in summary.values():
        v["moved_share"] = v["swap_out_mib"] * MIB / saved_bytes
        v["physical_bound"] = bound


def run(args: argparse.Namespace) -> dict:
    unswapped = measure_unswapped(args)
    d2h_bytes_per_s = make_device(args, 1).d2h_bytes_per_s
    link = link_figures(d2h_bytes_per_s, unswapped)
    link_in_forward_bytes = link["link_bytes_in_forward"]
    floor_bytes = measure_swap_floor_bytes(args)
    plan = plan_capacity(unswapped, floor_bytes, link_in_forward_bytes, args.hide_share)
    if args.capacity_fraction is not None:
        capacity_bytes = int(args.capacity_fraction * unswapped["peak_bytes"])
    else:  # take off the peak a share of what the link can move while the forward pass computes (capped)
        capacity_bytes = plan["capacity_bytes"]

    def device(capacity: int) -> EmulatedDevice:
        return make_device(args, capacity)

    variants = {
        "unconstrained": Variant("unconstrained", args, device(UNBOUNDED_CAPACITY_BYTES), {"enabled": False}),
        "chameleon": Variant("chameleon", args, device(capacity_bytes), chameleon_config(args)),
        "baseline": Variant("baseline", args, device(capacity_bytes), baseline_config(args)),
        "save_on_cpu": Variant("save_on_cpu", args, device(UNBOUNDED_CAPACITY_BYTES), None),
    }
    cham = variants["chameleon"].chameleon
    # untimed rounds: at least --warmup-rounds and all of chameleon's WarmUp + GenPolicy iterations; then more
    # (up to as many again) while chameleon is not yet in Stable (a trial's passive swap restarts WarmUp)
    warm_rounds = max(args.warmup_rounds, cham.config.profiler.warmup_iterations + args.policy_trials)
    order_log = []

    def play(r: int) -> None:
        batch = host_batch(args, r)
        order = [VARIANTS[i] for i in WILLIAMS_4[r % 4]]
        order_log.append(order)
        for name in order:
            variants[name].step(batch)
        if args.verbose:
            print(f"round {r:3d} " + " ".join(f"{n} {variants[n].records[-1]['iteration_s']:.3f}" for n in VARIANTS)
                  + f" | chameleon {variants['chameleon'].records[-1]['stage']}", flush=True)

    start_s = time.perf_counter()
    for r in range(warm_rounds):
        play(r)
    planned_warm_rounds = warm_rounds
    while cham.stage != "stable" and warm_rounds < 2 * planned_warm_rounds:
        play(warm_rounds)
        warm_rounds += 1
    ready_stage = cham.stage
    rounds = warm_rounds + args.rounds
    for r in range(warm_rounds, rounds):
        play(r)
    rounds_s = time.perf_counter() - start_s
    timed = range(warm_rounds, rounds)
    summary = summarize(variants, timed, capacity_bytes)
    add_moved_shares(summary, link["saved_activation_bytes"], link["physical_bound"])
    trials = [{"policy": t.policy.name, "iteration_s": t.iteration_s, "peak_mib": t.peak_bytes / MIB, "held": t.held}
              for t in cham.controller.results]
    chosen = cham.controller.chosen
    c = summary["chameleon"]
    checks = {
        "chameleon_stable_throughout": c["stages"] == {"stable": len(timed)} and bool(c["policies"])
        and c["passive_swaps"] == 0 and c["oom_retries"] == 0,
        "stage_when_timing_began": ready_stage,
        "chameleon_ratio_at_most_1.05": c["ratio"] <= 1.05,
        "chameleon_stall_at_most_2pct": c["stall_share"] <= 0.02,
        "chameleon_peak_within_capacity": c["peak_mib"] * MIB <= capacity_bytes,
        "all_bit_identical": all(summary[n]["bit_identical"] for n in VARIANTS),
    }
    flop = model_flop(args)
    return {
        "device": device_figures(args),
        "link": link,
        "model": {"parameters": sum(p.numel() for p in variants["unconstrained"].model.parameters()),
                  "parameter_bytes": unswapped["parameter_bytes"], "unswapped_peak_bytes": unswapped["peak_bytes"],
                  "capacity_bytes": capacity_bytes, "capacity_fraction": capacity_bytes / unswapped["peak_bytes"],
                  "capacity_rule": (f"--capacity-fraction {args.capacity_fraction}" if args.capacity_fraction is not None
                                    else f"peak - {args.hide_share:g} x link bytes in one forward pass"
                                    + (f", capped at {REDUCTION_CAP:.0%} of (peak - swap floor): hide-share "
                                       f"{plan['effective_hide_share']:.3g} in effect" if plan["reduction_capped"] else "")),
                  "swap_floor_bytes": floor_bytes,
                  "reduction_capped": args.capacity_fraction is None and plan["reduction_capped"],
                  "forward_device_s": unswapped["forward_device_s"], "forward_elapsed_s": unswapped["forward_elapsed_s"],
                  "iteration_s": unswapped["iteration_s"], "iteration_busy_s": unswapped["iteration_busy_s"],
                  "reduction_needed_bytes": unswapped["peak_bytes"] - capacity_bytes,
                  "link_bytes_in_forward": link_in_forward_bytes,
                  "link_bytes_in_iteration": link["link_bytes_in_iteration"],
                  "saved_activation_bytes": sum(unswapped["saved_storage_bytes"]),
                  **flop, "forward_flop_per_saved_byte": flop["forward_matmul_flop"] / sum(unswapped["saved_storage_bytes"]),
                  "eligible_bytes": sum(b for b in unswapped["saved_storage_bytes"] if b >= args.min_swap_bytes),
                  "eligible_storages": sum(b >= args.min_swap_bytes for b in unswapped["saved_storage_bytes"])},
        "chameleon_policy": None if chosen is None else {
            "name": chosen.name, "feasible": chosen.feasible, "predicted_peak_mib": chosen.predicted_peak_bytes / MIB,
            "predicted_stall_s": chosen.predicted_stall_s, "predicted_iteration_s": chosen.predicted_iteration_s,
            "swap_mib": chosen.saved_bytes(Decision.SWAP) / MIB, "swapped_storages": sum(e.decision == Decision.SWAP for e in chosen.entries),
            "recompute_mib": chosen.saved_bytes(Decision.RECOMPUTE) / MIB,
            "recomputed_storages": sum(e.decision == Decision.RECOMPUTE for e in chosen.entries),
            "version": cham.controller.version},
        "trials": trials,
        "chameleon_rounds": [{"round": i, "stage": x["stage"], "policy": x["policy"], "iteration_s": x["iteration_s"],
                              "stall_s": x["stall_s"], "peak_mib": x["peak_bytes"] / MIB,
                              "swap_out_mib": x["swap_out_bytes"] / MIB, "passive_swaps": x["passive_swaps"],
                              "oom_retries": x["oom_retries"], "on_demand_fetches": x["on_demand_fetches"]}
                             for i, x in enumerate(variants["chameleon"].records)],
        "min_swap_bytes_after": {n: variants[n].chameleon.executor.min_swap_bytes for n in ("chameleon", "baseline")},
        "variants": summary,
        "checks": checks,
        "rounds": {"warmup": warm_rounds, "warmup_planned": planned_warm_rounds, "timed": args.rounds, "orders": order_log[:4], "wall_s": rounds_s},
    }


# ---- report -------------------------------------------------------------------------------------
def print_report(r: dict) -> None:
    m, dev, link, mod = r["machine"], r["device"], r["link"], r["model"]
    print(f"command: {r['command']}")
    print(f"date: {r['date']}; {m['cpu']} ({m['cpus']} CPUs), {m['torch_threads']} torch threads, torch {m['torch']}; "
          f"load average {m['load_average_before']:.2f} before, {m['load_average_after']:.2f} after "
          f"(other jobs share this machine)")
    print_device(dev)
    c = r["config"]
    print(f"model: GPT {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, seq {c['seq']}, batch "
          f"{c['batch']}, vocab {c['vocab']}, fp32, SGD; {mod['parameters'] / 1e6:.2f} M parameters "
          f"({mod['parameter_bytes'] / MIB:.1f} MiB)")
    print(f"unswapped peak {mod['unswapped_peak_bytes'] / MIB:.2f} MiB; capacity {mod['capacity_bytes'] / MIB:.2f} MiB "
          f"({mod['capacity_fraction']:.2%}; {mod['capacity_rule']}): {mod['reduction_needed_bytes'] / MIB:.2f} MiB to take "
          f"off the peak")
    print_link(link)
    print(f"saved activations {mod['saved_activation_bytes'] / MIB:.2f} MiB per iteration, {mod['eligible_bytes'] / MIB:.2f} "
          f"MiB in {mod['eligible_storages']} storages >= min_swap_bytes {c['min_swap_bytes'] / 1024:.0f} KiB; "
          f"prefetch depth {c['prefetch_depth']}; {mod['forward_flop_per_saved_byte']:,.0f} forward matmul FLOP per "
          f"saved byte")
    print(f"rounds: "
          f"{r['rounds']['warmup']} untimed (planned {r['rounds']['warmup_planned']}; more while chameleon was not in "
          f"Stable) + {r['rounds']['timed']} timed, Williams-balanced order; "
          f"ratio = median over rounds of (variant / unconstrained, same round)")
    print()
    print(f"{'variant':<15}{'median ms':>10}{'ratio':>7}{'IQR':>13}{'stall ms':>9}{'stall %':>8}{'host-bd %':>10}"
          f"{'ops/it':>7}{'out MiB/it':>11}{'moved %':>8}{'bound %':>8}{'peak MiB':>9}{'capacity':>9}{'bit-identical':>15}"
          "   (emulated)")
    for name, v in r["variants"].items():
        cap = "unbound" if v["capacity_mib"] is None else f"{v['capacity_mib']:.2f}"
        iqr = f"{v['ratio_iqr'][0]:.2f}-{v['ratio_iqr'][1]:.2f}"
        same = f"{'yes' if v['bit_identical'] else 'NO'} {v['losses_equal']}/{v['losses_compared']}"
        print(f"{name:<15}{v['median_iteration_s'] * 1e3:>10.3f}{v['ratio']:>7.3f}{iqr:>13}{v['median_stall_s'] * 1e3:>9.3f}"
              f"{v['stall_share']:>8.1%}{v['host_bound_share']:>10.1%}{v['device_ops']:>7.0f}{v['swap_out_mib']:>11.2f}"
              f"{v['moved_share']:>8.1%}{v['physical_bound']:>8.1%}{v['peak_mib']:>9.2f}{cap:>9}{same:>15}")
    print(f"  device times (emulated); stall % = stall / unconstrained time of the same round; host-bd % = device idle "
          f"waiting for the host (iteration - compute busy - stall) / iteration, "
          f"{host_bound_summary(r['variants'])}; ops/it = aten ops dispatched per iteration (each costs the host "
          f"{host_cost_text(dev)}); moved % = swap-out bytes / saved activation bytes; bound % = physical bound (the "
          f"link's bytes in the forward's compute shadow / saved bytes)")
    print(f"  save_on_cpu = {SAVE_ON_CPU_LABEL}; capacity unbounded, no runtime (no signature), views share one "
          f"copy and parameters stay (both favour it)")
    base = r["config"]["baseline_profiled"]
    print(f"  baseline = swap every saved tensor >= min_swap_bytes, on-demand fetch + prefetch depth "
          f"{c['prefetch_depth']} ({'WarmUp forever: a detailed trace every iteration' if base else 'warmup_iterations 0: no trace, no policy'})")
    cv = r["variants"]["chameleon"]
    pol = r["chameleon_policy"]
    if pol:
        print(f"chameleon: policy {pol['name']} (v{pol['version']}, feasible {pol['feasible']}): swaps "
              f"{pol['swapped_storages']} storages, {pol['swap_mib']:.2f} MiB, recomputes {pol['recomputed_storages']} "
              f"storages, {pol['recompute_mib']:.2f} MiB; predicted peak {pol['predicted_peak_mib']:.2f} "
              f"MiB, stall {pol['predicted_stall_s'] * 1e3:.1f} ms; measured stages {cv['stages']}, passive swaps "
              f"{cv['passive_swaps']}, OOM retries {cv['oom_retries']}, on-demand fetches/it {cv['on_demand_fetches']:.0f}, "
              f"pressure waits {cv['pressure_waits']}, unmatched (max) {cv['unmatched']}")
    else:
        print(f"chameleon: NO policy chosen (stages {cv['stages']})")
    warm = [x for x in r["chameleon_rounds"] if x["stage"] == "warmup"]
    if warm:
        share = sum(x["stall_s"] for x in warm) / max(1e-30, sum(x["iteration_s"] for x in warm))
        print(f"  WarmUp iterations (swap all, detailed trace): {len(warm)}, {share:.0%} of their time was stall; the "
              f"trace's iteration time, which calibrates the policy's op times, includes it")
    if cv.get("stable_rounds"):
        print(f"  over the {cv['stable_rounds']} timed rounds in Stable only: ratio {cv['ratio_stable']:.3f}, stall "
              f"{cv['stall_share_stable']:.1%} of the unconstrained time (policy predicted "
              f"{(pol or {}).get('predicted_stall_s', 0) * 1e3:.1f} ms stall)")
    print("  trials: " + "; ".join(f"{t['policy']} {t['iteration_s'] * 1e3:.3f} ms peak {t['peak_mib']:.2f} MiB "
                                   f"{'held' if t['held'] else 'did not hold'}" for t in r["trials"]))
    print("  untimed rounds: " + "; ".join(
        f"{x['stage']}{'/' + x['policy'] if x['policy'] else ''} {x['iteration_s'] * 1e3:.3f} ms out {x['swap_out_mib']:.2f} MiB"
        + (f" passive {x['passive_swaps']}" if x['passive_swaps'] else "") + (f" OOM-retry {x['oom_retries']}" if x['oom_retries'] else "")
        for x in r["chameleon_rounds"][:r["rounds"]["warmup"]]))
    lowered = {n: b for n, b in r["min_swap_bytes_after"].items() if b != c["min_swap_bytes"]}
    if lowered:
        print(f"  NOTE: an out-of-memory retry lowered min_swap_bytes for good: {lowered}")
    for i, transition in cv["transitions"]:
        print(f"  after round {i}{' (timed)' if i >= r['rounds']['warmup'] else ''}: {transition}")
    k = r["checks"]
    print(f"issue 5 targets (emulated): chameleon ratio {cv['ratio']:.3f} <= 1.05: {'met' if k['chameleon_ratio_at_most_1.05'] else 'NOT met'}; "
          f"stall {cv['stall_share']:.1%} <= 2%: {'met' if k['chameleon_stall_at_most_2pct'] else 'NOT met'}; stable throughout "
          f"with its policy: {'yes' if k['chameleon_stable_throughout'] else 'NO'}; peak within capacity: "
          f"{'yes' if k['chameleon_peak_within_capacity'] else 'NO'}; all bit-identical: {'yes' if k['all_bit_identical'] else 'NO'}")
    print(f"wall time {r['wall_s']:.0f} s (rounds {r['rounds']['wall_s']:.0f} s)")


def print_device(dev: dict) -> None:
    print(f"ALL FIGURES EMULATED: {dev['text']}; {dev['host']}")


def print_link(link: dict, name: str = "the link") -> None:
    print(f"{name} ({link['d2h_bytes_per_s'] / 1e9:.3g} GB/s device-to-host, real rate) moves "
          f"{link['link_bytes_in_forward'] / MIB:.2f} MiB in the forward's device time "
          f"({link['forward_device_s'] * 1e3:.3f} ms of kernels; {link['forward_elapsed_s'] * 1e3:.3f} ms elapsed with "
          f"the host's gaps) and {link['link_bytes_in_iteration'] / MIB:.2f} MiB in one unconstrained iteration; saved "
          f"activations {link['saved_activation_bytes'] / MIB:.2f} MiB: physical bound "
          f"{link['physical_bound']:.1%} of them in the compute's shadow ({link['bound_with_host_gaps']:.1%} counting "
          f"the host's gaps); unconstrained run {link['unconstrained_host_bound_share']:.1%} host-bound (emulated)")


def host_cost_text(dev: dict) -> str:
    return "its measured time" if dev["host_op_s"] is None else f"{dev['host_op_s'] * 1e6:g} us"


def host_bound_summary(variants: dict) -> str:
    """Which variants the host's pace set (a label for the report: more than half the iteration idle)."""
    bound = [name for name, v in variants.items() if host_bound_label(v.get("host_bound_share")) == "host-bound"]
    return f"host-bound (> 50%): {', '.join(bound)}" if bound else "no variant host-bound (> 50%)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(parser)
    add_model_arguments(parser, "executor")
    parser.add_argument("--capacity-fraction", type=float, default=None,
                        help="capacity / unswapped peak (default: peak - --hide-share x the bytes the link moves in the "
                             "measured forward time)")
    parser.add_argument("--hide-share", type=float, default=0.25,
                        help="without --capacity-fraction: share of the link's bytes in one forward pass to take off")
    parser.add_argument("--min-swap-kib", type=float, default=128, help="min_swap_bytes in KiB")
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument("--policy-trials", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=16, help="timed rounds (a multiple of 4 balances the order)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on a shared 2-core machine two threads stall each other)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-profiled", action="store_true",
                        help="baseline as WarmUp forever (warmup_iterations 10**6: a detailed trace every iteration)")
    parser.add_argument("--small", action="store_true", help="tiny model and few rounds (smoke test)")
    parser.add_argument("--verbose", action="store_true", help="one line per round")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    apply_shape(args)
    if args.small:
        args.shape = "small"
        for name, value in SHAPES["small"].items():
            setattr(args, name, value)
        args.min_swap_kib, args.rounds, args.warmup_rounds, args.policy_trials = 4, 4, 1, 2
    if args.capacity_fraction is not None and not 0 < args.capacity_fraction <= 1 or args.hide_share <= 0 or args.rounds < 1 or args.hidden % args.heads:
        parser.error("need 0 < --capacity-fraction <= 1, --rounds >= 1 and --hidden divisible by --heads")
    args.min_swap_bytes = int(args.min_swap_kib * 1024)
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run_benchmark("launch.bench_executor", argv, parse_args(argv), torch, run, print_report)


if __name__ == "__main__":
    main()
