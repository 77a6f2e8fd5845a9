"""A picture of a step's memory: live bytes by class over the graph's positions, one panel per graph given (the
step before and after ``memory_plan``, say), written beside the dumps. Needs matplotlib (the ``bench`` extra)."""

from __future__ import annotations

import logging

import numpy as np

from zerofx.memory.lifetimes import Lifetime

log = logging.getLogger("zerofx")


def live_by_category(spans: list[Lifetime], length: int) -> dict[str, np.ndarray]:
    """Bytes alive at each position, per class, largest class first."""
    out: dict[str, np.ndarray] = {}
    for s in spans:
        delta = out.setdefault(s.category, np.zeros(length + 1, dtype=np.int64))
        delta[s.start] += s.nbytes
        delta[min(s.end, length)] -= s.nbytes
    curves = {name: np.cumsum(delta)[:length] for name, delta in out.items()}
    return dict(sorted(curves.items(), key=lambda item: -item[1].max()))


def write(path: str, panels: dict[str, tuple[list[Lifetime], int]]) -> bool:
    """One stacked-area panel per entry ``title -> (lifetimes, graph length)``; False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("zerofx: no memory timeline in the dump (pip install matplotlib)")
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (title, (spans, length)) in zip(axes[:, 0], panels.items()):
        curves = live_by_category(spans, length)
        ax.stackplot(np.arange(length), *[c / 2**20 for c in curves.values()], labels=list(curves), step="post")
        ax.set_title(title)
        ax.set_ylabel("MiB alive")
        ax.legend(loc="upper left", fontsize="small", ncol=3)
    axes[-1, 0].set_xlabel("graph position")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
