"""Chameleon on megatron-core under tensor, pipeline (interleaved) and data parallelism: every layout of the
README's launcher list trained with and without Chameleon, by torchrun, and compared.

Each layout is ``launch/train_megatron.py`` started twice with ``torchrun --standalone --nproc-per-node N``,
one job after the other (never two at once), with the launcher's defaults for the model size:

1. reference: ``--no-chameleon --chameleon-device-capacity 4GB``: every rank is metered, nothing is
   swapped, nothing runs out: the report gives each rank's unswapped peak and iteration times;
2. chameleon: ``--chameleon-device-capacity <the layout's capacity>``, below the largest unswapped peak.

The layouts, their arguments and capacities are read from ``LAYOUTS`` in ``tests/test_megatron_ranks.py``
(the table the multi-rank tests run and the README lists; it is a literal, parsed with ``ast`` so that
nothing of the test module runs here). Per layout the table gives:

- the largest unswapped peak over the ranks (reference) and the largest peak with Chameleon, the capacity,
  and their ratio (Chameleon / reference);
- the time ratio Chameleon / reference: the *window* is the trailing run of iterations in which every rank
  of the Chameleon job reports the Stable stage; per job, each rank's median ``iteration_s`` over the
  window, then the maximum over the ranks (a synchronous job goes at its slowest rank); the ratio divides
  the two jobs' figures. No window (the last iteration is not Stable on every rank): no ratio;
- swap-out bytes per iteration: the sum over the ranks of each rank's mean ``swap_out_bytes`` over the
  window (over the last iteration when there is no window);
- bit-identity: equal ``losses`` (exact, ``float.hex``) and equal ``params_sha256`` on every rank;
- the stage of the last iteration on each rank.

On CPU every rank runs on gloo with one ``EmulatedDevice`` (a simulated GPU): memory as the caching
allocator reports it; without ``--preset`` the compute figures are this CPU's measured rates and the host
link is instant, with it the preset's roofline and real link rates. All times are emulated device time.

    .venv/bin/python -m launch.bench.bench_megatron --json runs/bench_megatron.json   # ~10 min on 2 cores
    .venv/bin/python -m launch.bench.bench_megatron --layouts pp2,tp2pp2 --iterations 20
    .venv/bin/python -m launch.bench.bench_megatron --dry-run                         # one 2-rank layout, 3 iterations
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from launch.bench.compare_reports import compare, stable_window  # noqa: F401  (stable_window: for the tests)
from launch.bench.harness import run_benchmark

import torch

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = "launch.train_megatron"  # run as a module (torchrun -m) from the repository root
LAYOUTS_SOURCE = REPO / "tests" / "test_megatron_ranks.py"
DRY_RUN_LAYOUT = "pp2"
DRY_RUN_ITERATIONS = 3
MIB = 2**20


def read_literal(name: str, path: Path = LAYOUTS_SOURCE) -> Any:
    """The value of the module-level assignment ``name = <literal>`` in ``path``, without importing it."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            try:
                return ast.literal_eval(node.value)
            except ValueError as exc:
                raise ValueError(f"{name} in {path} is no longer a literal: {exc}") from exc
    raise LookupError(f"no module-level {name} = ... in {path}")


def tested_layouts(path: Path = LAYOUTS_SOURCE) -> dict[str, tuple[int, list[str], str]]:
    """name -> (world size, layout arguments, Chameleon's capacity per rank), as the multi-rank tests run them."""
    table = read_literal("LAYOUTS", path)
    return {name: (int(world), list(layout), str(capacity)) for name, (world, layout, capacity) in table.items()}


# ---- one torchrun job ---------------------------------------------------------------------------
def torchrun() -> Path:
    return Path(sys.executable).with_name("torchrun")


def run_job(world_size: int, argv: list[str], report: Path, log: Path, timeout_s: float) -> dict:
    """``torchrun`` the launcher with ``argv`` (``--report`` added); its output goes to ``log``. The job runs
    in its own process group, killed whole should it pass ``timeout_s``."""
    command = [str(torchrun()), "--standalone", "--nproc-per-node", str(world_size), "-m", LAUNCHER, *argv,
               "--report", str(report)]
    shown = shlex.join([".venv/bin/torchrun", *command[1:6], *argv])
    report.unlink(missing_ok=True)
    started = time.perf_counter()
    timed_out = False
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
    elapsed_s = time.perf_counter() - started
    body = json.loads(report.read_text()) if code == 0 and report.exists() else None
    result = {"command": shown, "returncode": code, "timed_out": timed_out, "elapsed_s": elapsed_s, "report": body}
    if body is None:
        lines = [line for line in log.read_text(errors="replace").splitlines() if "warn" not in line.lower()]
        result["errors"] = [line for line in lines if " ERROR " in line][:4]  # the ranks' own error lines
        result["log_tail"] = "\n".join(lines)[-4000:]
    return result


# ---- comparison ---------------------------------------------------------------------------------
def run_layout(name: str, world_size: int, layout: list[str], capacity: str, args: argparse.Namespace,
               workdir: Path) -> dict:
    common = [*layout, "--iterations", str(args.iterations)]
    preset = ["--chameleon-preset", args.preset] if args.preset else []
    jobs = {}
    for job, extra in (("reference", ["--no-chameleon", "--chameleon-device-capacity", args.unlimited]),
                       ("chameleon", ["--chameleon-device-capacity", capacity, *preset])):
        logger.info("%s: %s ...", name, job)
        jobs[job] = run_job(world_size, [*common, *extra], workdir / f"{name}-{job}.json", workdir / f"{name}-{job}.log",
                            args.timeout_s)
        logger.info("%s: %s %s in %.0f s", name, job, "done" if jobs[job]["report"] else "FAILED", jobs[job]["elapsed_s"])
    result: dict[str, Any] = {"name": name, "world_size": world_size, "layout_args": layout, "capacity": capacity}
    for job, outcome in jobs.items():
        result[job] = {k: v for k, v in outcome.items() if k != "report"}
    failed = [job for job, outcome in jobs.items() if outcome["report"] is None]
    if failed:
        result["error"] = f"{' and '.join(failed)} job failed"
        return result
    result["layout"] = jobs["chameleon"]["report"]["layout"]
    result.update(compare(jobs["reference"]["report"], jobs["chameleon"]["report"]))
    return result


def run(args: argparse.Namespace) -> dict:
    layouts = tested_layouts()
    names = [DRY_RUN_LAYOUT] if args.dry_run else args.layouts or list(layouts)
    unknown = [n for n in names if n not in layouts]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(layouts)}")
    with tempfile.TemporaryDirectory(prefix="bench_megatron_") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = [run_layout(n, *layouts[n], args, workdir) for n in names]
    done = [r for r in results if "error" not in r]
    return {
        "emulated": not torch.cuda.is_available(),
        "layouts": results,
        "checks": {
            "all_completed": len(done) == len(results),
            "all_bit_identical": bool(done) and all(r["bit_identical"] for r in done),
            "all_within_capacity": bool(done) and all(r["within_capacity"] for r in done),
        },
    }


# ---- report -------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _stages(last: dict[str, str]) -> str:
    kinds = sorted(set(last.values()))
    return kinds[0] if len(kinds) == 1 else " ".join(f"{k}:{v}" for k, v in last.items())


def print_report(r: dict) -> None:
    m, c = r["machine"], r["config"]
    print(f"command: {r['command']}")
    print(f"date: {r['date']}; {m['cpu']} ({m['cpus']} CPUs), torch {m['torch']}; load average "
          f"{m['load_average_before']:.2f} before, {m['load_average_after']:.2f} after")
    links = sorted({v["link"] for v in r["layouts"] if "link" in v})
    if r["emulated"]:
        print(f"emulated (CPU): gloo, one EmulatedDevice per rank (memory metered exactly), link: "
              f"{', '.join(links) or '-'}; all ranks share this machine's cores: times are emulated")
    print(f"each layout: torchrun reference (--no-chameleon, capacity {c['unlimited']}) then chameleon (the layout's "
          f"capacity), {c['iterations']} iterations each, launcher defaults otherwise, one job at a time")
    print()
    print(f"{'layout':<24}{'ranks':>6}{'unswapped':>11}{'chameleon':>11}{'capacity':>10}{'peak':>7}{'time':>7}"
          f"{'window':>8}{'swap-out/it':>13}{'bit-identical':>15}  last stage")
    print(f"{'':<24}{'':>6}{'MiB':>11}{'MiB':>11}{'MiB':>10}{'ratio':>7}{'ratio':>7}{'':>8}{'MiB':>13}")
    for v in r["layouts"]:
        if "error" in v:
            print(f"{v['name']:<24}{v['world_size']:>6}  FAILED: {v['error']}")
            continue
        window = v["stable_window"]
        span = f"{window[0] + 1}-{window[-1] + 1}" if window else "-"
        same = "yes" if v["bit_identical"] else f"NO (losses {v['losses_identical']}, params {v['params_identical']})"
        print(f"{v['name']:<24}{v['world_size']:>6}{v['unswapped_peak_bytes'] / MIB:>11.2f}"
              f"{v['chameleon_peak_bytes'] / MIB:>11.2f}{v['capacity_bytes'] / MIB:>10.2f}{v['peak_ratio']:>7.2f}"
              f"{_fmt(v['time_ratio'], '.2f'):>7}{span:>8}{v['swap_out_bytes_per_iteration'] / MIB:>13.2f}"
              f"{same:>15}  {_stages(v['last_stage'])}")
    print("  peaks: max over ranks; peak ratio = chameleon / unswapped; window = the trailing iterations (1-based) "
          "Stable on every rank;")
    print("  time ratio = chameleon / reference of (max over ranks of the rank's median iteration_s over the window); "
          "swap-out/it = sum over ranks of the mean over the window (of the last iteration without one)")
    for v in r["layouts"]:
        if "error" in v:
            for job in ("reference", "chameleon"):
                if "log_tail" in v[job]:
                    said = "\n".join(v[job]["errors"]) or v[job]["log_tail"][-1500:]
                    print(f"{v['name']} {job}: {v[job]['command']} exited {v[job]['returncode']}"
                          f"{' (timed out)' if v[job]['timed_out'] else ''}:\n{said}")
    k = r["checks"]
    print(f"all completed: {'yes' if k['all_completed'] else 'NO'}; all bit-identical: "
          f"{'yes' if k['all_bit_identical'] else 'NO'}; peaks within capacity: "
          f"{'yes' if k['all_within_capacity'] else 'NO'}")
    print(f"wall time {r['wall_s']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=None,
                        help="comma-separated names from LAYOUTS in tests/test_megatron_ranks.py (default: all)")
    parser.add_argument("--iterations", type=int, default=12, help="iterations per job")
    parser.add_argument("--unlimited", default="4GB", help="the reference's emulated capacity (nothing runs out)")
    parser.add_argument("--preset", default=None, help="--chameleon-preset for the chameleon jobs (default: instant link)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="a job running longer is killed and reported failed")
    parser.add_argument("--workdir", default=None, help="keep the jobs' reports and logs here (default: a temporary folder)")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"only layout {DRY_RUN_LAYOUT}, {DRY_RUN_ITERATIONS} iterations (smoke test)")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args(argv)
    args.layouts = [n.strip() for n in args.layouts.split(",") if n.strip()] if args.layouts else None
    if args.dry_run:
        args.iterations = DRY_RUN_ITERATIONS
    if args.iterations < 1 or args.timeout_s <= 0:
        parser.error("--iterations must be >= 1 and --timeout-s > 0")
    args.threads = torch.get_num_threads()  # run_benchmark's frame; the jobs run in their own processes
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return run_benchmark("launch.bench.bench_megatron", argv, parse_args(argv), torch, run, print_report)


if __name__ == "__main__":
    logging.basicConfig(format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    main()
