"""A parallel layout (TP, CP, PP, DP, VPP, EP, micro-batch size, recompute, swap) and its pipeline schedule.

Schedules follow Megatron-core: non-interleaved 1F1B (stage ``i`` of ``p`` runs ``p - i - 1`` warm-up
forwards, then alternates one forward and one backward, then drains), and the interleaved schedule with
``v`` model chunks per stage (warm-up ``2 (p - i - 1) + (v - 1) p`` chunk forwards; the forward order
visits chunk ``(k mod p v) // p`` of micro-batch ``(k // p v) p + k mod p``; backward chunks in reverse).
Under both, the first stage holds the most micro-batches in flight: ``p`` under 1F1B (Korthikanti et al.,
arXiv 2205.05198), ``p v + p - 1`` chunks (``1 + (p - 1) / (p v)`` of the model's layers) interleaved.
"""

from __future__ import annotations

import dataclasses
import enum


class RecomputeMode(enum.StrEnum):
    """How much of a layer's activations backward rebuilds instead of keeping. String-valued, so a layout
    compares equal to (and accepts) the plain words, and JSON, tables and the CLI keep showing them."""

    NONE = "none"  # every activation kept from forward to backward
    SELECTIVE = "selective"  # the attention core rebuilt (Korthikanti et al.)
    BLOCK = "block"  # the first ``recompute_layers`` layers of every chunk rebuilt from their input
    FULL = "full"  # every layer rebuilt from its input


RECOMPUTE_MODES = tuple(mode.value for mode in RecomputeMode)  # the words, in search order
FORWARD_STEP, BACKWARD_STEP = "F", "B"


_RECOMPUTE_LABELS = {RecomputeMode.NONE: "no-recompute", RecomputeMode.SELECTIVE: "selective-recompute",
                     RecomputeMode.FULL: "full-recompute"}


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1  # model chunks per pipeline stage (interleaved schedule when > 1)
    micro_batch: int = 1
    ep: int = 1  # expert parallelism (MoE), inside the data-parallel group
    recompute: RecomputeMode = RecomputeMode.NONE  # a RecomputeMode or its word
    recompute_layers: int = 0  # with BLOCK: layers of every chunk rebuilt
    swap: bool = False
    # Whether the pipeline's first stage holds the embedding and its last stage the final norm, output layer
    # and loss (Megatron's pre_process / post_process). Off only to price a slice of a larger pipeline,
    # e.g. a middle stage's layers alone on one device (``single_device``); the search keeps both on.
    pre_process: bool = True
    post_process: bool = True
    # Context parallelism (Megatron's context_parallel_size): each of ``cp`` ranks holds ``seq / cp`` tokens
    # of every activation; ranks are ordered TP, CP, DP, PP (Megatron's default "tp-cp-ep-dp-pp"). Last, so
    # that positional constructions keep their meaning.
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp", "micro_batch", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
        object.__setattr__(self, "recompute", RecomputeMode(self.recompute))  # frozen: normalise the word once
        if self.dp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide dp ({self.dp})")
        if (self.recompute == RecomputeMode.BLOCK) != (self.recompute_layers > 0):
            raise ValueError("recompute_layers (> 0) goes with recompute='block' only")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together (Megatron's dp_cp group)."""
        return self.dp * self.cp

    def holds_embedding(self, stage: int) -> bool:
        return stage == 0 and self.pre_process

    def holds_head(self, stage: int) -> bool:
        """The final norm, output layer and loss run on ``stage``."""
        return stage == self.pp - 1 and self.post_process

    def recomputed_layers(self, layers_per_chunk: int) -> int:
        """Layers of each model chunk rebuilt from their input in backward."""
        if self.recompute == RecomputeMode.FULL:
            return layers_per_chunk
        if self.recompute == RecomputeMode.BLOCK:
            return min(self.recompute_layers, layers_per_chunk)
        return 0

    def num_micro_batches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.dp * self.micro_batch)

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}"]
        if self.cp > 1:
            parts.insert(1, f"CP{self.cp}")
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        parts.append(f"mb{self.micro_batch}")
        if self.recompute == RecomputeMode.BLOCK:
            parts.append(f"recompute-{self.recompute_layers}-layers")
        else:
            parts.append(_RECOMPUTE_LABELS[self.recompute])
        if self.swap:
            parts.append("swap")
        if not self.pre_process:
            parts.append("no-embedding")
        if not self.post_process:
            parts.append("no-head")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def warmup_steps(stage: int, pp: int, vpp: int, num_micro_batches: int) -> int:
    """Chunk forwards a stage runs before its first backward."""
    total = num_micro_batches * vpp
    if vpp == 1:
        return min(pp - stage - 1, total)
    return min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)


def in_flight_chunks(stage: int, pp: int, vpp: int, num_micro_batches: int) -> int:
    """Most (micro-batch, chunk) forwards whose backward has not run yet, at any time on ``stage``."""
    return min(warmup_steps(stage, pp, vpp, num_micro_batches) + 1, num_micro_batches * vpp)


def _chunk_of(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of the ``k``-th forward (or backward) chunk step of the interleaved schedule."""
    group = k % (pp * vpp)
    chunk = group // pp
    micro_batch = (k // (pp * vpp)) * pp + k % pp
    return micro_batch, chunk if forward else vpp - 1 - chunk


def schedule(stage: int, pp: int, vpp: int, num_micro_batches: int) -> list[tuple[str, int, int]]:
    """The order of ``(F|B, micro_batch, chunk)`` steps one stage runs in one iteration."""
    if vpp > 1 and num_micro_batches % pp:
        raise ValueError(f"the interleaved schedule needs the micro-batch count ({num_micro_batches}) to be a "
                         f"multiple of pp ({pp}); change global_batch_size or micro_batch")
    total = num_micro_batches * vpp
    warmup = warmup_steps(stage, pp, vpp, num_micro_batches)

    def step(kind: str, k: int) -> tuple[str, int, int]:
        if vpp == 1:
            return kind, k, 0
        return (kind, *_chunk_of(k, pp, vpp, kind == FORWARD_STEP))

    steps = [step(FORWARD_STEP, k) for k in range(warmup)]
    for j in range(total - warmup):
        steps.append(step(FORWARD_STEP, warmup + j))
        steps.append(step(BACKWARD_STEP, j))
    steps.extend(step(BACKWARD_STEP, k) for k in range(total - warmup, total))
    return steps
