"""The per-rank report of a distributed launcher (``--report PATH``), one JSON shape for every engine.

Each rank keeps a ``RankRecord``: its coordinates, its device capacity, and per iteration what its runtime's
``IterationReport`` said (peak, swap-out bytes, stall, time, stage). At the end rank 0 gathers them and
writes::

    {"layout": {...}, "chameleon": {"enabled": ..., "config": {...}}, "losses": ["0x1.8p+2", ...],
     "ranks": [{"rank": 0, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "capacity_bytes": ...,
                "peak_device_bytes": ..., "iterations": [{"peak_device_bytes": ..., "swap_out_bytes": ...,
                "stall_s": ..., "iteration_s": ..., "stage": "warmup"}, ...], "params_sha256": "..."}, ...]}

Losses are exact (``float.hex``); ``params_sha256`` hashes the rank's final parameters in a fixed order, so
two runs compare bit for bit without dumping weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from chameleon_dist.schema_version import versioned

logger = logging.getLogger(__name__)


def launcher_setup(framework_logger: str, *, ignored_warnings: Iterable[str] = ()) -> None:
    """What both launchers' ``main`` sets up before training: INFO logging with timestamps (chameleon-dist's and
    the framework's own loggers at WARNING, so rank 0's progress lines stand out), DeprecationWarning and the
    warnings matching ``ignored_warnings`` silenced, and deterministic algorithms for bit-for-bit comparable
    runs (on CUDA, where some framework kernels have no deterministic variant, they only warn)."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for message in ignored_warnings:
        warnings.filterwarnings("ignore", message=message)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("chameleon_dist").setLevel(logging.WARNING)
    logging.getLogger(framework_logger).setLevel(logging.WARNING)
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())


def params_sha256(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of each parameter, in the order given."""
    digest = hashlib.sha256()
    for name, parameter in named_parameters:
        value = parameter.detach().to("cpu").contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


ROW_KEYS = ("peak_device_bytes", "swap_out_bytes", "stall_s", "iteration_s", "stage", "passive_swaps",
            "sequence_change_kind", "stage_transition", "emulated")
"""The ``IterationReport.to_dict()`` keys of each iteration's row (``stage_transition``: what changed stage after
this iteration, and why)."""


@dataclasses.dataclass
class RankRecord:
    coordinates: dict[str, int]
    capacity_bytes: int
    iterations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    params_sha256: str = ""
    schedule: str = ""  # the micro-batch order of the last detailed trace ("F0 F1 B0 F2 ..."): see ``schedule_of``

    def add(self, report: Any) -> dict[str, Any]:
        """Record one iteration from the runtime's ``IterationReport``; returns the row."""
        fields = report.to_dict()
        row = {key: fields[key] for key in ROW_KEYS}
        self.iterations.append(row)
        return row

    def to_dict(self) -> dict[str, Any]:
        c = self.coordinates
        return {
            "rank": c["rank"], "tp_rank": c["tp_rank"], "pp_rank": c["pp_rank"], "dp_rank": c["dp_rank"],
            "coordinates": c,
            "capacity_bytes": self.capacity_bytes,
            "peak_device_bytes": max((row["peak_device_bytes"] for row in self.iterations), default=0),
            "iterations": self.iterations,
            "params_sha256": self.params_sha256,
            "schedule": self.schedule,
        }


def schedule_of(trace: Any) -> str:
    """``F0 F1 B0 F2 B1 ...``: the forward and backward runs of a ``StepTrace`` with their micro-batch slots,
    as the profiler recorded them ("" without a trace)."""
    if trace is None:
        return ""
    return " ".join(f"{phase[0].upper()}{micro_batch}" for phase, micro_batch in trace.phase_runs())


def gather(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (a collective: every rank must call it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def write_report(path: str | Path, layout: dict[str, Any], chameleon: dict[str, Any], losses: list[float],
                 ranks: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> Path:
    """Write the report JSON (rank 0 only calls this, with every rank's ``RankRecord.to_dict()``); ``extra``: more
    top-level keys (e.g. the Megatron launcher's ``steps``: each optimizer step's loss scale and whether it was
    skipped)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"layout": layout, "chameleon": chameleon, "losses": [float(x).hex() for x in losses], "ranks": ranks,
            **(extra or {})}
    path.write_text(json.dumps(versioned(body), indent=1) + "\n")
    logger.info("report written to %s", path)
    return path
