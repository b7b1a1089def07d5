"""Dynamic sequences (issues 12 and 27): Chameleon at half the unswapped peak against a plain loop, on models whose
operator sequence changes from iteration to iteration, on a simulated device: ``--preset`` at its real rates,
on the device clock, with ``--host-op-s`` host seconds per op (default 2e-5: runs repeat exactly;
``measured``: the host's own time). See launch/bench/device_clock.py for what each figure means.

Each case trains two copies of one model (identical initialisation, seeded with ``--seed``; the same batches,
plain SGD) on their own ``EmulatedDevice``. The default cases, on the plain-PyTorch GPT of launch/models/toy_gpt.py
(``--layers``, ``--hidden``, ``--heads``):

- ``moe``: every odd layer's MLP is an eager top-2 mixture of ``--experts`` experts with a skewed router, and
  an expert that receives no token does not run (``skip_idle_experts``, like Hugging Face Mixtral's eager
  loop): which experts run, and so the operator sequence, changes from batch to batch (sequence length
  ``--seq``). The number of idle experts per iteration is reported.
- ``lengths``: a dense GPT whose sequence length is drawn from ``--lengths`` every ``--length-every``
  iterations (seeded RNG): every saved activation changes size when the length changes.

The cases of issue 27 (tests/test_dynamic_moe.py's models), run when named in ``--cases`` (``--cases all``: every
case):

- ``mixtral_eager``, ``mixtral_grouped``: a tiny random Hugging Face ``transformers.MixtralForCausalLM`` (hidden 64,
  intermediate 32, 4 layers, 4 heads, 4 kv heads, 32 experts, top-2, eager attention, no cache; ``--vocab``,
  ``--seq``, ``--batch``) with ``experts_implementation`` "eager" (an expert that gets no token does not run: the
  ops change with the routing) resp. "grouped_mm" (one op for all experts: the sizes inside it change, the ops do
  not), wrapped so that ``forward(tokens)`` returns the logits (``MixtralLM``; Chameleon attaches to the wrapper).
  Under ``--small`` a smaller Mixtral (``MIXTRAL_SMALL``: 2 layers, hidden 16, 8 experts). Idle experts are
  counted from the routers' ``top_k_index`` by a forward hook, in the untimed measurement pass only. Both need
  ``transformers`` (``pip install -e .[hf]``): naming one without it is a usage error that says so.
- ``top1_lengths``: the GPT with an eager top-1 MoE of ``--experts`` experts in every odd layer, idle experts
  skipped, whose sequence length cycles through ``--lengths`` every iteration (the test's case: ``--lengths
  32,48,64``): the ops and the saved bytes change together every iteration.

The default ``--cases`` stays ``moe,lengths`` whether or not ``transformers`` is installed: the same command runs
the same cases on every machine (and stays a few minutes); the three issue-27 cases take about 1.5 minutes
at 24 iterations on 2 cores.

``--d2h`` / ``--h2d`` (bytes per second) replace the preset's link rate in that direction (tests/test_dynamic_moe.py
runs at 1e9); the physical bound and the device line then use it.

Per case:

1. plain: ``enabled: false`` (metering and the cheap signature only, nothing swapped), capacity unbounded:
   the reference time. A first, untimed pass of the same loop over all the case's batches measures the
   unswapped peak (the maximum over the iterations), the saved activation bytes and the forward pass's
   device time (compute-stream busy seconds) of every iteration.
2. chameleon: capacity = ``--capacity-fraction`` (0.5) x that peak, ``memory_budget`` left at its default,
   ``min_swap_bytes`` = ``--min-swap-kib``.

Both run the same iterations interleaved (plain first in even iterations, chameleon first in odd ones).
Reported: the median over chameleon's Stable iterations of its iteration device time over the plain loop's
in the same iteration (``ratio``); stall and host-bound share (device idle waiting for the host) in Stable;
the share of the saved bytes moved to the host in Stable, next to the physical bound (the median over the
iterations of min(1, link rate x forward device time / saved bytes)); the share of the iterations after the
first WarmUp + GenPolicy stretch that ran in Stable (``last_report.stage``); passive swaps
(``last_report.passive_swaps``, all iterations); the peak over the capacity; the stage transitions back to
WarmUp (``last_report.stage_transition``, with their reasons); and whether every loss and the final
parameters are ``torch.equal`` to the plain run's. Should chameleon raise ``OutOfMemoryError`` (every
retry failed), the case stops at that iteration and says so; the losses before it are still compared.
Gradients stay allocated between steps (``zero_grad(set_to_none=False)``), one torch thread by default.

``--instant-link`` makes the copies take no time (the preset's compute, an infinitely fast link): the ratio
is then the runtime's own cost (signature, matching, profiling, trials, the ops its hooks add) on a sequence
that keeps changing.

    .venv/bin/python -m launch.bench.bench_dynamic --json runs/bench_dynamic.json   # a few minutes on 2 cores
    .venv/bin/python -m launch.bench.bench_dynamic --host-op-s measured             # the host's measured time
    .venv/bin/python -m launch.bench.bench_dynamic --instant-link --min-swap-kib 1  # the runtime's own cost
    .venv/bin/python -m launch.bench.bench_dynamic --small                          # seconds (smoke test)

Issue 27's cases as tests/test_dynamic_moe.py runs them (there at 1 GB/s each way: add ``--d2h 1e9 --h2d 1e9``):

    .venv/bin/python -m launch.bench.bench_dynamic --cases mixtral_eager,mixtral_grouped,top1_lengths --lengths 32,48,64 --iterations 24
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from launch.bench.device_clock import DeviceSpan, add_device_arguments, device_figures, host_bound_label, make_device
from launch.bench.dynamic_figures import case_result
from launch.bench.harness import VariantSpec, report_fields, run_benchmark
from launch.bench.saved_activations import SavedActivations
from launch.bench.swap_variants import MIB, Variant, host_batch
from launch.models.toy_gpt import GPT, MoEFeedForward

import torch
from torch import nn

from chameleon_dist.device import UNBOUNDED_CAPACITY_BYTES, EmulatedDevice

logger = logging.getLogger(__name__)

DEFAULT_CASES = ("moe", "lengths")
HF_CASES = ("mixtral_eager", "mixtral_grouped")  # need transformers (the ``hf`` extra)
CASES = (*DEFAULT_CASES, *HF_CASES, "top1_lengths")
HF_INSTALL = "pip install -e .[hf]"
SWAP_ALL = "no policy (every eligible tensor swapped)"
# the Mixtral cases' shape (tests/test_dynamic_moe.py's); --small: MIXTRAL_SMALL
MIXTRAL = {"hidden": 64, "intermediate": 32, "layers": 4, "heads": 4, "kv_heads": 4, "experts": 32, "top_k": 2}
MIXTRAL_SMALL = {"hidden": 16, "intermediate": 8, "layers": 2, "heads": 2, "kv_heads": 2, "experts": 8, "top_k": 2}


# ---- cases --------------------------------------------------------------------------------------
def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def import_transformers():
    """``transformers``, imported on first use (only the Mixtral cases need it)."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"the cases {', '.join(HF_CASES)} need Hugging Face transformers: {HF_INSTALL} "
                          f"({exc})") from exc
    return transformers


def mixtral_config(transformers, shape: dict, vocab: int, max_positions: int, experts_implementation: str):
    """The ``transformers.MixtralConfig`` of a Mixtral case (``shape``: ``MIXTRAL`` or ``MIXTRAL_SMALL``): eager
    attention, no cache, ``experts_implementation`` "eager" or "grouped_mm" (tests/test_dynamic_moe.py builds
    the same)."""
    return transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max_positions, num_local_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"], attn_implementation="eager", experts_implementation=experts_implementation,
        use_cache=False)


class MixtralLM(nn.Module):
    """A ``transformers.MixtralForCausalLM`` whose ``forward(tokens)`` returns the logits (no cache), so that the
    benchmark's closure (cross entropy on the logits) and Chameleon (attached to this wrapper) treat it like the
    GPT. ``count_routing()`` adds a forward hook to every router that notes which experts got a token (read on
    the host from ``top_k_index``: no op on the device); ``idle_experts()`` then counts, over all MoE layers, the
    experts that got none in the last forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        self.moe_layers = len(self.routers)
        self.experts = model.config.num_local_experts
        self._hit: dict[int, set[int]] = {}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self._hit = {}
        return self.model(input_ids=tokens, use_cache=False).logits

    def count_routing(self) -> None:
        for i, router in enumerate(self.routers):
            def hook(module, inputs, output, i=i):
                self._hit[i] = set(output[2].flatten().tolist())  # (logits, scores, top_k_index)

            router.register_forward_hook(hook)

    def idle_experts(self) -> int:
        return sum(self.experts - len(self._hit.get(i, ())) for i in range(self.moe_layers))


@dataclasses.dataclass(frozen=True)
class Case:
    """One model and its batches: ``seq_lengths[i]`` is iteration ``i``'s sequence length. ``model_kwargs``: the
    GPT's keyword options (launch/models/toy_gpt.py), or with ``mixtral`` (the experts implementation, "eager" or
    "grouped_mm") the Mixtral's shape (``MIXTRAL``)."""

    name: str
    model_kwargs: dict
    seq_lengths: tuple[int, ...]
    description: str
    mixtral: str | None = None

    @property
    def experts(self) -> int:
        return self.model_kwargs.get("experts", 0)

    def make_model(self, args: argparse.Namespace) -> nn.Module:
        torch.manual_seed(args.seed)
        if self.mixtral is None:
            return GPT(args.vocab, args.hidden, args.heads, args.layers, **self.model_kwargs)
        transformers = import_transformers()
        config = mixtral_config(transformers, self.model_kwargs, args.vocab, max(256, *self.seq_lengths), self.mixtral)
        return MixtralLM(transformers.MixtralForCausalLM(config).train())

    def batch(self, args: argparse.Namespace, step: int) -> torch.Tensor:
        shape = SimpleNamespace(seed=args.seed, vocab=args.vocab, batch=args.batch, seq=self.seq_lengths[step])
        return host_batch(shape, step)


def make_case(name: str, args: argparse.Namespace) -> Case:
    gpt = f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads"
    if name == "moe":
        return Case(name, {"experts": args.experts, "top_k": 2, "skip_idle_experts": True},
                    (args.seq,) * args.iterations,
                    f"{gpt}; eager top-2 MoE, {args.experts} experts in every odd layer, idle experts skipped, "
                    f"seq {args.seq}")
    if name == "top1_lengths":
        cycle = tuple(args.lengths[i % len(args.lengths)] for i in range(args.iterations))
        return Case(name, {"experts": args.experts, "top_k": 1, "skip_idle_experts": True}, cycle,
                    f"{gpt}; eager top-1 MoE, {args.experts} experts in every odd layer, idle experts skipped, seq "
                    f"cycling {'/'.join(map(str, args.lengths))} every iteration")
    if name in HF_CASES:
        shape = MIXTRAL_SMALL if args.small else MIXTRAL
        implementation = "eager" if name == "mixtral_eager" else "grouped_mm"
        return Case(name, dict(shape), (args.seq,) * args.iterations,
                    f"transformers MixtralForCausalLM (random init) {shape['layers']} layers, hidden "
                    f"{shape['hidden']}, intermediate {shape['intermediate']}, {shape['heads']} heads "
                    f"({shape['kv_heads']} kv), {shape['experts']} experts top-{shape['top_k']} in every layer, "
                    f"eager attention, experts_implementation {implementation!r}"
                    + (" (an expert with no token does not run)" if implementation == "eager" else
                       " (one op for all experts)") + f", no cache, seq {args.seq}",
                    mixtral=implementation)
    rng = random.Random(args.seed)
    lengths: list[int] = []
    while len(lengths) < args.iterations:
        lengths += [rng.choice(args.lengths)] * args.length_every
    return Case(name, {}, tuple(lengths[:args.iterations]),
                f"{gpt}; dense, seq drawn from {{{', '.join(map(str, args.lengths))}}} every {args.length_every} "
                "iterations")


class CaseVariant(Variant):
    """launch/bench/swap_variants.py's ``Variant`` (its ``step`` and records) on a case's model, always with a runtime
    (``spec.config``)."""

    def __init__(self, spec: VariantSpec, case: Case, args: argparse.Namespace, device: EmulatedDevice) -> None:
        if spec.config is None:
            raise ValueError(f"variant {spec.name!r}: a case's variant runs Chameleon, give it a config")
        super().__init__(spec, args, device, model=case.make_model(args))
        # time_forward: the forward pass's device time (two marks, no cost); note_saved: the saved activation bytes
        # (a saved-tensor hook: autograd then hands it a detach of every saved output, one more op each, so only the
        # untimed measurement pass notes them)
        self.time_forward = self.note_saved = False
        self._forward: dict = {}

    def _closure(self, batch: torch.Tensor):
        if not (self.time_forward or self.note_saved):
            return super()._closure(batch)
        saved = SavedActivations(self.model.parameters(), self.device.is_device_tensor)

        def closure() -> torch.Tensor:
            span = DeviceSpan(self.device).start(stall=False)  # inside the iteration: resolve nothing
            data = batch.clone()
            with saved.hooks() if self.note_saved else contextlib.nullcontext():
                logits = self.model(data[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
            self._forward = {**span.stop(), "saved_bytes": sum(saved.bytes_by_storage.values())}
            loss.backward()
            return loss.detach()

        return closure

    def step(self, batch: torch.Tensor) -> dict:
        record = super().step(batch)
        r = self.chameleon.last_report
        record.update(report_fields(r, "sequence_changed", "sequence_differs", "num_ops", "matched_fuzzy"))
        if self.time_forward:
            record.update(forward_busy_s=self._forward["compute_busy_s"], forward_elapsed_s=self._forward["elapsed_s"])
        if self.note_saved:
            record.update(saved_bytes=self._forward["saved_bytes"])
        return record

    def idle_experts(self) -> int:
        """Experts that got no token in the last forward, over all MoE layers (a Mixtral: see ``MixtralLM``)."""
        if isinstance(self.model, MixtralLM):
            return self.model.idle_experts()
        return sum(c == 0 for m in self.model.modules() if isinstance(m, MoEFeedForward) for c in m.counts)


def moe_layers(model: nn.Module) -> int:
    if isinstance(model, MixtralLM):
        return model.moe_layers
    return sum(isinstance(m, MoEFeedForward) for m in model.modules())


# ---- run ----------------------------------------------------------------------------------------
def _measure(case: Case, args: argparse.Namespace, device) -> tuple[CaseVariant, list[int]]:
    """The untimed plain measurement pass on an unbounded device (peaks, saved bytes, idle experts per
    iteration); its variant and the idle experts."""
    measure = CaseVariant(VariantSpec("measure", {"enabled": False}), case, args, device(UNBOUNDED_CAPACITY_BYTES))
    measure.note_saved = True
    if isinstance(measure.model, MixtralLM):
        measure.model.count_routing()  # (the measurement pass only: the timed variants run without the hooks)
    idle = []
    for i in range(args.iterations):
        measure.step(case.batch(args, i))
        idle.append(measure.idle_experts())
    return measure, idle


def _interleave(case: Case, args: argparse.Namespace, plain: CaseVariant, cham: CaseVariant,
                idle: list[int]) -> dict | None:
    """The plain loop and chameleon, interleaved (alternating order); None, or where chameleon failed."""
    for i in range(args.iterations):
        batch = case.batch(args, i)
        try:
            for variant in (plain, cham) if i % 2 == 0 else (cham, plain):
                variant.step(batch)
        except torch.OutOfMemoryError as exc:  # the runtime gave up: report it, keep what ran before
            failure = {"iteration": i, "stage": getattr(cham.chameleon.last_report, "stage", ""),
                       "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
            logger.warning("%s: chameleon failed in iteration %d: %s", case.name, i, failure["error"])
            return failure
        c = cham.records[-1]
        (logger.info if args.verbose else logger.debug)(
            "%s %3d seq %d idle %2d | plain %.3f s | chameleon %.3f s %s%s out %.2f MiB peak %.2f MiB%s%s",
            case.name, i, case.seq_lengths[i], idle[i], plain.records[-1]["iteration_s"], c["iteration_s"], c["stage"],
            "/" + c["policy"] if c["policy"] else "", c["swap_out_bytes"] / MIB, c["peak_bytes"] / MIB,
            f" passive {c['passive_swaps']}" if c["passive_swaps"] else "",
            f" -> {c['stage_transition']}" if c["stage_transition"] else "")
    return None


def run_case(case: Case, args: argparse.Namespace) -> dict:
    """The case's unswapped peak, saved bytes and forward device times (an untimed plain pass), then the plain
    loop and chameleon interleaved."""

    def device(capacity: int) -> EmulatedDevice:
        # --instant-link: copies take no time, what is left is the runtime's own cost
        return make_device(args, capacity, instant_link=args.instant_link)

    start_s = time.perf_counter()
    measure, idle = _measure(case, args, device)
    peaks = [r["peak_bytes"] for r in measure.records]
    capacity_bytes = int(args.capacity_fraction * max(peaks))
    measure_s = time.perf_counter() - start_s

    config: dict = {"min_swap_bytes": args.min_swap_bytes}
    if args.policy_trials is not None:
        config["profiler"] = {"policy_trials": args.policy_trials}
    plain = CaseVariant(VariantSpec("plain", {"enabled": False}, reference=True), case, args,
                        device(UNBOUNDED_CAPACITY_BYTES))
    plain.time_forward = True
    cham = CaseVariant(VariantSpec("chameleon", config), case, args, device(capacity_bytes))
    start_s = time.perf_counter()
    failure = _interleave(case, args, plain, cham, idle)
    rounds_s = time.perf_counter() - start_s
    return {**case_result(case, args, measure, plain, cham, idle, moe_layers(plain.model), capacity_bytes, failure),
            "wall_s": {"measurement": measure_s, "interleaved": rounds_s}}


def run(args: argparse.Namespace) -> dict:
    cases = {}
    gc.collect()
    gc.freeze()  # what is alive now (torch and the rest) is not scanned again by each step's gc.collect()
    try:
        for name in args.cases:
            logger.info("case %s ...", name)
            cases[name] = run_case(make_case(name, args), args)
    finally:
        gc.unfreeze()
    return {
        "instant_link": args.instant_link,
        "device": device_figures(args, instant_link=args.instant_link),
        "cases": cases,
        "checks": {"all_bit_identical": all(c["bit_identical"] is True for c in cases.values()),
                   "no_failure": not any(c["failed"] for c in cases.values()),
                   "peak_within_capacity": all(c["peak_over_capacity"] <= 1 for c in cases.values())},
    }


# ---- report -------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(r: dict) -> None:
    m, dev, c = r["machine"], r["device"], r["config"]
    print(f"command: {r['command']}")
    print(f"date: {r['date']}; {m['cpu']} ({m['cpus']} CPUs), {m['torch_threads']} torch threads, torch {m['torch']}; "
          f"load average {m['load_average_before']:.2f} before, {m['load_average_after']:.2f} after "
          f"(other jobs share this machine)")
    print(f"ALL FIGURES EMULATED: {dev['text']}; {dev['host']}"
          + ("; --instant-link: copies take no time (the ratio is the runtime's own cost)" if r.get("instant_link") else ""))
    print(f"models: per case below; batch {c['batch']}, vocab {c['vocab']}, fp32, SGD; "
          f"{c['iterations']} iterations per case, plain and chameleon interleaved; "
          f"chameleon capacity {c['capacity_fraction']:g} x the unswapped peak, memory_budget default, "
          f"min_swap_bytes {c['min_swap_kib']:g} KiB")
    print()
    width = max(9, *(len(name) + 1 for name in r["cases"]))
    print(f"{'case':<{width}}{'plain ms':>9}{'ratio':>7}{'stall %':>8}{'host-bd %':>10}{'plain hb %':>11}{'moved %':>8}"
          f"{'bound %':>8}{'stable':>8}{'passive':>8}{'peak/cap':>9}{'->warmup':>9}{'peak MiB':>9}{'cap MiB':>8}"
          f"{'bit-identical':>15}   (emulated)")
    for name, v in r["cases"].items():
        verdict = {True: "yes", False: "NO", None: "n/a"}[v["bit_identical"]]
        same = f"{verdict} {v['losses_equal']}/{v['losses_compared']}"
        plain_ms = None if v["plain_median_s"] is None else v["plain_median_s"] * 1e3
        print(f"{name:<{width}}{_fmt(plain_ms, '.3f'):>9}{_fmt(v['ratio'], '.3f'):>7}{_fmt(v['stall_share_stable'], '.1%'):>8}"
              f"{_fmt(v['host_bound_share_stable'], '.1%'):>10}{_fmt(v['plain_host_bound_share'], '.1%'):>11}"
              f"{_fmt(v['moved_share_stable'], '.1%'):>8}{_fmt(v['physical_bound'], '.1%'):>8}"
              f"{_fmt(v['stable_share'], '.0%'):>8}"
              f"{v['passive_swaps']:>8}{v['peak_over_capacity']:>9.2f}{v['transitions_to_warmup']:>9}"
              f"{v['peak_bytes'] / MIB:>9.2f}{v['capacity_bytes'] / MIB:>8.2f}{same:>15}")
    print("  device times (emulated); ratio = median over Stable iterations of chameleon / plain (same iteration); "
          "stall % = stall in Stable / plain time; host-bd % = chameleon's device idle waiting for the host "
          "(iteration - compute busy - stall) / iteration in Stable, plain hb % the plain loop's; moved % = swap-out "
          "bytes / saved activation bytes in Stable; bound % = physical bound (median over iterations of min(1, link "
          "rate x forward device time / saved bytes)); stable = share of the iterations after the first WarmUp + "
          "GenPolicy that ran in Stable; passive = passive swaps, all iterations")
    bound = [name for name, v in r["cases"].items() if host_bound_label(v["host_bound_share_stable"]) == "host-bound"]
    print("  host-bound (> 50% in Stable): " + (", ".join(bound) if bound else "none")
          + "; ops/it in Stable (plain): " + ", ".join(
              f"{name} {_fmt(v['device_ops_stable'], '.0f')} ({_fmt(v['plain_device_ops'], '.0f')})"
              for name, v in r["cases"].items()))
    for name, v in r["cases"].items():
        mod = v["model"]
        print(f"{name}: {v['description']}; {mod['parameters'] / 1e3:.0f} k parameters "
              f"({mod['parameter_bytes'] / MIB:.2f} MiB); unswapped peak {v['unswapped_peak_bytes'] / MIB:.2f} MiB, "
              f"capacity {v['capacity_bytes'] / MIB:.2f} MiB")
        if v["idle_experts"] is not None:
            print(f"  idle experts per iteration (of {mod['experts'] * mod['moe_layers']}): median "
                  f"{statistics.median(v['idle_experts']):g}, range {min(v['idle_experts'])}-{max(v['idle_experts'])}; "
                  f"iterations with an idle expert {v['iterations_with_idle_experts']}/{v['iterations']}")
        print(f"  stages {v['stages']}; first WarmUp + GenPolicy ended after iteration {v['first_plan_end'] - 1}; "
              f"Stable {v['stable_iterations']} iterations; ratio after it (all stages) "
              f"{_fmt(v['ratio_after_first_plan'], '.2f')}; stall in Stable {_fmt(v['stall_share_stable'], '.1%')} "
              f"of the "
              f"plain time; swapped out in Stable {_fmt(v['swap_out_mib_stable'], '.2f')} MiB/it")
        print(f"  passive swaps {v['passive_swaps']} ({v['passive_swaps_stable']} in Stable), OOM retries "
              f"{v['oom_retries']}; sequence changed {v['sequence_changed']}, differed {v['sequence_differs']} times; "
              f"policies tried {', '.join(v['policies']) or 'none'}; Stable ran "
              f"{', '.join(f'{p or SWAP_ALL} x{k}' for p, k in v['stable_policies'].items()) or 'nothing'}; "
              f"parameters equal "
              f"{'n/a' if v['failed'] else str(v['parameters_equal']) + '/' + str(v['parameters_compared'])}")
        for i, transition in v["transitions"]:
            print(f"  after iteration {i}: {transition}")
        if v["failed"]:
            f = v["failed"]
            print(f"  FAILED in iteration {f['iteration']} ({f['stage']}): {f['error']}; the case stopped there, the "
                  f"losses before it are compared, the final parameters are not")
    k = r["checks"]
    print(f"all bit-identical: {'yes' if k['all_bit_identical'] else 'NO'}; peak within capacity: "
          f"{'yes' if k['peak_within_capacity'] else 'NO'}; every iteration completed: "
          f"{'yes' if k['no_failure'] else 'NO'}")
    print(f"wall time {r['wall_s']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(parser, link=True)
    parser.add_argument("--instant-link", action="store_true",
                        help="copies take no time (the preset's compute): the runtime's own cost on changing sequences")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated, of {', '.join(CASES)}, or 'all' (default %(default)s; "
                             f"{', '.join(HF_CASES)} need transformers: {HF_INSTALL})")
    parser.add_argument("--iterations", type=int, default=40, help="iterations per case")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the moe and Mixtral cases")
    parser.add_argument("--experts", type=int, default=16, help="experts per MoE layer (moe and top1_lengths cases)")
    parser.add_argument("--lengths", default="64,96,128",
                        help="sequence lengths of the lengths case (drawn) and of top1_lengths (cycled)")
    parser.add_argument("--length-every", type=int, default=3, help="lengths case: draw a new length this often")
    parser.add_argument("--capacity-fraction", type=float, default=0.5, help="chameleon's capacity / unswapped peak")
    parser.add_argument("--min-swap-kib", type=float, default=16, help="min_swap_bytes in KiB")
    parser.add_argument("--policy-trials", type=int, default=None,
                        help="profiler.policy_trials (default: the config's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on a shared 2-core machine two threads stall each other)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="tiny models and few iterations (smoke test)")
    parser.add_argument("--verbose", action="store_true", help="log one line per iteration")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.small:
        args.layers, args.hidden, args.heads, args.batch, args.vocab, args.seq = 4, 8, 2, 4, 16, 32
        args.experts, args.lengths, args.iterations, args.min_swap_kib = 8, "16,24,32", 12, 1
        if args.policy_trials is None:
            args.policy_trials = 2
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if args.cases == ["all"]:
        args.cases = list(CASES)
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    if (not args.cases or set(args.cases) - set(CASES) or not 0 < args.capacity_fraction <= 1 or args.iterations < 1
            or args.length_every < 1 or args.hidden % args.heads or min(args.lengths) < 1):
        parser.error(f"need --cases from {', '.join(CASES)}, 0 < --capacity-fraction <= 1, --iterations >= 1, "
                     "--length-every >= 1, positive --lengths and --hidden divisible by --heads")
    needs_hf = [c for c in args.cases if c in HF_CASES]
    if needs_hf and not transformers_available():
        parser.error(f"the cases {', '.join(needs_hf)} need Hugging Face transformers, which is not installed: "
                     f"{HF_INSTALL}")
    args.min_swap_bytes = int(args.min_swap_kib * 1024)
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run_benchmark("launch.bench.bench_dynamic", argv, parse_args(argv), torch, run, print_report)


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")
    logger.setLevel(logging.INFO)
    main()
