"""``chameleon-plan``: the fastest combination of parallel layout, recomputation and Chameleon swap for a
model on a cluster, the alternatives with the reason each lost, and the comparison "best with swap vs best
with recomputation vs best with TP/PP alone".

    chameleon-plan --model llama2-7b --hardware ascend-910b --devices 8 --seq 8192 --global-batch 64
    chameleon-plan --model configs/models/llama2-13b.yaml --devices 64 --json
    chameleon-plan --hardware h100-pcie --calibration runs/calibration.json   # measured times (docs/planner.md)
    chameleon-plan --model llama2-70b --cluster dgx-h100-8x8   # nodes, links and host RAM from configs/clusters
    chameleon-plan --reproduce            # the paper's comparison (docs/planner.md)
    chameleon-plan --list                 # shipped profiles
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from chameleon_dist.config import ConfigError
from chameleon_dist.config.sizes import SizeError, parse_size_bytes
from chameleon_dist.planner import tables
from chameleon_dist.planner.cluster import load_cluster
from chameleon_dist.planner.layout import RECOMPUTE_MODES
from chameleon_dist.planner.profiles import (
    DEFAULT_MEMORY_MARGIN,
    CLUSTER_KIND,
    HARDWARE_KIND,
    MODEL_KIND,
    load_hardware,
    load_model,
    make_setup,
    overlap_settings,
    shipped_names,
)
from chameleon_dist.planner.search import PlanError, search
from chameleon_dist.planner.space import SearchSpace, cp_problem
from chameleon_dist.schema_version import versioned

DEFAULT_MODEL, DEFAULT_HARDWARE, DEFAULT_DEVICES = "llama2-7b", "ascend-910b", 8


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers >= 1, e.g. 1,2,4")
    return values


def _modes(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in RECOMPUTE_MODES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: recompute modes are {', '.join(RECOMPUTE_MODES)}")
    return values


def _margin(text: str) -> tuple[str, float]:
    """``--memory-margin``: a percentage of usable memory ("5%") or a size ("3GB")."""
    text = text.strip()
    try:
        if text.endswith("%"):
            value = float(text[:-1])
            if not 0 <= value < 100:
                raise ValueError
            return "fraction", value / 100
        return "bytes", float(parse_size_bytes(text))
    except (ValueError, SizeError):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a percentage of usable memory from 0% to under 100% (e.g. 5%) or a size (e.g. 3GB)") from None


def _margin_fraction(margin: tuple[str, float] | None, usable_bytes: int) -> float:
    if margin is None:
        return DEFAULT_MEMORY_MARGIN
    kind, value = margin
    fraction = value if kind == "fraction" else value / usable_bytes
    if fraction >= 1:
        raise PlanError(f"--memory-margin {value / 1e9:g}GB leaves nothing of the {usable_bytes / 1e9:.1f} GB usable; "
                        "give a smaller margin")
    return fraction


def _check_writable(path: str) -> None:
    """Fail before the search, not after it: ``--json PATH`` needs an existing, writable directory."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise PlanError(f"--json {path}: the directory {folder} does not exist; create it or give another path")
    if not os.access(folder, os.W_OK):
        raise PlanError(f"--json {path}: the directory {folder} is not writable; give another path")


def _calibrate(hardware, path: str):
    """``hardware`` calibrated from the file at ``path``, and the report's lines saying so."""
    from chameleon_dist.planner.calibration import apply_calibration, describe, load_calibration

    calibration = load_calibration(path)
    calibrated = apply_calibration(hardware, calibration, source=path)
    changes = describe(hardware, calibrated) or ["no figure changed"]
    return calibrated, {"file": path, "source": calibration.source, "changes": changes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="chameleon-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"shipped model or a .yaml profile (default {DEFAULT_MODEL})")
    parser.add_argument("--hardware", help=f"shipped accelerator or a .yaml profile (default {DEFAULT_HARDWARE})")
    parser.add_argument("--cluster", help="shipped cluster or a .yaml cluster profile: the accelerator, nodes, links and "
                                          "host RAM per node (instead of --hardware)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="measured or simulated layer times and link rates replacing the hardware profile's "
                             "(a calibration file, planner/calibration.py)")
    parser.add_argument("--devices", type=int,
                        help=f"world size (default {DEFAULT_DEVICES}, or the whole --cluster; with --cluster: whole "
                             "nodes of it or devices of one node)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the model profile's seq_length)")
    parser.add_argument("--global-batch", type=int, help="sequences per iteration (default: 8 per device)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1,
                        help="optimizer sharding: 1 = Megatron's distributed optimizer (default)")
    parser.add_argument("--attention", choices=("flash", "unfused"), default="flash")
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--tp", type=_ints, help="TP degrees to try, e.g. 1,2,4 (default: all that divide)")
    parser.add_argument("--pp", type=_ints, help="PP degrees to try (default: all that divide)")
    parser.add_argument("--cp", type=_ints, help="context-parallel degrees to try, e.g. 1,2,4 (default: those that "
                        "divide and leave each rank >= 4096 tokens)")
    parser.add_argument("--vpp", type=_ints, default=(1, 2, 4), help="model chunks per stage (default 1,2,4)")
    parser.add_argument("--micro-batch", type=_ints, default=(1, 2, 4), help="micro-batch sizes (default 1,2,4)")
    parser.add_argument("--recompute", type=_modes, default=RECOMPUTE_MODES,
                        help=f"recompute modes to try (default {','.join(RECOMPUTE_MODES)})")
    parser.add_argument("--no-swap", action="store_true", help="plan without Chameleon swap")
    parser.add_argument("--memory-margin", type=_margin, metavar="PCT|SIZE",
                        help=f"device memory every plan leaves free, of the usable memory (e.g. 5%%) or a size "
                             f"(e.g. 3GB); default {DEFAULT_MEMORY_MARGIN * 100:g}%% (docs/planner.md)")
    overlap = parser.add_argument_group("Megatron's communication overlap (default: the hardware profile's value, "
                                        "else Megatron's default)")
    for flags, default in ((("--overlap-grad-reduce",), "off"), (("--overlap-param-gather",), "off"),
                           (("--tp-comm-overlap",), "off"), (("--overlap-p2p-comm", "--overlap-p2p-communication"),
                                                              "on, interleaved schedule only")):
        overlap.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None,
                             help=f"Megatron's default: {default}")
    parser.add_argument("--top", type=int, default=12, help="alternatives shown (default 12)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the result as JSON to PATH (or stdout without PATH)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also report the headline speedups as ranges over the hardware profile's assumed inputs")
    parser.add_argument("--reproduce", action="store_true",
                        help="print the paper's comparison tables (markdown), with ranges over the assumed inputs")
    parser.add_argument("--list", action="store_true", help="list the shipped model, hardware and cluster profiles")
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except (ConfigError, PlanError) as exc:
        print(f"chameleon-plan: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader (e.g. `| head`) stopped reading: not an error of the plan
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (interpreter shutdown flushes stdout once more)
        return 0


def _run(args: argparse.Namespace) -> int:
    if args.list:
        for kind in (MODEL_KIND, HARDWARE_KIND, CLUSTER_KIND):
            print(f"{kind} profiles: {', '.join(shipped_names(kind))}")
        return 0
    if args.reproduce:
        from chameleon_dist.planner.reproduce import markdown, reproduce

        def progress(index: int, count: int, scenario) -> None:
            print(f"chameleon-plan: reproduction {index}/{count}: {scenario.label()}", file=sys.stderr)

        print(markdown(reproduce(progress=progress)))
        return 0
    model = load_model(args.model)
    cluster, hardware, devices = _machine(args)
    calibrated = None
    if args.calibration:
        hardware, calibrated = _calibrate(hardware, args.calibration)
    seq = model.seq_length if args.seq is None else args.seq  # (0 is an error, not "the default")
    batch = 8 * devices if args.global_batch is None else args.global_batch
    for option, value in (("--devices", devices), ("--seq", seq), ("--global-batch", batch), ("--top", args.top)):
        if value < 1:
            raise PlanError(f"{option} must be >= 1, got {value}")
    if args.json not in (None, "-"):
        _check_writable(args.json)
    for cp in args.cp or ():
        problem = cp_problem(make_setup(global_batch_size=batch, seq_length=seq, attention=args.attention),
                             devices, 1, 1, cp)
        if problem:
            raise PlanError(f"--cp {cp}: {problem}; give degrees that Megatron allows (or leave --cp out)")
    overlaps = overlap_settings(hardware, overlap_grad_reduce=args.overlap_grad_reduce,
                                overlap_param_gather=args.overlap_param_gather, tp_comm_overlap=args.tp_comm_overlap,
                                overlap_p2p_comm=args.overlap_p2p_comm)
    setup = make_setup(
        global_batch_size=batch, seq_length=seq, precision=args.precision, zero_stage=args.zero_stage,
        attention=args.attention, sequence_parallel=not args.no_sequence_parallel, **overlaps,
        memory_margin=_margin_fraction(args.memory_margin, hardware.usable_bytes),
    )
    space = SearchSpace(tp=args.tp, pp=args.pp, vpp=args.vpp, micro_batch=args.micro_batch,
                        recompute=args.recompute, swap=(False,) if args.no_swap else (False, True), cp=args.cp)
    result = search(model, hardware, setup, devices, space, cluster=cluster)
    ranges = None
    if args.sensitivity:
        from chameleon_dist.planner.sensitivity import sensitivity_of_search

        print(f"chameleon-plan: sweeping {len(hardware.assumed)} assumed inputs of {hardware.name}", file=sys.stderr)
        ranges = sensitivity_of_search(model, hardware, setup, devices, space, cluster=cluster, result=result)
    if args.json:
        data = tables.result_dict(result)
        if ranges is not None:
            data["sensitivity"] = ranges.to_dict()
        if calibrated:
            data["calibration"] = calibrated
        text = json.dumps(versioned(data), indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            try:
                with open(args.json, "w") as handle:
                    handle.write(text)
            except OSError as exc:
                raise PlanError(f"--json {args.json}: cannot write it ({exc.strerror})") from None
            print(f"chameleon-plan: result written to {args.json}", file=sys.stderr)
    if args.json != "-":
        if calibrated:
            print(f"calibrated from {calibrated['file']} ({calibrated['source']}):")
            print("\n".join(f"  {change}" for change in calibrated["changes"]))
        print(tables.text_report(result, top=args.top))
        if ranges is not None:
            print("\n" + tables.sensitivity_text(ranges))
    return 0 if result.best is not None else 3


def _machine(args: argparse.Namespace):
    """(cluster or None, the hardware profile every rank is priced with, the world size)."""
    if args.cluster is None:
        devices = DEFAULT_DEVICES if args.devices is None else args.devices
        return None, load_hardware(args.hardware or DEFAULT_HARDWARE), devices
    if args.hardware is not None:
        raise PlanError(f"--hardware {args.hardware} with --cluster {args.cluster}: a cluster names its accelerator "
                        "(its hardware field); give one of --hardware and --cluster")
    cluster = load_cluster(args.cluster)
    devices = cluster.world_size if args.devices is None else args.devices
    cluster.check_devices(devices)
    return cluster, cluster.device_profile(), devices


if __name__ == "__main__":
    raise SystemExit(main())
