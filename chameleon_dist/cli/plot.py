"""PNG plot of device memory over one iteration, with and without swapping (emulated device)."""

from __future__ import annotations

from pathlib import Path

MiB = 2**20


def plot_memory(path: Path, curves: dict[str, list[int]], capacity_bytes: int, title: str) -> Path:
    """Live device bytes after every op of one iteration, one line per run, capacity as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for label, samples in curves.items():
        if samples:
            ax.plot(range(len(samples)), [b / MiB for b in samples], label=label, linewidth=1.2)
    ax.axhline(capacity_bytes / MiB, color="crimson", linestyle="--", linewidth=1, label="device capacity")
    ax.set_xlabel("aten op within the iteration")
    ax.set_ylabel("live device memory (MiB, emulated)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
