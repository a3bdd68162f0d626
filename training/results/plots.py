"""Figures in one style for the comparison report and the run's own plots (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path


def figure(width: float, height: float, ncols: int = 1):
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, height))


def save(fig, path: Path, axes=(), grid: str = "both") -> bool:
    """Grid and legend on ``axes``, then lay out, write and release the figure (True: a file was written)."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(axis=grid, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
