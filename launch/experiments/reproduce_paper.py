"""The planner's reproduction of the paper's comparison, and its validation against measurements.

    .venv/bin/python -m launch.experiments.reproduce_paper                      # print the reproduction tables
    .venv/bin/python -m launch.experiments.reproduce_paper --write              # ... and put them in docs/planner.md
    .venv/bin/python -m launch.experiments.reproduce_paper --validate --write   # also measure: memory and time (CPU)

Reproduction: ``chameleon_dist.planner.reproduce`` (the same tables as ``chameleon-plan --reproduce``).

Validation (``--validate``): a small Megatron-core GPT trains on CPU in one process on the emulated
device (TP = PP = DP = 1, fp32, Adam) with no, selective and full recomputation and with the Chameleon
runtime's swap-everything executor; the measured per-rank peak is compared with the planner's prediction
for the same shape. Time: one layer's forward time and the optimizer step are measured in a run without
Chameleon, the planner's hardware profile is calibrated from them and from the emulated link bandwidth,
and the predicted iteration time is compared with the measured one for each setting (emulated).
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import time
import warnings
from pathlib import Path
from types import MappingProxyType

from chameleon_dist.config import DEFAULT_JOB, read_mapping
from chameleon_dist.models import TransformerShape

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "planner.md"
MARKERS = MappingProxyType({
    "reproduction": ("<!-- reproduction:begin -->", "<!-- reproduction:end -->"),
    "validation": ("<!-- validation:begin -->", "<!-- validation:end -->"),
    "calibration": ("<!-- calibration:begin -->", "<!-- calibration:end -->"),  # (launch.experiments.planner_calibration)
})
RECOMPUTE_OVERRIDES = MappingProxyType({  # Megatron TransformerConfig fields
    "none": MappingProxyType({}),
    "selective": MappingProxyType({"recompute_granularity": "selective"}),
    "full": MappingProxyType({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
})


DEFAULT_SHAPE = TransformerShape(**read_mapping(DEFAULT_JOB, what="job file")["model"])  # the main job's model
VALIDATION_SHAPES = (DEFAULT_SHAPE, TransformerShape(
    num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1024, seq_length=512, micro_batch_size=2))
SETTINGS = (("none", False), ("selective", False), ("full", False), ("none", True))


class Trainer:
    """One CPU Megatron GPT with its own Chameleon runtime and emulated device, stepping on demand (inside
    a ``megatron_cpu_session``; several can share one session)."""

    def __init__(self, shape: TransformerShape, recompute: str = "none", swap: bool = False,
                 link_bytes_per_s: float | None = None, min_swap_bytes: int = 0, seed: int = 1234,
                 capacity_bytes: int | None = None) -> None:
        import torch

        from chameleon_dist.config import ChameleonConfig
        from chameleon_dist.device import UNBOUNDED_CAPACITY_BYTES, EmulatedDevice
        from chameleon_dist.integrations.megatron import build_gpt
        from chameleon_dist import Chameleon

        self.shape = shape
        self.seed = seed
        self.model = build_gpt(self.shape, seed=seed, **RECOMPUTE_OVERRIDES[recompute])
        config = ChameleonConfig(enabled=swap, min_swap_bytes=min_swap_bytes, device={"kind": "emulated"})
        device = EmulatedDevice(capacity_bytes or UNBOUNDED_CAPACITY_BYTES, h2d_bytes_per_s=link_bytes_per_s,
                                d2h_bytes_per_s=link_bytes_per_s)
        self.chameleon = Chameleon(config, device=device)
        self.chameleon.attach(self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.layer_s: list[float] = []  # forward time of every layer in the latest iteration
        self.optimizer_s: list[float] = []
        self.iteration_s: list[float] = []
        self.peaks: list[int] = []
        started: dict[int, float] = {}
        for index, layer in enumerate(self.model.decoder.layers):
            layer.register_forward_pre_hook(lambda *_, i=index: started.__setitem__(i, time.perf_counter()))
            layer.register_forward_hook(lambda *_, i=index: self.layer_s.append(time.perf_counter() - started[i]))
        self.optimizer.register_step_pre_hook(lambda *_: started.__setitem__(-1, time.perf_counter()))
        self.optimizer.register_step_post_hook(lambda *_: self.optimizer_s.append(time.perf_counter() - started[-1]))

    def step(self) -> None:
        from chameleon_dist.integrations.megatron import gpt_loss, synthetic_batch

        batch = synthetic_batch(self.shape, len(self.iteration_s), self.seed)
        self.layer_s.clear()

        def closure():
            loss = gpt_loss(self.model, {k: v.clone() for k, v in batch.items()})
            loss.backward()
            return loss.detach()

        start = time.perf_counter()
        self.chameleon.run_iteration(closure, optimizer=self.optimizer)
        self.iteration_s.append(time.perf_counter() - start)
        self.optimizer.zero_grad(set_to_none=True)
        self.peaks.append(self.chameleon.last_report.peak_device_bytes)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def measure_peak_bytes(shape: TransformerShape, recompute: str = "none", swap: bool = False, iterations: int = 2,
                       min_swap_bytes: int = 0, seed: int = 1234) -> int:
    """The emulated device's measured peak over the iterations after the first (Adam's state exists from
    then on), in a fresh session on an unbounded device with an instant link."""
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    from chameleon_dist.integrations.megatron import megatron_cpu_session

    with megatron_cpu_session(seed=seed):
        trainer = Trainer(shape, recompute, swap, min_swap_bytes=min_swap_bytes, seed=seed)
        for _ in range(iterations):
            trainer.step()
    return max(trainer.peaks[1:] or trainer.peaks)


def predicted_peak_bytes(shape: TransformerShape, recompute: str = "none", swap: bool = False, min_swap_bytes: int = 0) -> int:
    from chameleon_dist.planner.calibrate import cpu_peak, cpu_setup, megatron_cpu_gpt

    model = megatron_cpu_gpt(shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.vocab_size,
                             shape.seq_length, shape.ffn_hidden_size)
    setup = cpu_setup(shape.micro_batch_size, shape.seq_length, min_swap_bytes=min_swap_bytes)
    return cpu_peak(model, setup, shape.micro_batch_size, recompute, swap_everything=swap).peak_bytes


def memory_rows(shapes=VALIDATION_SHAPES) -> list[dict]:
    rows = []
    for shape in shapes:
        for recompute, swap in SETTINGS:
            measured = measure_peak_bytes(shape, recompute, swap)
            predicted = predicted_peak_bytes(shape, recompute, swap)
            rows.append({"shape": shape.describe(), "recompute": recompute, "swap": swap,
                         "measured_bytes": measured, "predicted_bytes": predicted, "error": predicted / measured - 1})
    return rows


TIME_SETTINGS = (("none", False), ("full", False), ("none", True))
SWAP_CAPACITY_BYTES = 120 * 2**20  # below the default shape's 135 MiB unswapped peak; the budget is 90% of it


def time_rows(shape: TransformerShape = DEFAULT_SHAPE, rounds: int = 6, warmup: int = 8, link_bytes_per_s: float = 1e9,
              capacity_bytes: int = SWAP_CAPACITY_BYTES, seed: int = 1234) -> tuple[list[dict], dict]:
    """One session, one model per setting, iterations in round robin (so that a change in machine load
    hits every setting alike); medians over the rounds after ``warmup`` (the profiler's WarmUp iterations
    and the policy trials of GenPolicy). The calibration comes from the no-recompute model's own layer
    forward and optimizer times; the planner then predicts every setting. The swap setting runs the
    runtime's chosen policy on a device of ``capacity_bytes``; the planner predicts it with its own swap
    model (the policy generator on its coarse trace) for the same budget."""
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    from chameleon_dist.config import AUTO_DEVICE_FRACTION
    from chameleon_dist.integrations.megatron import megatron_cpu_session
    from chameleon_dist.planner import Layout, evaluate
    from chameleon_dist.planner.calibrate import calibrated_hardware, cpu_setup, megatron_cpu_gpt

    with megatron_cpu_session(seed=seed):
        trainers = {key: Trainer(shape, key[0], key[1], link_bytes_per_s if key[1] else None, seed=seed,
                                 capacity_bytes=capacity_bytes if key[1] else None)
                    for key in TIME_SETTINGS}
        layer_s: list[float] = []
        for round_index in range(warmup + rounds):
            for key, trainer in trainers.items():
                trainer.step()
                if key == ("none", False) and round_index >= warmup:
                    layer_s.extend(trainer.layer_s)
    reference = trainers[("none", False)]
    model = megatron_cpu_gpt(shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.vocab_size,
                             shape.seq_length, shape.ffn_hidden_size)
    setup = cpu_setup(shape.micro_batch_size, shape.seq_length)
    optimizer_s = statistics.median(reference.optimizer_s[warmup:])
    hardware = calibrated_hardware(model, setup, shape.micro_batch_size, statistics.median(layer_s), optimizer_s,
                                   link_bytes_per_s, memory_bytes=capacity_bytes,
                                   usable_bytes=int(capacity_bytes * AUTO_DEVICE_FRACTION))
    calibration = {"layer_forward_s": statistics.median(layer_s), "optimizer_s": optimizer_s,
                   "effective_flops_per_s": hardware.peak_flops_per_s, "link_bytes_per_s": link_bytes_per_s,
                   "capacity_bytes": capacity_bytes}
    rows = []
    for (recompute, swap), trainer in trainers.items():
        plan = evaluate(model, hardware, setup, Layout(micro_batch=shape.micro_batch_size, recompute=recompute, swap=swap))
        measured_s = statistics.median(trainer.iteration_s[warmup:])
        rows.append({"recompute": recompute, "swap": swap, "measured_s": measured_s, "predicted_s": plan.iteration_s,
                     "predicted_stall_s": plan.time.stall, "measured_stall_s": trainer.chameleon.last_report.stall_s,
                     "predicted_peak_bytes": plan.peak_bytes, "measured_peak_bytes": max(trainer.peaks[warmup:]),
                     "predicted_feasible": plan.feasible, "error": plan.iteration_s / measured_s - 1})
    return rows, calibration


def validation_markdown(memory: list[dict], timing: list[dict], calibration: dict, command: str) -> str:
    mib = 2**20
    lines = [f"Command: `{command}` (emulated device, CPU; {time.strftime('%Y-%m-%d')}).", "",
             "| shape | recompute | swap | measured peak | predicted peak | error |", "|---|---|---|---|---|---|"]
    for r in memory:
        lines.append(f"| {r['shape']} | {r['recompute']} | {'everything' if r['swap'] else 'no'} | "
                     f"{r['measured_bytes'] / mib:.1f} MiB | {r['predicted_bytes'] / mib:.1f} MiB | {r['error'] * 100:+.1f}% |")
    lines += ["", f"Time calibration (shape: {DEFAULT_SHAPE.describe()}): one layer's forward "
              f"{calibration['layer_forward_s'] * 1e3:.2f} ms -> {calibration['effective_flops_per_s'] / 1e9:.1f} GFLOP/s; "
              f"Adam step {calibration['optimizer_s'] * 1e3:.1f} ms; emulated link "
              f"{calibration['link_bytes_per_s'] / 1e9:.1f} GB/s per direction; the swap run's device holds "
              f"{calibration['capacity_bytes'] / mib:.0f} MiB (budget 90%).", "",
              "| setting | measured iteration | predicted iteration | error | measured stall (last iteration) | "
              "predicted stall | measured peak | predicted peak |",
              "|---|---|---|---|---|---|---|---|"]
    for r in timing:
        label = f"{r['recompute']} recompute" + (", swap (runtime's policy)" if r["swap"] else "")
        lines.append(f"| {label} | {r['measured_s'] * 1e3:.1f} ms | {r['predicted_s'] * 1e3:.1f} ms | {r['error'] * 100:+.1f}% | "
                     f"{r['measured_stall_s'] * 1e3:.1f} ms | {r['predicted_stall_s'] * 1e3:.1f} ms | "
                     f"{r['measured_peak_bytes'] / mib:.1f} MiB | {r['predicted_peak_bytes'] / mib:.1f} MiB |")
    return "\n".join(lines)


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    begin, end = MARKERS[name]
    text = doc.read_text()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc}: no {begin} ... {end} section to replace")
    doc.write_text(pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"replace the generated sections of {DOC.relative_to(REPO)}")
    parser.add_argument("--validate", action="store_true", help="also measure memory and time on the CPU (~1 min)")
    args = parser.parse_args(argv)
    from chameleon_dist.planner.reproduce import markdown, reproduce

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("chameleon_dist.planner.reproduce").setLevel(logging.INFO)  # one line per scenario (~20 s each)

    start = time.perf_counter()
    tables = markdown(reproduce())
    print(tables)
    print(f"\n(reproduction computed in {time.perf_counter() - start:.1f} s)")
    if args.write:
        write_section("reproduction", "Command: `.venv/bin/python -m launch.experiments.reproduce_paper --write` "
                      "(or `.venv/bin/chameleon-plan --reproduce` to print them).\n\n" + tables)
    if args.validate:
        memory = memory_rows()
        timing, calibration = time_rows()
        text = validation_markdown(memory, timing, calibration, ".venv/bin/python -m launch.experiments.reproduce_paper --validate --write")
        print("\n" + text)
        if args.write:
            write_section("validation", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
