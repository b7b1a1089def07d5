"""``StepTrace``: what the detailed profiler saw in one training iteration (the shared vocabulary).

Per op: its name id, phase, micro-batch, module and layer, the tensors it read and wrote, and the live
device bytes after it. Per storage: its size and the ops between which it lived. Per swap: which storage
left the device and when its copy came back, so the no-swap memory curve can be rebuilt from an
iteration that already swapped. JSON round-trip with a schema version.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)  # version 1 had no ``saves``

FORWARD, BACKWARD, OPTIMIZER, OTHER = "forward", "backward", "optimizer", "other"
PHASES = (FORWARD, BACKWARD, OPTIMIZER, OTHER)


@dataclasses.dataclass(slots=True)
class TensorRecord:
    """A tensor as ops saw it; ``storage_id`` is shared by views of one storage."""

    tensor_id: int
    storage_id: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # bytes of this view (numel * element size)
    is_parameter: bool = False
    saved: bool = False  # saved for backward by autograd


@dataclasses.dataclass(slots=True)
class StorageRecord:
    """A storage's life within the iteration (op indices; -1: before the iteration / still alive)."""

    storage_id: int
    nbytes: int
    created_at: int = -1
    freed_at: int = -1
    is_parameter: bool = False


@dataclasses.dataclass(slots=True)
class OpRecord:
    name_id: int
    phase: str
    micro_batch: int
    module_id: int  # index into StepTrace.module_paths, -1 when no module was active
    layer: int  # transformer layer index when known, else -1
    inputs: tuple[int, ...]  # tensor ids
    outputs: tuple[int, ...]
    live_bytes: int  # live device bytes after the op


@dataclasses.dataclass(slots=True)
class SwapRecord:
    """A storage that left the device during the profiled iteration (bytes, and op indices)."""

    storage_id: int
    nbytes: int
    out_at: int  # op index when its swap-out was issued (its block dies at the storage's freed_at)
    restored_at: int = -1  # index of the op that re-created its device copy; -1: not in this iteration


@dataclasses.dataclass
class StepTrace:
    iteration: int
    op_names: list[str]  # name id -> aten op name (a snapshot of the runtime's vocabulary)
    module_paths: list[str]
    ops: list[OpRecord]
    tensors: list[TensorRecord]
    storages: list[StorageRecord]
    swaps: list[SwapRecord]
    iteration_s: float
    start_live_bytes: int
    layer_times_s: dict[int, float] = dataclasses.field(default_factory=dict)  # forward, per layer
    # backward seconds per layer (from its output's gradient to its input's); traces written before this
    # field existed read as {} (an addition that needs no schema version: older readers ignore it)
    layer_backward_times_s: dict[int, float] = dataclasses.field(default_factory=dict)
    # (tensor id, op index) per tensor autograd saved, in save order; the op index counts the ops recorded
    # when it was saved, so the saving op is ``ops[op_index - 1]``
    saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # where each save happened, as the swap executor names it ("" when unknown; parallel to ``saves``).
    # See NOTE [Save-site matching] in executor/matching.py
    save_sites: list[str] = dataclasses.field(default_factory=list)
    # indices of the forward ops that would not replay bit for bit with the arguments they ran with (the
    # recorder asks trace/exactness.py); None: not recorded (a hand-built trace or one written before this
    # field), and then an op is exact only when its schema alone says so. An addition older readers ignore
    inexact_ops: list[int] | None = None
    emulated: bool = True
    schema_version: int = SCHEMA_VERSION

    # ---- memory -----------------------------------------------------------------------------
    def memory_curve(self) -> list[int]:
        """Live device bytes after every op, as measured."""
        return [op.live_bytes for op in self.ops]

    def no_swap_memory_curve(self) -> list[int]:
        """The curve without swapping: a swapped storage is added back from the op where its device block
        actually died until the op that re-created its device copy (from then on the restored copy is in
        the measured curve)."""
        added = [0] * (len(self.ops) + 1)
        for swap in self.swaps:
            start = self.storages[swap.storage_id].freed_at
            end = swap.restored_at if swap.restored_at >= 0 else len(self.ops)
            if 0 <= start < end:
                added[start] += swap.nbytes
                added[end] -= swap.nbytes
        curve, running = [], 0
        for op, delta in zip(self.ops, added):
            running += delta
            curve.append(op.live_bytes + running)
        return curve

    def phase_runs(self) -> list[tuple[str, int]]:
        """``(phase, micro_batch)`` of each run of backward ops and of forward ops inside a model's modules,
        in order (other ops, e.g. a pipeline's receive buffers, are skipped): under 1F1B on the first of two
        stages, ``forward 0, forward 1, backward 0, forward 2, ...``."""
        runs: list[tuple[str, int]] = []
        for op in self.ops:
            counted = op.phase == BACKWARD or (op.phase == FORWARD and op.module_id >= 0)
            if counted and (not runs or runs[-1] != (op.phase, op.micro_batch)):
                runs.append((op.phase, op.micro_batch))
        return runs

    def micro_batch_peaks(self, curve: list[int] | None = None) -> list[tuple[int, int, int]]:
        """``(micro_batch, peak_bytes, op_index)`` per micro-batch (segments end at BWD->FWD turns)."""
        curve = self.no_swap_memory_curve() if curve is None else curve
        peaks: dict[int, tuple[int, int]] = {}
        for index, (op, live) in enumerate(zip(self.ops, curve)):
            best = peaks.get(op.micro_batch)
            if best is None or live > best[0]:
                peaks[op.micro_batch] = (live, index)
        return [(mb, peak, index) for mb, (peak, index) in sorted(peaks.items())]

    # ---- summaries --------------------------------------------------------------------------
    def phase_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(PHASES, 0)
        for op in self.ops:
            counts[op.phase] += 1
        return counts

    def saved_bytes(self) -> int:
        storages = {t.storage_id for t in self.tensors if t.saved and not t.is_parameter}
        return sum(self.storages[s].nbytes for s in storages)

    def summary(self) -> str:
        curve = self.no_swap_memory_curve()
        phases = ", ".join(f"{k} {v}" for k, v in self.phase_counts().items() if v)
        lines = [
            f"iteration {self.iteration}: {len(self.ops)} ops ({phases}), {len(self.op_names)} distinct op names, "
            f"{len(self.tensors)} tensors over {len(self.storages)} storages, "
            f"{sum(t.saved for t in self.tensors)} saved for backward ({self.saved_bytes() / 2**20:.1f} MiB)",
            f"time {self.iteration_s * 1e3:.1f} ms; peak {max(curve, default=0) / 2**20:.1f} MiB without swap, "
            f"{max(self.memory_curve(), default=0) / 2**20:.1f} MiB measured; {len(self.swaps)} storages swapped"
            + (" (emulated)" if self.emulated else ""),
        ]
        for mb, peak, index in self.micro_batch_peaks(curve):
            lines.append(f"  micro-batch {mb}: peak {peak / 2**20:.1f} MiB at op {index} ({self.op_names[self.ops[index].name_id]})")
        return "\n".join(lines)

    # ---- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "iteration": self.iteration,
            "iteration_s": self.iteration_s,
            "start_live_bytes": self.start_live_bytes,
            "emulated": self.emulated,
            "op_names": self.op_names,
            "module_paths": self.module_paths,
            "layer_times_s": {str(k): v for k, v in self.layer_times_s.items()},
            "layer_backward_times_s": {str(k): v for k, v in self.layer_backward_times_s.items()},
            "saves": [list(save) for save in self.saves],
            "save_sites": list(self.save_sites),
            "inexact_ops": None if self.inexact_ops is None else list(self.inexact_ops),
            "ops": [dataclasses.astuple(op) for op in self.ops],
            "tensors": [dataclasses.astuple(t) for t in self.tensors],
            "storages": [dataclasses.astuple(s) for s in self.storages],
            "swaps": [dataclasses.astuple(s) for s in self.swaps],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepTrace":
        version = data.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(
                f"trace schema version {version!r} is not supported (this build reads {READABLE_SCHEMA_VERSIONS})"
            )
        return cls(
            iteration=data["iteration"],
            op_names=list(data["op_names"]),
            module_paths=list(data["module_paths"]),
            ops=[OpRecord(n, p, mb, m, layer, tuple(i), tuple(o), live) for n, p, mb, m, layer, i, o, live in data["ops"]],
            tensors=[TensorRecord(i, s, d, tuple(shape), n, bool(p), bool(sv)) for i, s, d, shape, n, p, sv in data["tensors"]],
            storages=[StorageRecord(*row) for row in data["storages"]],
            swaps=[SwapRecord(*row) for row in data["swaps"]],
            iteration_s=data["iteration_s"],
            start_live_bytes=data["start_live_bytes"],
            layer_times_s={int(k): v for k, v in data.get("layer_times_s", {}).items()},
            layer_backward_times_s={int(k): v for k, v in data.get("layer_backward_times_s", {}).items()},
            saves=[(int(t), int(i)) for t, i in data.get("saves", [])],
            save_sites=[str(site) for site in data.get("save_sites", [])],
            inexact_ops=None if data.get("inexact_ops") is None else [int(i) for i in data["inexact_ops"]],
            emulated=data["emulated"],
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), separators=(",", ":")))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "StepTrace":
        return cls.from_dict(json.loads(Path(path).read_text()))
