"""The FLOPs profiler's printed report: summary, top modules per depth, module tree."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from partita.profiling.units import duration_to_string, number_to_string

if TYPE_CHECKING:
    from partita.profiling.flops import FlopsProfiler

__all__ = ["ModuleProfile", "write_profile"]

_LINE = "{:<60}  {:<8}"


@dataclass(frozen=True)
class ModuleProfile:
    """One module's forward profile.

    Attributes:
        name: dotted name in ``model.named_modules()`` ("" for the model itself).
        kind: the module's class name.
        flops: forward FLOPs inside the module (its children included).
        macs: multiply-accumulates (flops / 2: only sum-of-product ops are counted).
        params: trainable parameters of the module and its children.
        duration: seconds spent in its forward, summed over calls.
        calls: forward calls seen.
        ignored: its type was in the profiler's ignore list.
    """

    name: str
    kind: str
    flops: int
    macs: int
    params: int
    duration: float
    calls: int
    ignored: bool = False

    @property
    def depth(self) -> int:
        """0 for the model, 1 for its children, ..."""
        return 0 if not self.name else self.name.count(".") + 1


def _summary(out: IO[str], prof: FlopsProfiler, profile_step: int) -> None:
    flops, macs = int(prof.get_total_flops()), int(prof.get_total_macs())
    params, seconds = int(prof.get_total_params()), float(prof.get_total_duration())
    out.write("\n-------------------------- partita FLOPs profiler --------------------------\n")
    out.write(f"Profile summary at step {profile_step}:\n")
    engine = prof.ds_engine
    if engine is not None:
        out.write(_LINE.format("world size: ", engine.world_size) + "\n")
        out.write(_LINE.format("data parallel size: ", engine.dp_world_size) + "\n")
        out.write(
            _LINE.format("batch size per GPU: ", engine.train_micro_batch_size_per_gpu()) + "\n"
        )
    out.write(_LINE.format("params per GPU: ", number_to_string(params)) + "\n")
    out.write(_LINE.format("fwd MACs per GPU: ", number_to_string(macs, "MACs")) + "\n")
    out.write(_LINE.format("fwd flops per GPU: ", number_to_string(flops)) + "\n")
    out.write(_LINE.format("fwd latency: ", duration_to_string(seconds)) + "\n")
    rate = flops / seconds if seconds else 0.0
    out.write(_LINE.format("fwd FLOPS per GPU = fwd flops / fwd latency: ",
                           number_to_string(rate, "FLOPS")) + "\n")  # fmt: skip
    peak, mfu = prof.get_peak_flops(), prof.get_mfu()
    peak_text = number_to_string(peak, "FLOPS") if peak else "unknown (pass peak_flops=)"
    out.write(_LINE.format("device peak: ", peak_text) + "\n")
    out.write(_LINE.format("fwd MFU: ", "unknown" if mfu is None else f"{mfu:.2%}") + "\n")
    if prof.recompute_fwd_factor:
        out.write(_LINE.format("recompute fwd factor: ", prof.recompute_fwd_factor) + "\n")


def _top_per_depth(
    out: IO[str], profiles: dict[str, ModuleProfile], module_depth: int, top_modules: int
) -> None:
    depths = sorted({p.depth for p in profiles.values()})
    if module_depth >= 0:
        depths = [d for d in depths if d <= module_depth]
    out.write("\n----------------------------- Aggregated profile -----------------------------\n")
    out.write(f"Top {top_modules} modules in params, MACs and fwd latency at each depth:\n")
    for depth in depths:
        # Modules of one class at one depth are summed, as DeepSpeed's aggregated view does.
        by_kind: dict[str, list[float]] = {}
        for p in profiles.values():
            if p.depth == depth:
                row = by_kind.setdefault(p.kind, [0.0, 0.0, 0.0])
                row[0] += p.params
                row[1] += p.macs
                row[2] += p.duration

        out.write(f"depth {depth}:\n")
        out.write(f"    params      - {_top(by_kind, 0, top_modules, number_to_string)}\n")
        macs = _top(by_kind, 1, top_modules, lambda v: number_to_string(v, "MACs"))
        out.write(f"    MACs        - {macs}\n")
        out.write(f"    fwd latency - {_top(by_kind, 2, top_modules, duration_to_string)}\n")


def _top(
    by_kind: dict[str, list[float]], column: int, count: int, fmt: Callable[[float], str]
) -> str:
    rows = sorted(by_kind.items(), key=lambda kv: kv[1][column], reverse=True)[:count]
    return str({kind: fmt(values[column]) for kind, values in rows})


def _tree(out: IO[str], profiles: dict[str, ModuleProfile], module_depth: int) -> None:
    root = profiles[""]
    out.write("\n------------------------------ Detailed profile ------------------------------\n")
    out.write("Each module: params, MACs, fwd latency (with % of the model's) and FLOPS.\n")
    for p in profiles.values():
        if module_depth >= 0 and p.depth > module_depth:
            continue
        parts = [
            f"{number_to_string(p.params)} = {_share(p.params, root.params)} Params",
            f"{number_to_string(p.macs, 'MACs')} = {_share(p.macs, root.macs)} MACs",
            f"{duration_to_string(p.duration)} = {_share(p.duration, root.duration)} latency",
            number_to_string(p.flops / p.duration if p.duration else 0.0, "FLOPS"),
        ]
        label = p.name.rsplit(".", 1)[-1] or "(model)"
        out.write(f"{'  ' * p.depth}({label}): {p.kind}({', '.join(parts)})\n")


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"


def write_profile(
    out: IO[str],
    prof: FlopsProfiler,
    profile_step: int,
    module_depth: int,
    top_modules: int,
    detailed: bool,
) -> None:
    """Writes `prof`'s report to `out` (see `FlopsProfiler.print_model_profile`)."""
    _summary(out, prof, profile_step)
    profiles = prof.module_profiles()
    _top_per_depth(out, profiles, module_depth, top_modules)
    if detailed:
        _tree(out, profiles, module_depth)
    out.write("------------------------------------------------------------------------------\n")
