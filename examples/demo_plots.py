"""The demo's two pictures: the loss curve and each rank's memory (matplotlib, Agg backend).

Rank 0 calls these with what it gathered from every rank; nothing here is a collective and
nothing needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

if TYPE_CHECKING:
    from matplotlib.axes import Axes

matplotlib.use("Agg")  # files only: no display on a training machine, and no Tk/Qt import

__all__ = ["PROCESS_KEYS", "write_loss_curve", "write_memory_picture"]

MIB = 1024 * 1024
# memory_report() keys that describe the whole process rather than the engine's own tensors:
# drawn in the right-hand panel, on their own scale (hundreds of MiB against a few).
PROCESS_KEYS = ("rss", "peak_rss")


def write_loss_curve(losses: Sequence[Sequence[float]], path: Path, title: str) -> None:
    """Write a PNG of the training loss against the optimizer step: each rank's loss (on its
    own micro-batches) thin, their mean bold, and the loss of a uniform guess for reference.

    ``losses[r][s]`` is rank ``r``'s loss at step ``s + 1`` (mean over its micro-steps)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = range(1, len(losses[0]) + 1) if losses else range(0)
    # Markers only when there are few points: a 3-step run must still show something.
    marker = "o" if len(steps) <= 30 else None
    if len(losses) > 1:
        for rank, series in enumerate(losses):
            ax.plot(steps, series, linewidth=0.8, alpha=0.5, marker=marker, markersize=3,
                    label=f"rank {rank}")  # fmt: skip
    mean = [sum(col) / len(col) for col in zip(*losses, strict=True)]
    ax.plot(steps, mean, linewidth=2, color="black", marker=marker, markersize=4,
            label="mean over ranks" if len(losses) > 1 else "rank 0")  # fmt: skip
    # Bytes are the tokens: a model that knows nothing scores ln(256) nats per byte.
    ax.axhline(math.log(256), color="grey", linestyle="--", linewidth=1,
               label="uniform guess, ln 256 = 5.55")  # fmt: skip
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 2.5
    ax.set_ylabel("training loss (cross-entropy, nats per byte)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_memory_picture(
    reports: Sequence[Mapping[str, int]], peak_rss: Sequence[int], path: Path, title: str
) -> None:
    """Write a PNG of each rank's memory in MiB: left, one bar per ``engine.memory_report()``
    item for every rank (items at zero on every rank are named in a note instead of drawn);
    right, each rank's peak resident set size (the whole process: Python, torch, the model).

    ``reports`` may be empty dicts (a backend without ``memory_report``); ``peak_rss`` is in
    bytes, one per rank."""
    import matplotlib.pyplot as plt

    n_ranks = len(peak_rss)
    keys = [k for k in reports[0] if k not in PROCESS_KEYS] if reports and reports[0] else []
    shown = [k for k in keys if any(r.get(k, 0) for r in reports)]
    zero = [k for k in keys if k not in shown]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": [3, 1]})
    _engine_bars(left, reports, shown, n_ranks)
    notes = []
    if zero:
        notes.append("0 on every rank: " + ", ".join(zero))
    if not keys:
        notes.append("this backend has no engine.memory_report()")
    if notes:
        left.text(0.01, -0.14, "; ".join(notes), transform=left.transAxes, fontsize="small",
                  va="top")  # fmt: skip
    ranks = [f"rank {r}" for r in range(n_ranks)]
    bars = right.bar(ranks, [b / MIB for b in peak_rss], color="tab:grey")
    right.bar_label(bars, fmt="%.0f", fontsize="small")
    right.set_title("peak RSS (whole process)")
    right.set_ylabel("MiB")
    right.margins(y=0.12)  # room for the labels above the bars
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _engine_bars(ax: Axes, reports: Sequence[Mapping[str, int]], keys: list[str],
                 n_ranks: int) -> None:  # fmt: skip
    """Grouped bars on ``ax``: a group per rank, a bar (and colour) per memory item."""
    width = 0.8 / max(1, len(keys))
    for k, key in enumerate(keys):
        xs = [r + (k - (len(keys) - 1) / 2) * width for r in range(n_ranks)]
        bars = ax.bar(xs, [rep.get(key, 0) / MIB for rep in reports], width, label=key)
        ax.bar_label(bars, fmt="%.1f", fontsize="x-small")
    ax.set_xticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_title("engine.memory_report() per rank")
    ax.set_ylabel("MiB")
    # Headroom above the bars for the legend: over them it would hide the shorter ones.
    ax.margins(y=0.35 if len(keys) > 3 else 0.2)
    if keys:
        ax.legend(fontsize="small", loc="upper center", ncols=min(len(keys), 4))
