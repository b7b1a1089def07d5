"""PNG plot of device memory over one iteration, with and without swapping (emulated device)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Curve:
    label: str  # the legend entry
    samples_bytes: list[int]  # live device bytes after each op of the model
    linestyle: str = "-"


def plot_memory(path: Path, curves: list[Curve], capacity_bytes: int, title: str) -> Path:
    """Live device bytes after every op of the model in one iteration, one line per curve, capacity as a
    dashed line. The x axis counts the model's own ops, so runs with and without swapping line up."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    for curve in curves:
        if curve.samples_bytes:
            ax.plot(
                range(len(curve.samples_bytes)), [b / MiB for b in curve.samples_bytes],
                label=curve.label, linewidth=1.2 if curve.linestyle == "-" else 0.9, linestyle=curve.linestyle,
            )
    ax.axhline(capacity_bytes / MiB, color="crimson", linestyle="--", linewidth=1, label="device capacity")
    ax.set_xlabel("op of the model within the iteration (Chameleon's own copies are not counted)")
    ax.set_ylabel("live device memory (MiB, emulated)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, frameon=False)  # below: hides no curve
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
