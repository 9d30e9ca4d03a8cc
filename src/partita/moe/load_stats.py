"""How evenly each MoE layer spread its tokens over its experts, per optimizer step.

[Note: expert load statistics]
Every MoE layer's training forward adds what it routed into its layer's tally (`record`): the
routes each expert was chosen for (before capacity drops), the routes kept, and the gate's
auxiliary loss where the layer has one (DeepSpeed-MoE layers; Hugging Face models compute
theirs in the model, outside the experts module). Recomputations under activation
checkpointing run inside the backward and are not counted again, nor are evaluation forwards.
At each optimizer step the engine (`step_figures`) sums the tallies over the ranks that hold
the same layers (its gradient group: different tokens, same experts), clears them, and reports
per layer, in the layer's module name:

- ``routes``: the (token, choice) routes the layer's gate made, over every rank;
- ``imbalance``: the busiest expert's routes over the mean (1 when balanced, E when one expert
  takes every route): the step's load skew, what capacity factors and aux losses fight;
- ``dropped``: the share of routes dropped by the capacity bound (0 when dropless);
- ``l_aux``: the auxiliary loss, averaged over the forwards (absent without one).

The monitor writes them as ``Train/MoE/<layer>/<figure>`` events at the step's sample count,
and `Engine.moe_load_stats` returns the last step's. Summing costs one all-reduce of a few
numbers per layer, made only while the monitor is enabled or the figures were asked for.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from partita import comm

EVENT_PREFIX = "Train/MoE"
"""Monitor event names: ``Train/MoE/<layer>/routes``, ``.../imbalance``, ``.../dropped``,
``.../l_aux``."""


_STATS = 4
"""A tally row after its E counts: routes kept, aux loss sum, forwards, forwards with an aux."""
_TALLIES: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()
"""Each layer's tally since the last step: one float64 row on the layer's device (adding to it
never waits for the device; the step reads every row at once)."""
_LAYERS: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, nn.Module]]] = (
    weakref.WeakKeyDictionary()
)
"""Each model's MoE layers, found once (not by walking its modules every step)."""


def _in_backward() -> bool:
    """True while autograd runs a backward (a checkpointed forward being recomputed)."""
    return bool(torch._C._current_graph_task_id() != -1)


@torch.no_grad()
def record(
    layer: nn.Module, counts: torch.Tensor, kept: torch.Tensor | int, aux: torch.Tensor | None
) -> None:
    """Adds one training forward of `layer` to its tally: `counts` [E] routes per expert,
    `kept` routes not dropped, `aux` the gate's auxiliary loss (None without one)."""
    if not layer.training or _in_backward():
        return
    counts = counts.detach().reshape(-1)
    row = _TALLIES.get(layer)
    if row is None or row.numel() != counts.numel() + _STATS:
        row = _TALLIES[layer] = counts.new_zeros(counts.numel() + _STATS, dtype=torch.float64)
    row[: counts.numel()] += counts
    row[-4] += kept
    row[-2] += 1
    if aux is not None:
        row[-3] += aux.detach().reshape(())
        row[-1] += 1


def _layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE layers of `module` that keep tallies, with their module names, in order."""
    found = _LAYERS.get(module)
    if found is None:
        found = _LAYERS[module] = [
            (name or "model", m) for name, m in module.named_modules() if _is_moe_layer(m)
        ]
    return found


def _is_moe_layer(m: nn.Module) -> bool:
    from partita.moe.hf_experts import _SHARDS
    from partita.moe.layer import MOELayer

    return isinstance(m, MOELayer) or m in _SHARDS


def step_figures(module: nn.Module, group: comm.ProcessGroup | None) -> dict[str, dict[str, float]]:
    """Every MoE layer's figures for the step (see the note), summed over `group`; the
    tallies start again. A collective over `group` when `module` has MoE layers: every rank
    of it must call this at the same step."""
    layers = _layers(module)
    if not layers:
        return {}
    rows = []
    for _, layer in layers:
        row = _TALLIES.pop(layer, None)
        if row is None:
            device = next(layer.parameters()).device
            row = torch.zeros(_num_experts(layer) + _STATS, dtype=torch.float64, device=device)
        rows.append(row)
    flat = torch.cat(rows)
    comm.all_reduce(flat, group=group, tag="moe_stats")
    flat = flat.cpu()  # the step's one read of the tallies
    out, at = {}, 0
    for (name, _), row in zip(layers, rows, strict=True):
        part = flat[at : at + row.numel()]
        at += row.numel()
        out[name] = _figures(part[:-_STATS], *part[-_STATS:].tolist())
    return out


def _num_experts(layer: nn.Module) -> int:
    from partita.moe.hf_experts import _SHARDS

    if layer in _SHARDS:
        return _SHARDS[layer].num_experts
    return int(layer.gate.wg.weight.shape[0])  # type: ignore[union-attr,index]


def _figures(
    counts: torch.Tensor, kept: float, aux: float, forwards: float, aux_forwards: float
) -> dict[str, float]:
    routes = float(counts.sum())
    if forwards == 0 or routes == 0:
        return {}
    out = {
        "routes": routes,
        "imbalance": float(counts.max()) / (routes / counts.numel()),
        "dropped": 1.0 - kept / routes,
    }
    if aux_forwards:
        out["l_aux"] = aux / aux_forwards
    return out


def clear(module: nn.Module) -> None:
    """Drops the tallies of `module`'s MoE layers (a step whose figures nobody reads)."""
    for _, layer in _layers(module):
        _TALLIES.pop(layer, None)


def events(figures: dict[str, dict[str, float]], step: int) -> list[tuple[str, float, int]]:
    """`step_figures` as monitor events ``Train/MoE/<layer>/<figure>``."""
    return [
        (f"{EVENT_PREFIX}/{layer}/{key}", value, step)
        for layer, values in figures.items()
        for key, value in values.items()
    ]


__all__ = ["EVENT_PREFIX", "clear", "events", "record", "step_figures"]
