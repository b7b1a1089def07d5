"""The ``Policy``: what to do with each saved tensor, where to find it at run time, and what it predicts.

Eager tensors have no stable identity across iterations, so the policy lists every save of the traced
iteration by its site (micro-batch, layer, the op before the save, dtype and rank) and shape, and each
entry carries its save ordinal into those lists, the features it was traced with (the saving op's name
and position in the op sequence, the tensor's argument position, dtype, shape and bytes, its ordinal
among the saves of its layer), the trigger points (op indices) for swap-out, release and swap-in, and the
decision (see NOTE [Save-site matching] in executor/matching.py for how an entry is found again, and
which of those features decide). JSON round-trip with a schema version.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any, ClassVar

from chameleon_dist.units import format_bytes

POLICY_SCHEMA_VERSION = 1


class Decision(enum.StrEnum):
    """What happens to one saved tensor. String-valued: the Policy JSON keeps "keep"/"swap"/"recompute"."""

    KEEP = "keep"  # stays on the device
    SWAP = "swap"  # copied to the host after its last forward use, back before its first backward use
    RECOMPUTE = "recompute"  # dropped after its last forward use, rebuilt from its producer before backward


class Infeasibility(enum.StrEnum):
    """Why a policy's predicted peak stays above the budget (``Policy.reason`` says it in words)."""

    NO_SWAPPABLE_AT_PEAK = "no_swappable_at_peak"  # nothing saved for backward is waiting at the peak op
    SWAP_FLOOR_ABOVE_BUDGET = "swap_floor_above_budget"  # even every candidate off the device is not enough
    LINK_TOO_SLOW = "link_too_slow"  # instant copies would fit; the host link cannot move enough in time
    HOST_BUDGET = "host_budget"  # as LINK_TOO_SLOW, and host_memory_budget also kept candidates on the device


def save_key(dtype: str, shape) -> str:
    return f"{dtype}{list(shape)}"


NEITHER_INPUT_NOR_OUTPUT = -99
"""``PolicyEntry.arg_position`` of a saved tensor that is neither an input nor an output of the op counted
as its saver. Negative like the output positions (-1, -2, ...), but beyond any op's output count in
practice, so it reads as "neither" and not as the 99th output."""

# ``entry_fields`` names that older Policy files wrote, and the field each one is now
_RENAMED_ENTRY_FIELDS = {"first_use_at": "first_backward_use"}


@dataclasses.dataclass(slots=True)
class PolicyEntry:
    decision: Decision  # SWAP or RECOMPUTE (kept tensors have no entry)
    nbytes: int  # bytes of the storage leaving the device
    # matching features
    micro_batch: int
    layer: int  # logical-layer label of the saving op
    group: int  # logical-layer group index
    save_ordinal: int  # See NOTE [Save-site matching] in executor/matching.py
    layer_save_ordinal: int  # ordinal among the saved storages of its (micro-batch, layer)
    save_op_index: int  # ops seen when autograd saved it
    calling_op: str  # the op that saved it
    # its position among the calling op's inputs; -(k + 1): k-th output; NEITHER_INPUT_NOR_OUTPUT: neither
    arg_position: int
    dtype: str
    shape: tuple[int, ...]
    tensor_nbytes: int  # bytes of the saved view
    # triggers (op indices of the profiled iteration)
    swap_out_at: int  # issue the device-to-host copy at the end of this op
    last_forward_use: int
    release_at: int  # predicted earliest safe release (end of this op), -1: not released
    swap_in_at: int  # issue the host-to-device copy at the start of this op
    first_backward_use: int  # the op of its first backward use (files before the rename: "first_use_at")
    # predictions
    predicted_stall_s: float = 0.0
    recompute_s: float = 0.0


@dataclasses.dataclass
class LayerLoad:
    """Per logical layer (label), bytes each decision takes off the device and the copy seconds issued."""

    layer: int
    swap_bytes: int = 0
    recompute_bytes: int = 0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    compute_s: float = 0.0


@dataclasses.dataclass
class Policy:
    name: str
    budget_bytes: int
    feasible: bool
    predicted_peak_bytes: int
    no_swap_peak_bytes: int
    predicted_stall_s: float
    predicted_recompute_s: float
    predicted_iteration_s: float
    compute_s: float
    entries: list[PolicyEntry]
    layers: list[LayerLoad]
    num_ops: int
    trace_iteration: int
    settings: dict[str, Any]
    # "dtype[shape]" and the save site by save ordinal (KEEPs included). See NOTE [Save-site matching] in
    # executor/matching.py. Files written before sites existed have none (matched on save_keys alone).
    save_keys: list[str] = dataclasses.field(default_factory=list)
    save_sites: list[str] = dataclasses.field(default_factory=list)
    host_kept_bytes: int = 0  # candidates left on the device because of host_budget_bytes
    reason: str = ""  # why it does not fit, in words (empty when it fits)
    infeasibility: Infeasibility | None = None  # why it does not fit, for code to branch on (None: it fits)
    emulated: bool = True
    # the file format this build writes and reads: a constant of the class, not a per-policy value (``from_dict``
    # refuses any other), written after the fields as before
    schema_version: ClassVar[int] = POLICY_SCHEMA_VERSION

    @property
    def shortfall_bytes(self) -> int:
        """How far the predicted peak is above the budget (0 when it fits)."""
        return max(0, self.predicted_peak_bytes - self.budget_bytes)

    def saved_bytes(self, decision: Decision) -> int:
        return sum(e.nbytes for e in self.entries if e.decision == decision)

    # ---- summary ----------------------------------------------------------------------------
    def summary(self) -> str:
        verdict = "fits" if self.feasible else f"DOES NOT FIT (short by {format_bytes(self.shortfall_bytes)})"
        lines = [
            f"policy {self.name}: {verdict}; predicted peak {format_bytes(self.predicted_peak_bytes)} vs budget "
            f"{format_bytes(self.budget_bytes)} (no-swap peak {format_bytes(self.no_swap_peak_bytes)})"
            + (" (emulated trace)" if self.emulated else ""),
            f"  time {self.predicted_iteration_s * 1e3:.2f} ms predicted = compute {self.compute_s * 1e3:.2f} ms "
            f"+ stall {self.predicted_stall_s * 1e3:.2f} ms + recompute {self.predicted_recompute_s * 1e3:.2f} ms",
            f"  swap {sum(e.decision == Decision.SWAP for e in self.entries)} tensors "
            f"({format_bytes(self.saved_bytes(Decision.SWAP))}), "
            f"recompute {sum(e.decision == Decision.RECOMPUTE for e in self.entries)} "
            f"tensors ({format_bytes(self.saved_bytes(Decision.RECOMPUTE))})"
            + (f"; kept for the host budget: {format_bytes(self.host_kept_bytes)}" if self.host_kept_bytes else ""),
        ]
        if self.reason:
            lines.append(f"  {self.reason}")
        if self.layers:
            lines.append("  layer  swapped     recomputed  d2h ms   h2d ms   compute ms")
            for load in self.layers:
                if load.swap_bytes or load.recompute_bytes:
                    lines.append(
                        f"  {load.layer:5d}  {format_bytes(load.swap_bytes):>10}  {format_bytes(load.recompute_bytes):>10}  "
                        f"{load.d2h_s * 1e3:7.2f}  {load.h2d_s * 1e3:7.2f}  {load.compute_s * 1e3:9.2f}"
                    )
        return "\n".join(lines)

    # ---- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("entries", "layers")}
        data["schema_version"] = self.schema_version
        data["entry_fields"] = [f.name for f in dataclasses.fields(PolicyEntry)]
        data["entries"] = [[getattr(e, f) for f in data["entry_fields"]] for e in self.entries]
        data["layers"] = [dataclasses.astuple(load) for load in self.layers]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Policy":
        version = data.get("schema_version")
        if version != POLICY_SCHEMA_VERSION:
            raise ValueError(f"policy schema version {version!r} is not supported (this build reads {POLICY_SCHEMA_VERSION})")
        fields = [_RENAMED_ENTRY_FIELDS.get(name, name) for name in data["entry_fields"]]
        entries = []
        for row in data["entries"]:
            values = dict(zip(fields, row))
            values["decision"] = Decision(values["decision"])
            values["shape"] = tuple(values["shape"])
            entries.append(PolicyEntry(**values))
        kwargs = {k: v for k, v in data.items() if k not in ("entries", "layers", "entry_fields", "schema_version")}
        if kwargs.get("infeasibility") is not None:
            kwargs["infeasibility"] = Infeasibility(kwargs["infeasibility"])
        return cls(entries=entries, layers=[LayerLoad(*row) for row in data["layers"]], **kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Policy":
        return cls.from_dict(json.loads(Path(path).read_text()))
