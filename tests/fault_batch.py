"""Multi-rank jobs whose ranks may differ (``argv_by_rank``) and whose survivors are left to end on their own,
for ``tests/test_rank_faults.py`` (issue 37 item 12).

    python -m tests.fault_batch LAUNCHER RUNS.json RESULTS.json

Like ``tests/rank_batch.py`` (whose rank start it reuses: the launcher imported once, each rank forked with
torchrun's environment), except that each run gives every rank its own argv and nothing tears the job down
when a rank fails: each survivor must end by itself (a dead peer's closed connection, the settings check), so
what a test sees is the ranks' own behaviour, not a launcher's. A run past its ``timeout_s`` is killed and
reported as timed out. RESULTS.json: per run ``returncodes``, ``timed_out``, ``elapsed_s``, ``logs``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.rank_batch import LAUNCHERS, _free_port, _rank, _signal, _tail


def run(launcher, spec: dict, workdir: Path) -> dict:
    argvs, name = [list(a) for a in spec["argv_by_rank"]], spec["name"]
    world_size, port = len(argvs), _free_port()
    logs = [workdir / f"{name}.rank{r}.log" for r in range(world_size)]
    start = time.monotonic()
    children: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _rank(launcher, rank, world_size, port, argvs[rank], logs[rank])
        children[pid] = rank
    codes: dict[int, int] = {}
    deadline, timed_out = start + float(spec.get("timeout_s", 120)), False
    while len(codes) < world_size:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[children[pid]] = os.waitstatus_to_exitcode(status)
            continue
        if time.monotonic() > deadline and not timed_out:
            timed_out = True
            _signal([p for p, r in children.items() if r not in codes], signal.SIGKILL)
        time.sleep(0.05)
    return {"name": name, "returncodes": [codes[r] for r in range(world_size)], "timed_out": timed_out,
            "elapsed_s": time.monotonic() - start, "logs": [_tail(log) for log in logs]}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in LAUNCHERS:
        raise SystemExit(f"usage: python -m tests.fault_batch {{{','.join(LAUNCHERS)}}} RUNS.json RESULTS.json")
    launcher = importlib.import_module(f"launch.{argv[0]}")  # once, before any fork
    out, results = Path(argv[2]), []
    for spec in json.loads(Path(argv[1]).read_text()):
        results.append(run(launcher, spec, out.parent))
        out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
