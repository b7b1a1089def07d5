"""Chameleon on a real GPU (issue 13, item 5): one GPT at an LLM-like shape, trained by five variants whose
iterations are interleaved in rounds on one CUDA device:

1. no_swap: plain training, the reference for time, memory and bits.
2. chameleon_swap: the runtime on a ``CudaDevice`` (copy streams, CUDA events, pinned host pool), config
   ``executor.allow_recompute: false``.
3. chameleon_recompute: the same with ``executor.allow_recompute: true`` (swap and per-tensor recompute).
4. save_on_cpu: PyTorch's own ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every saved tensor
   (weights included) goes to pinned host memory in forward and comes back in backward, on the compute
   stream (no overlap). Only its pack hook is wrapped, to count the bytes it moves.
5. checkpoint: full activation recomputation, ``torch.utils.checkpoint.checkpoint(block, x,
   use_reentrant=False)`` around every transformer block.

Chameleon gets ``device.capacity`` = the device bytes in use when an iteration starts (every variant's
weights and gradients: they all share the GPU) + ``--budget-fraction`` x the no-swap run's peak above them
(its activation memory, the part swapping can reduce), measured by a probe iteration before the rounds,
and ``memory_budget: 1.0``. The link rates it plans with are measured once with pinned copies
(``launch/gpu_probes.measure_copy_rates``, the GPU check's measurement). Its
WarmUp and GenPolicy iterations run in untimed rounds (more while it is not in Stable, up to twice as many);
then the timed rounds follow. The CUDA allocator does not enforce the capacity: the JSON says whether
each iteration's peak stayed within it.

Every iteration is timed with ``torch.cuda.synchronize`` before and after (the runtime's own
``iteration_s`` is host time). Per variant: the median over timed rounds of its time over no_swap's time
in the same round (round orders rotate), Chameleon's stall (``last_report.stall_s``), the peak from
``torch.cuda.max_memory_allocated`` (reset before each iteration; absolute, and above the iteration's
starting bytes), bytes swapped out per iteration, and bit-identity with no_swap (``torch.equal`` on every
loss and every final parameter; the largest difference when not identical). Gradients stay allocated
between steps (``zero_grad(set_to_none=False)``), and deterministic kernels are requested
(``--determinism strict``: ``torch.use_deterministic_algorithms(True)``, which makes flash attention's
backward deterministic; by default it accumulates with atomics, so two identical runs may differ in their
last bits, and bit-identity would say nothing about Chameleon). The Chameleon runtimes' detailed traces
time layers (forward and backward) with CUDA events; the JSON keeps the last trace's times.

The whole run is time-boxed (``--max-minutes``): rounds stop early when the next one would not fit, and
the JSON says so. Attention runs flash attention's kernel on the GPU (``--attention flash``, the default;
``auto`` lets PyTorch choose, whose other kernels may not have a deterministic backward).

``--dry-run`` runs the same code on the CPU with ``EmulatedDevice`` s (the Chameleon variants on devices of
that capacity with a fast emulated link; the others metered by an unbounded one), at a tiny shape, in
seconds; the test suite runs it. Its times mean nothing; its bits and structure do.

    .venv/bin/python -m launch.bench.bench_gpu --json runs/bench_gpu.json   # on a GPU: ~2-4 min (time box 7 min)
    .venv/bin/python -m launch.bench.bench_gpu --dry-run                    # CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from launch.bench.gpu_probes import measure_copy_rates
from launch.bench.harness import VariantSpec, config_of, rotated, run_benchmark
from launch.bench.saved_activations import SavedActivations
from launch.models.toy_gpt import GPT

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from chameleon_dist import Chameleon
from chameleon_dist.device import UNBOUNDED_CAPACITY_BYTES, Device, EmulatedDevice
from chameleon_dist.policy import Decision

MIB, GIB = 2**20, 2**30
SPECS = (
    VariantSpec("no_swap", reference=True),
    VariantSpec("chameleon_swap", {"executor": {"allow_recompute": False}}),
    VariantSpec("chameleon_recompute", {"executor": {"allow_recompute": True}}),
    VariantSpec("save_on_cpu", saving="save_on_cpu"),
    VariantSpec("checkpoint", saving="checkpoint"),
)
"""The five variants. A Chameleon variant's ``config`` holds its own settings; ``build`` completes it with the
capacity and link measured before the rounds."""
VARIANTS = tuple(spec.name for spec in SPECS)
CHAMELEON = tuple(spec.name for spec in SPECS if spec.config is not None)
[REFERENCE] = [spec.name for spec in SPECS if spec.reference]
# (hidden, heads, seq) tried largest first by the automatic shape; then layers from --max-layers down
AUTO_SHAPES = ((4096, 32, 4096), (4096, 32, 2048), (2048, 16, 2048), (1024, 8, 1024))
AUTO_BATCHES = (2, 1)  # without --batch: two sequences where they fit (an H200), else one
AUTO_MEMORY_SHARE = 0.6  # of the GPU's memory the estimate may use (allocator slack, pinned staging, cuBLAS)
REPORT_KEYS = ("stall_s", "swap_out_bytes", "stage", "policy", "passive_swaps", "oom_retries")
"""The ``IterationReport.to_dict()`` keys a Chameleon variant's record takes from the runtime's report."""
DRY_SHAPE = dict(layers=2, hidden=64, heads=4, seq=32, batch=1, vocab=128)
DRY_LINK_BYTES_PER_S = 10**9  # the dry run checks the code path, not the speed: quick copies on the device clock


# ---- shape --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    vocab: int
    element_bytes: int

    def parameters(self) -> int:
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + 2 * self.vocab * h + 2 * h

    def static_bytes(self) -> int:
        """Weights and (kept) gradients of one copy of the model."""
        return 2 * self.parameters() * self.element_bytes

    def activation_bytes(self) -> int:
        """Estimated activation peak of one iteration: 17 saved hidden-sized tensors per token and layer
        (34 s b h bytes in 16 bits: layer norms, QKV, attention output, MLP with its 4h GELU) plus the logits,
        their log-softmax and gradient."""
        tokens = self.seq * self.batch
        return (17 * self.layers * self.hidden + 3 * self.vocab) * tokens * self.element_bytes

    def estimate_bytes(self, copies: int) -> int:
        return copies * self.static_bytes() + int(1.5 * self.activation_bytes())


def auto_shape(total_bytes: int, args: argparse.Namespace, element_bytes: int) -> tuple[Shape, str]:
    """The largest LLM-like shape (of ``AUTO_SHAPES``, then the most layers up to ``--max-layers``, then batch
    2 before 1) whose estimate for all variants fits ``AUTO_MEMORY_SHARE`` of the GPU; options override."""
    limit = AUTO_MEMORY_SHARE * total_bytes
    for hidden, heads, seq in AUTO_SHAPES:
        for layers in range(args.max_layers, 1, -1):
            for batch in (args.batch,) if args.batch else AUTO_BATCHES:
                shape = Shape(args.layers or layers, args.hidden or hidden, args.heads or heads, args.seq or seq,
                              batch, args.vocab, element_bytes)
                if shape.estimate_bytes(len(VARIANTS)) <= limit:
                    return shape, (f"largest of {AUTO_SHAPES} x layers <= {args.max_layers} x batch {AUTO_BATCHES} "
                                   f"whose estimate ({shape.estimate_bytes(len(VARIANTS)) / GIB:.1f} GiB for "
                                   f"{len(VARIANTS)} copies) fits {AUTO_MEMORY_SHARE:.0%} of {total_bytes / GIB:.1f} GiB")
    raise SystemExit(f"no automatic shape fits {AUTO_MEMORY_SHARE:.0%} of this GPU's {total_bytes / GIB:.1f} GiB: "
                     f"give --layers, --hidden, --heads and --seq")


def choose_shape(args: argparse.Namespace, total_bytes: int | None) -> tuple[Shape, str]:
    element_bytes = torch.tensor([], dtype=args.torch_dtype).element_size()
    if args.dry_run:
        values = {k: getattr(args, k) or v for k, v in DRY_SHAPE.items()}
        return Shape(**values, element_bytes=element_bytes), "--dry-run: tiny shape"
    if None not in (args.layers, args.hidden, args.heads, args.seq):
        return Shape(args.layers, args.hidden, args.heads, args.seq, args.batch or 1, args.vocab, element_bytes), "given"
    return auto_shape(total_bytes, args, element_bytes)


# ---- model and data -----------------------------------------------------------------------------
def make_model(shape: Shape, args: argparse.Namespace) -> GPT:
    """One GPT built on the target device (initialised from ``--seed``), in ``--dtype``."""
    with torch.device(args.torch_device):
        torch.manual_seed(args.seed)
        model = GPT(shape.vocab, shape.hidden, shape.heads, shape.layers)
    return model.to(args.torch_dtype)


def batch_for(shape: Shape, args: argparse.Namespace, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=generator)
    return tokens.to(args.torch_device)


def forward_checkpointed(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """``GPT.forward`` (launch/models/toy_gpt.py) with every block under non-reentrant activation checkpointing."""
    x = model.embed(tokens)
    if model.position is not None:
        x = x + model.position.weight[: tokens.shape[1]]
    for layer in model.layers:
        x = checkpoint(layer, x, use_reentrant=False)
    return model.head(model.norm(x))


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """PyTorch's ``save_on_cpu`` itself; only its pack hook is wrapped, to count the bytes it copies out. On
    the emulated device (CPU tensors) the host copies are host memory, so they are kept out of the meter."""

    def __init__(self, device: Device) -> None:
        super().__init__(pin_memory=True)
        self.swap_out_bytes = 0
        pack = self.pack_hook

        def counting_pack(tensor: torch.Tensor):
            with device.backend.host_side():  # (the emulated device's host copies are host memory)
                packed = pack(tensor)
            self.swap_out_bytes += packed[1].numel() * packed[1].element_size()
            return packed

        self.pack_hook = counting_pack


# ---- variants -----------------------------------------------------------------------------------
class Variant:
    """One copy of the model, its optimizer and the device that meters it: with ``spec.config`` a Chameleon
    runtime on the device it builds (layer times from its timer), else ``device``; ``step`` trains one
    iteration."""

    def __init__(self, spec: VariantSpec, model: GPT, args: argparse.Namespace, device: Device | None = None) -> None:
        if (spec.config is None) == (device is None):
            raise ValueError(f"variant {spec.name!r}: a device without a config, or a config (its runtime builds "
                             "the device), not both")
        self.spec = spec
        runtime = None
        if spec.config is not None:
            runtime = Chameleon(spec.config)
            runtime.profiler.timer = runtime.device.timer  # layer times from CUDA events (the runtime's default: host clock)
            device = runtime.device
        self.model = model
        self.device = device
        self.runtime = runtime
        self.cuda = args.torch_device.type == "cuda"
        self.optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        self.losses: list[torch.Tensor] = []
        self.records: list[dict] = []
        if runtime is not None:
            runtime.attach(model)
        elif device.emulated:
            device.track_module(model)
        for p in model.parameters():  # allocated now and kept: the memory every iteration starts from
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if device.emulated:
                device.track(p.grad)

    def _closure(self, batch: torch.Tensor) -> tuple[Callable[[], torch.Tensor], CountingSaveOnCpu | None]:
        saving = CountingSaveOnCpu(self.device) if self.spec.saving == "save_on_cpu" else None

        def closure() -> torch.Tensor:
            data = batch.clone()  # on the emulated device: arrives inside the iteration (metered)
            with saving if saving is not None else contextlib.nullcontext():
                if self.spec.saving == "checkpoint":
                    logits = forward_checkpointed(self.model, data[:, :-1])
                else:
                    logits = self.model(data[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
            loss.backward()
            return loss.detach()

        return closure, saving

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self, batch: torch.Tensor) -> dict:
        closure, saving = self._closure(batch)
        device = self.device
        self._synchronize()
        _reset_process_peaks(self.cuda)
        device.reset_peak()
        start_live_bytes = device.live_bytes()
        stall_start_s = device.stall_s()
        start_s = time.perf_counter()
        if self.runtime is not None:
            loss = self.runtime.run_iteration(closure, optimizer=self.optimizer)
        else:
            with device.active():
                loss = closure()
                self.optimizer.step()
        self._synchronize()
        iteration_s = time.perf_counter() - start_s
        record = {"iteration_s": iteration_s, "start_live_bytes": start_live_bytes, "peak_bytes": device.peak_bytes(),
                  "stall_s": device.stall_s() - stall_start_s, "swap_out_bytes": 0, "stage": "", "policy": "",
                  "passive_swaps": 0, "oom_retries": 0}
        if self.runtime is not None:
            report = self.runtime.last_report.to_dict()
            record.update({key: report[key] for key in REPORT_KEYS})
        elif saving is not None:
            record["swap_out_bytes"] = saving.swap_out_bytes
        record["peak_above_start_bytes"] = record["peak_bytes"] - start_live_bytes
        self.optimizer.zero_grad(set_to_none=False)  # gradients stay in place, like a framework grad buffer
        self.losses.append(loss.detach().clone())
        self.records.append(record)
        return record


def probe(variant: Variant, batch: torch.Tensor) -> dict:
    """Forward and backward of the no-swap model without an optimizer step (parameters unchanged, gradients
    zeroed again): the bytes in use when an iteration starts, the peak above them, and the saved
    activations. Run twice; the second is kept (the first also allocates library workspaces)."""
    model, device = variant.model, variant.device
    result = {}
    for _ in range(2):
        saved = SavedActivations(model.parameters(), device.is_device_tensor)

        closure, _ = variant._closure(batch)
        variant._synchronize()
        _reset_process_peaks(variant.cuda)
        device.reset_peak()
        start_live_bytes = device.live_bytes()
        with device.active(), saved.hooks():
            closure()
        variant._synchronize()
        result = {"start_live_bytes": start_live_bytes, "peak_bytes": device.peak_bytes(),
                  "saved_activation_bytes": sum(saved.bytes_by_storage.values()),
                  "saved_storages": len(saved.bytes_by_storage)}
        for p in model.parameters():
            p.grad.zero_()
    result["activation_peak_bytes"] = result["peak_bytes"] - result["start_live_bytes"]
    return result


# ---- CUDA helpers -------------------------------------------------------------------------------
def _reset_process_peaks(cuda: bool) -> None:
    """This benchmark owns its process, so it may reset the peak statistics that ``CudaDevice`` leaves to
    Megatron and DeepSpeed: every step's and probe's peak is then a new high, read exactly (below an
    earlier peak ``CudaDevice.peak_bytes`` is only a lower bound, and the variants repeat one shape)."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()


class Determinism:
    """``--determinism``: strict (``torch.use_deterministic_algorithms(True)``), warn (warn_only: flash
    attention's backward stays non-deterministic) or off. Strict falls back to warn when an op of the probe
    iteration has no deterministic implementation (recorded). Restores the process's settings on exit."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.fallback_reason = ""
        self._before = (torch.are_deterministic_algorithms_enabled(),
                        torch.is_deterministic_algorithms_warn_only_enabled(),
                        torch.utils.deterministic.fill_uninitialized_memory)

    def __enter__(self) -> "Determinism":
        if self.mode != "off":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for determinism
            torch.use_deterministic_algorithms(True, warn_only=self.mode == "warn")
            torch.utils.deterministic.fill_uninitialized_memory = False  # a debugging aid that costs time
        return self

    def fall_back(self, error: Exception) -> None:
        self.mode = "warn"
        self.fallback_reason = str(error).splitlines()[0]
        torch.use_deterministic_algorithms(True, warn_only=True)

    def __exit__(self, *exc) -> None:
        enabled, warn_only, fill = self._before
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


# ---- run ----------------------------------------------------------------------------------------
def build(args: argparse.Namespace, shape: Shape) -> tuple[dict[str, Variant], dict]:
    """The five variants on one device (CUDA) or on one emulated device each, after a probe of no_swap."""
    reference = make_model(shape, args)
    if args.dry_run:
        link = {"d2h_bytes_per_s": DRY_LINK_BYTES_PER_S, "h2d_bytes_per_s": DRY_LINK_BYTES_PER_S,
                "source": "emulated link, --dry-run (fast, so that the dry run takes seconds)"}
        meters = {spec.name: EmulatedDevice(UNBOUNDED_CAPACITY_BYTES) for spec in SPECS if spec.config is None}
    else:
        from chameleon_dist.device import CudaDevice

        shared = CudaDevice()  # live and peak bytes of the whole GPU: every variant's are the same
        link = {**measure_copy_rates(shared, args.link_probe_mib * MIB),  # (launch/bench/gpu_probes.py: one measurement)
                "source": f"pinned copies of {args.link_probe_mib} MiB"}
        meters = {spec.name: shared for spec in SPECS if spec.config is None}
    models = {spec.name: reference if spec.reference else copy.deepcopy(reference) for spec in SPECS}
    variants = {spec.name: Variant(spec, models[spec.name], args, meters[spec.name]) for spec in SPECS if spec.config is None}
    if args.torch_device.type == "cuda":  # Chameleon's copies' gradients count before its capacity is set
        for name in CHAMELEON:
            for p in models[name].parameters():
                p.grad = torch.zeros_like(p)
    determinism = args.determinism_state
    try:
        measured = probe(variants[REFERENCE], batch_for(shape, args, -1))
    except RuntimeError as exc:
        if determinism.mode != "strict" or "determinis" not in str(exc):
            raise
        determinism.fall_back(exc)
        measured = probe(variants[REFERENCE], batch_for(shape, args, -1))
    start_live_bytes = measured["start_live_bytes"]
    capacity_bytes = start_live_bytes + int(args.budget_fraction * measured["activation_peak_bytes"])
    measured_config = {
        "min_swap_bytes": int(args.min_swap_kib * 1024), "memory_budget": 1.0,
        "device": {"kind": "emulated" if args.dry_run else "cuda", "capacity": capacity_bytes,
                   "d2h_bytes_per_s": int(link["d2h_bytes_per_s"]), "h2d_bytes_per_s": int(link["h2d_bytes_per_s"])},
        "profiler": {"policy_trials": args.policy_trials},
        "executor": {"prefetch_depth": args.prefetch_depth},
    }
    for spec in SPECS:
        if spec.config is not None:  # the variant's own settings over the measured ones, section by section
            config = {**measured_config, **{key: {**measured_config.get(key, {}), **value}
                                            for key, value in spec.config.items()}}
            variants[spec.name] = Variant(dataclasses.replace(spec, config=config), models[spec.name], args)
    variants = {name: variants[name] for name in VARIANTS}
    setup = {"probe": measured, "capacity_bytes": capacity_bytes, "capacity_start_live_bytes": start_live_bytes,
             "capacity_rule": f"start live bytes + {args.budget_fraction} x no_swap's activation peak", "link": link,
             "parameters": sum(p.numel() for p in reference.parameters())}
    return variants, setup


def play_rounds(variants: dict[str, Variant], shape: Shape, args: argparse.Namespace, deadline_s: float) -> dict:
    """Untimed rounds until both Chameleon runtimes had their WarmUp and GenPolicy iterations (more while one
    is not in Stable, up to twice as many), then ``--rounds`` timed ones; a round starts only when the
    slowest round so far would still end before the deadline."""
    runtimes = [variants[name].runtime for name in CHAMELEON]
    planned_warm = max(args.warmup_rounds, *(r.config.profiler.warmup_iterations + args.policy_trials for r in runtimes))
    round_s: list[float] = []
    orders = []
    stop_reason = ""

    def play(r: int) -> bool:
        nonlocal stop_reason
        if round_s and time.perf_counter() + 1.2 * max(round_s) > deadline_s:
            stop_reason = f"--max-minutes {args.max_minutes}: round {r} would end past the time box"
            return False
        start_s = time.perf_counter()
        batch = batch_for(shape, args, r)
        order = rotated(VARIANTS, r)
        orders.append(order)
        for name in order:
            variants[name].step(batch)
        round_s.append(time.perf_counter() - start_s)
        if args.verbose:
            print(f"round {r:3d} ({round_s[-1]:.2f} s) " + " ".join(
                f"{n} {variants[n].records[-1]['iteration_s'] * 1e3:.0f} ms" for n in VARIANTS)
                + " | " + " ".join(f"{n} {variants[n].records[-1]['stage']}" for n in CHAMELEON), flush=True)
        return True

    warm = 0
    while warm < planned_warm or (any(r.stage != "stable" for r in runtimes) and warm < 2 * planned_warm):
        if not play(warm):
            break
        warm += 1
    ready = {name: str(variants[name].runtime.stage) for name in CHAMELEON}
    timed = 0
    if not stop_reason:
        while timed < args.rounds and play(warm + timed):
            timed += 1
    return {"warmup": warm, "warmup_planned": planned_warm, "timed": timed, "timed_planned": args.rounds,
            "stopped_early": bool(stop_reason), "stop_reason": stop_reason, "stages_when_timing_began": ready,
            "round_s": round_s, "orders": orders[:len(VARIANTS)]}


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def summarize(variants: dict[str, Variant], timed: range, capacity_bytes: int) -> dict:
    reference = variants[REFERENCE]
    ref_times = [reference.records[i]["iteration_s"] for i in timed]
    ref_params = list(reference.model.parameters())
    out = {}
    for name, v in variants.items():
        rows = [v.records[i] for i in timed]
        times = [r["iteration_s"] for r in rows]
        ratios = [t / u for t, u in zip(times, ref_times)]
        losses_equal = sum(torch.equal(a, b) for a, b in zip(v.losses, reference.losses))
        params = list(v.model.parameters())
        params_equal = sum(torch.equal(a, b) for a, b in zip(params, ref_params))
        differences = [_max_difference(a, b) for a, b in zip(params, ref_params) if not torch.equal(a, b)]
        loss_differences = [_max_difference(a, b) for a, b in zip(v.losses, reference.losses) if not torch.equal(a, b)]
        peaks = [r["peak_bytes"] for r in v.records]
        out[name] = {
            "median_iteration_s": statistics.median(times) if times else None,
            "ratio": statistics.median(ratios) if ratios else None,  # paired per round, median over rounds
            "ratio_min_max": [min(ratios), max(ratios)] if ratios else None,
            "median_stall_s": statistics.median(r["stall_s"] for r in rows) if rows else None,
            "swap_out_bytes": statistics.median(r["swap_out_bytes"] for r in rows) if rows else None,
            "peak_bytes": max(r["peak_bytes"] for r in rows) if rows else None,
            "peak_above_start_bytes": max(r["peak_above_start_bytes"] for r in rows) if rows else None,
            "capacity_bytes": capacity_bytes if v.runtime is not None else None,
            "iterations_over_capacity": sum(p > capacity_bytes for p in peaks) if v.runtime is not None else None,
            "stages": {s: [r["stage"] for r in rows].count(s) for s in sorted({r["stage"] for r in rows}) if s},
            "policies": sorted({r["policy"] for r in rows if r["policy"]}),
            "passive_swaps": sum(r["passive_swaps"] for r in v.records),
            "oom_retries": sum(r["oom_retries"] for r in v.records),
            "losses_equal": losses_equal,
            "losses_compared": len(reference.losses),
            "parameters_equal": params_equal,
            "parameters_compared": len(ref_params),
            "bit_identical": losses_equal == len(reference.losses) == len(v.losses) and params_equal == len(ref_params),
            "max_parameter_difference": max(differences, default=0.0),
            "max_loss_difference": max(loss_differences, default=0.0),
            "iteration_s": times,
        }
        if v.runtime is not None:
            chosen = v.runtime.controller.chosen
            out[name]["policy"] = None if chosen is None else {
                "name": chosen.name, "feasible": chosen.feasible, "predicted_peak_bytes": chosen.predicted_peak_bytes,
                "predicted_iteration_s": chosen.predicted_iteration_s, "predicted_stall_s": chosen.predicted_stall_s,
                "swap_bytes": chosen.saved_bytes(Decision.SWAP), "recompute_bytes": chosen.saved_bytes(Decision.RECOMPUTE)}
            trace = v.runtime.last_trace
            out[name]["trace_layer_times_s"] = None if trace is None else {
                "forward": trace.layer_times_s, "backward": trace.layer_backward_times_s, "iteration": trace.iteration}
            out[name]["rounds"] = [{k: r[k] for k in ("stage", "policy", "iteration_s", "stall_s", "peak_bytes",
                                                      "swap_out_bytes", "passive_swaps", "oom_retries")}
                                   for r in v.records]
    return out


def run(args: argparse.Namespace, deadline_s: float) -> dict:
    total_bytes = None
    gpu = None
    if not args.dry_run:
        properties = torch.cuda.get_device_properties(args.torch_device)
        total_bytes = int(properties.total_memory)
        gpu = {"name": properties.name, "total_memory_bytes": total_bytes, "cuda": torch.version.cuda,
               "free_bytes_at_start": torch.cuda.mem_get_info(args.torch_device)[0]}
    shape, shape_reason = choose_shape(args, total_bytes)
    if gpu is not None and shape.estimate_bytes(len(VARIANTS)) > 0.9 * gpu["free_bytes_at_start"]:
        raise SystemExit(f"the shape needs about {shape.estimate_bytes(len(VARIANTS)) / GIB:.1f} GiB, more than this "
                         f"GPU has free: lower --layers, --seq or --batch")
    variants, setup = build(args, shape)
    rounds = play_rounds(variants, shape, args, deadline_s)
    timed = range(rounds["warmup"], rounds["warmup"] + rounds["timed"])
    summary = summarize(variants, timed, setup["capacity_bytes"])
    checks = {f"{spec.name}_bit_identical": summary[spec.name]["bit_identical"] for spec in SPECS if not spec.reference}
    checks.update({f"{name}_peak_below_no_swap": summary[name]["peak_bytes"] is not None
                   and summary[name]["peak_bytes"] < summary[REFERENCE]["peak_bytes"] for name in CHAMELEON})
    return {"emulated": args.dry_run, "gpu": gpu,
            "shape": {**dataclasses.asdict(shape), "dtype": args.dtype, "parameters": setup["parameters"],
                      "reason": shape_reason, "estimate_bytes": shape.estimate_bytes(len(VARIANTS))},
            "determinism": {"mode": args.determinism_state.mode, "requested": args.determinism,
                            "fallback_reason": args.determinism_state.fallback_reason},
            "setup": setup, "rounds": rounds, "variants": summary, "checks": checks}


# ---- report -------------------------------------------------------------------------------------
def print_report(r: dict) -> None:
    s, setup, rounds = r["shape"], r["setup"], r["rounds"]
    print(f"command: {r['command']}")
    where = "CPU, emulated devices (--dry-run)" if r["emulated"] else f"{r['gpu']['name']} ({r['gpu']['total_memory_bytes'] / GIB:.0f} GiB, CUDA {r['gpu']['cuda']})"
    print(f"date: {r['date']}; {where}; torch {r['machine']['torch']}")
    print(f"model: GPT {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, seq {s['seq']}, batch {s['batch']}, "
          f"vocab {s['vocab']}, {s['dtype']}, SGD; {s['parameters'] / 1e6:.1f} M parameters ({s['reason']})")
    p = setup["probe"]
    print(f"no_swap probe: {p['start_live_bytes'] / MIB:.1f} MiB in use at an iteration's start, activation peak "
          f"{p['activation_peak_bytes'] / MIB:.1f} MiB above it, saved activations {p['saved_activation_bytes'] / MIB:.1f} MiB "
          f"in {p['saved_storages']} storages")
    print(f"chameleon capacity {setup['capacity_bytes'] / MIB:.1f} MiB ({setup['capacity_rule']}); link "
          f"D2H {setup['link']['d2h_bytes_per_s'] / 1e9:.2f} GB/s, H2D {setup['link']['h2d_bytes_per_s'] / 1e9:.2f} GB/s "
          f"({setup['link']['source']})")
    d = r["determinism"]
    print(f"determinism: {d['mode']}" + (f" (strict failed: {d['fallback_reason']})" if d["fallback_reason"] else ""))
    print(f"rounds: {rounds['warmup']} untimed (planned {rounds['warmup_planned']}) + {rounds['timed']} timed of "
          f"{rounds['timed_planned']}" + (f"; STOPPED EARLY: {rounds['stop_reason']}" if rounds["stopped_early"] else "")
          + f"; stages when timing began: {rounds['stages_when_timing_began']}")
    print()
    print(f"{'variant':<21}{'median ms':>10}{'ratio':>7}{'stall ms':>9}{'out MiB':>9}{'peak MiB':>10}{'above start':>12}"
          f"{'bit-identical':>15}")
    for name, v in r["variants"].items():
        def number(value, scale, width, digits):
            return f"{value * scale:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"
        same = f"{'yes' if v['bit_identical'] else 'NO'} {v['losses_equal']}/{v['losses_compared']}"
        print(f"{name:<21}{number(v['median_iteration_s'], 1e3, 10, 1)}{number(v['ratio'], 1, 7, 3)}"
              f"{number(v['median_stall_s'], 1e3, 9, 1)}{number(v['swap_out_bytes'], 1 / MIB, 9, 1)}"
              f"{number(v['peak_bytes'], 1 / MIB, 10, 1)}{number(v['peak_above_start_bytes'], 1 / MIB, 12, 1)}{same:>15}")
    for name in CHAMELEON:
        v = r["variants"][name]
        pol = v.get("policy")
        text = "no policy chosen" if pol is None else (
            f"policy {pol['name']} (feasible {pol['feasible']}): swap {pol['swap_bytes'] / MIB:.1f} MiB, recompute "
            f"{pol['recompute_bytes'] / MIB:.1f} MiB, predicted peak {pol['predicted_peak_bytes'] / MIB:.1f} MiB")
        print(f"  {name}: {text}; timed stages {v['stages']}, iterations over capacity {v['iterations_over_capacity']}, "
              f"passive swaps {v['passive_swaps']}, OOM retries {v['oom_retries']}")
    for name, v in r["variants"].items():
        if not v["bit_identical"] and name != REFERENCE:
            print(f"  {name} differs: largest parameter difference {v['max_parameter_difference']:.3g}, "
                  f"loss {v['max_loss_difference']:.3g}")
    print(f"wall time {r['wall_s']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU with emulated devices, tiny shape (tests)")
    parser.add_argument("--layers", type=int, default=None, help="default: from the GPU's memory")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="default: from the GPU's memory (dry 1)")
    parser.add_argument("--vocab", type=int, default=None, help="default 32000 (dry 128)")
    parser.add_argument("--max-layers", type=int, default=8, help="the automatic shape's most layers")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on a GPU, fp32 dry")
    parser.add_argument("--budget-fraction", type=float, default=0.7,
                        help="Chameleon's share of the no-swap activation peak (device.capacity)")
    parser.add_argument("--min-swap-kib", type=float, default=None, help="min_swap_bytes (default 1024; dry 4)")
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument("--policy-trials", type=int, default=None, help="default 5 (dry 2)")
    parser.add_argument("--warmup-rounds", type=int, default=2, help="untimed rounds at least")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; dry 3)")
    parser.add_argument("--max-minutes", type=float, default=7.0, help="time box of the whole run")
    parser.add_argument("--determinism", choices=("strict", "warn", "off"), default="strict")
    parser.add_argument("--attention", choices=("flash", "auto"), default="flash",
                        help="attention kernel on the GPU: flash (bf16; deterministic backward under strict "
                             "determinism) or PyTorch's choice")
    parser.add_argument("--link-probe-mib", type=int, default=512, help="bytes of the link measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: dry 1)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="one line per round")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    dry = args.dry_run
    args.dtype = args.dtype or ("fp32" if dry else "bf16")
    args.batch = args.batch or (1 if dry else None)
    args.vocab = args.vocab or (DRY_SHAPE["vocab"] if dry else 32000)
    args.min_swap_kib = args.min_swap_kib if args.min_swap_kib is not None else (4 if dry else 1024)
    args.policy_trials = args.policy_trials or (2 if dry else 5)
    args.rounds = args.rounds or (3 if dry else 15)
    args.threads = args.threads or (1 if dry else torch.get_num_threads())
    if not 0 < args.budget_fraction < 1 or args.rounds < 1 or args.max_minutes <= 0:
        parser.error("need 0 < --budget-fraction < 1, --rounds >= 1 and --max-minutes > 0")
    if args.hidden and args.heads and args.hidden % args.heads:
        parser.error("--hidden must be divisible by --heads")
    if not dry and args.attention == "flash" and args.dtype == "fp32":
        parser.error("flash attention needs 16-bit inputs: use --dtype bf16 or --attention auto")
    if not dry and not torch.cuda.is_available():
        parser.error(f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}): run with --dry-run "
                     "to exercise the same code on the CPU")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    deadline_s = time.perf_counter() + 60 * args.max_minutes
    args.torch_device = torch.device("cpu" if args.dry_run else "cuda", None if args.dry_run else torch.cuda.current_device())
    args.torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]

    def run_within_settings(args: argparse.Namespace) -> dict:
        attention = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if not args.dry_run and args.attention == "flash" \
            else contextlib.nullcontext()
        with Determinism(args.determinism) as determinism, attention:
            args.determinism_state = determinism
            return run(args, deadline_s)

    config = config_of(args, as_text=(Path, torch.device, torch.dtype))
    return run_benchmark("launch.bench.bench_gpu", argv, args, torch, run_within_settings, print_report, emulated=False,
                         config=config)


if __name__ == "__main__":
    main()
