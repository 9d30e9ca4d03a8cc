"""Stacked bars of each configuration's per-rank memory (matplotlib, an optional extra:
``pip install partita[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence

from partita.estimate.memory import Estimate
from partita.estimate.units import EstimateError

__all__ = ["plot_estimates"]


def plot_estimates(estimates: Sequence[Estimate], path: str) -> None:
    """Writes a PNG with one stacked bar per configuration for device (per rank) and host (per
    node) memory, one colour per item, and the memory limits as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EstimateError(
            "--plot needs matplotlib: pip install 'partita[plot]' (or matplotlib)"
        ) from None
    names = list(dict.fromkeys(i.name for e in estimates for i in e.items))
    # One colour per item in both panels (more items than the default cycle's ten).
    palette = matplotlib.colormaps["tab20"]
    colours = {name: palette(k % 20) for k, name in enumerate(names)}
    labels = [e.candidate.label for e in estimates]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(estimates) + 4), 5))
    hw = estimates[0].hardware if estimates else None
    for ax, where, limit in (
        (axes[0], "device", hw.device_memory if hw else None),
        (axes[1], "host", hw.host_memory if hw else None),
    ):
        bottoms = [0.0] * len(estimates)
        scale = 1 if where == "device" else (hw.devices_per_node if hw else 1)
        for name in names:
            heights = [
                sum(getattr(i, where) for i in e.items if i.name == name) * scale / 1e9
                for e in estimates
            ]
            if any(heights):
                ax.bar(labels, heights, bottom=bottoms, label=name, color=colours[name])
                bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        if limit:
            ax.axhline(limit / 1e9, color="black", linestyle="--", linewidth=1)
        ax.set_title(f"{where} memory ({'per rank' if where == 'device' else 'per node'})")
        ax.set_ylabel("GB")
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right")
    axes[0].legend(fontsize="small")
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
