"""A rank's memory over a training run: `engine.memory_report()` recorded each step, drawn at
the end as stacked areas (matplotlib, the ``plot`` extra).

    timeline = MemoryTimeline(engine)
    for batch in loader:
        engine.backward(engine(batch)); engine.step()
        timeline.record()
    timeline.plot(f"memory-rank{engine.global_rank}.png")
"""

from __future__ import annotations

from typing import Any, Protocol

from partita.estimate.units import EstimateError

__all__ = ["MemoryTimeline"]

_STACKED = ("params", "grads", "master_params", "optimizer_state", "comm_buffers")


class _Reports(Protocol):
    def memory_report(self) -> dict[str, int]: ...


class MemoryTimeline:
    """Collects one memory report per `record` call (a step) for one rank."""

    def __init__(self, engine: _Reports) -> None:
        self.engine = engine
        self.reports: list[dict[str, int]] = []

    def record(self) -> dict[str, int]:
        """Appends and returns the engine's current memory report."""
        report = dict(self.engine.memory_report())
        self.reports.append(report)
        return report

    def plot(self, path: str, title: str | None = None) -> None:
        """Writes the model-state categories as stacked areas per step, with the device peak
        and the process's peak RSS as lines."""
        if not self.reports:
            raise EstimateError(f"no steps recorded for {path!r}: call record() after each step")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise EstimateError(
                "plotting needs matplotlib: pip install 'partita[plot]' (or matplotlib)"
            ) from None
        steps = list(range(1, len(self.reports) + 1))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        series = [[r.get(k, 0) / 2**20 for r in self.reports] for k in _STACKED]
        ax.stackplot(steps, *series, labels=list(_STACKED))
        for key, style in (("device_peak", "--"), ("peak_rss", ":")):
            values: list[Any] = [r.get(key, 0) / 2**20 for r in self.reports]
            if any(values):
                ax.plot(steps, values, style, color="black", label=key)
        ax.set_xlabel("step")
        ax.set_ylabel("MiB")
        ax.set_title(title or "memory per step (this rank)")
        ax.legend(fontsize="small", loc="upper left")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
