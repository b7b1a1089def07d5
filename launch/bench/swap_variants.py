"""The variants of the swap benchmarks on a simulated device (launch/bench/bench_executor.py, bench_sweep.py and
bench_dynamic.py build on them): the GPT shapes and batches, PyTorch's ``save_on_cpu`` emulated on an
``EmulatedDevice``, the ``Variant`` that trains one model copy on its own device (with a Chameleon runtime, or
``save_on_cpu`` semantics without one) and records every iteration's device-clock figures, the unswapped
measurement of a shape, the swap floor and the capacity planned from them, the Chameleon and baseline configs,
the link's figures and the per-variant summary over timed rounds. Every figure is emulated device time
(launch/bench/device_clock.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import weakref
from typing import Callable, Iterator

from launch.bench.device_clock import (
    DeviceSpan, clock_delta, clock_mark, iteration_figures, make_device, median_of, physical_bound, restart_host_clock,
)
from launch.bench.harness import VariantSpec, quartiles
from launch.bench.saved_activations import SavedActivations
from launch.models.toy_gpt import GPT, forward_matmul_flop

import torch
from torch import nn
from torch.nn import functional as F

from chameleon_dist import Chameleon
from chameleon_dist.device import UNBOUNDED_CAPACITY_BYTES, EmulatedDevice, storage_key
from chameleon_dist.policy import find_candidates

MIB = 2**20
REPORT_KEYS = ("swap_out_bytes", "swap_in_bytes", "stage", "policy", "passive_swaps", "oom_retries",
               "on_demand_fetches", "pressure_waits", "unmatched", "stage_transition")
"""The ``IterationReport.to_dict()`` keys a Chameleon variant's record keeps as they are (beside its times and
``peak_bytes``, the report's ``peak_device_bytes``)."""
SAVE_ON_CPU_LABEL = "save_on_cpu semantics emulated (synchronous copies, no prefetch)"
# GPT shapes (``--shape``; --layers and the others override one value). "executor": bench_executor's model
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
    """Matmul FLOP of one forward pass and of forward + backward for ``args``' shape (launch/models/toy_gpt.py)."""
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
    """One model, optimizer and device for ``spec``: a Chameleon runtime with ``spec.config``, else
    ``save_on_cpu`` semantics emulated (``spec.saving`` "save_on_cpu"). The model is ``args``' GPT unless one
    is given. ``step`` trains on the given batch and returns the step's record."""

    def __init__(self, spec: VariantSpec, args: argparse.Namespace, device: EmulatedDevice,
                 model: nn.Module | None = None) -> None:
        if spec.config is None and spec.saving != "save_on_cpu":
            raise ValueError(f"variant {spec.name!r}: without a config it runs save_on_cpu semantics only "
                             f"(saving={spec.saving!r})")
        self.spec = spec
        self.device = device
        self.model = make_model(args) if model is None else model
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr)
        self.chameleon: Chameleon | None = None
        self.emulation: SaveOnCpuEmulation | None = None
        if spec.config is not None:
            self.chameleon = Chameleon(spec.config, device=device)
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
        """One iteration; its record's times are device seconds (launch/bench/device_clock.py)."""
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
def summarize(variants: dict[str, Variant], timed: range, stable_figures_for: tuple[str, ...] = ("chameleon",)) -> dict:
    """Per variant, over the ``timed`` rounds: times, ratios to the reference (``spec.reference``: the
    unconstrained run; the same round), stall, swapped bytes, peak, its device's capacity (None: unbounded),
    stages, and bit-identity (losses from its first round on, final parameters) against the reference; the
    variants in ``stable_figures_for`` also get the figures over their Stable rounds."""
    [reference] = [v for v in variants.values() if v.spec.reference]
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
            "capacity_mib": None if v.device.capacity_bytes == UNBOUNDED_CAPACITY_BYTES else v.device.capacity_bytes / MIB,
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
    variant = Variant(VariantSpec("floor", {"min_swap_bytes": args.min_swap_bytes}), args,
                      make_device(args, UNBOUNDED_CAPACITY_BYTES))
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


# ---- configs and link ---------------------------------------------------------------------------
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
    the share of the saved activation bytes it moves in the forward's compute shadow (launch/bench/device_clock.py)."""
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
