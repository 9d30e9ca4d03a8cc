"""Rank-side code of tests/test_moe_checkpoints.py: the MoE tutorial shape of
tests/moe_workers.py trained two steps, saved, and loaded by a fresh engine at another
expert-parallel size, world size or ZeRO stage that trains two steps more; a plain module
loading the consolidated weights; and the one-process reference of such a resumed run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import partita
from moe_workers import LR, SEED, Net, Reference, config, data
from partita.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from partita.compat.deepspeed.moe.utils import (
    split_params_into_different_moe_groups_for_optimizer,
)

K = 2  # top-2 gating everywhere (the gate is the same module at every ep size)
SAVED_WORLD = 4
STEPS = 4
SAVED_AT = 2
"""Steps trained before the save; the resumed run trains ``STEPS - SAVED_AT`` more."""
TAG = "saved"


def batches(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][rank]`` micro-batches of a run saved at SAVED_WORLD ranks and resumed at
    `world`: the first SAVED_AT steps at SAVED_WORLD, the rest at `world`."""
    return data(STEPS, SAVED_WORLD)[:SAVED_AT] + data(STEPS, world)[SAVED_AT:]


VARIANTS = ("split", "unsplit", "frozen")
"""How a run is set up: the tutorial's optimizer groups (experts apart); every parameter in one
group (the engine splits them); or split with every expert's last bias frozen at a value of
its global index (`freeze`)."""


def freeze(experts: Any, first: int = 0) -> list[torch.Tensor]:
    """Freezes the last bias of each expert module in `experts` (`first`: the global index of
    the first) at ``0.05 * (index + 1)``; returns those biases."""
    biases = []
    with torch.no_grad():
        for i, expert in enumerate(experts):
            bias = expert[2].bias
            bias.requires_grad_(False)
            bias.fill_(0.05 * (first + i + 1))
            biases.append(bias)
    return biases


def _engine(ep: int, stage: int, variant: str) -> Any:
    """An engine at `ep` and ZeRO `stage` of this spawn's world, set up as `variant` says."""
    torch.manual_seed(SEED)
    model = Net(ep, K)
    experts = model.moe.deepspeed_moe.experts.deepspeed_experts
    if variant == "frozen":  # frozen before initialize; valued once the ranks' places exist
        freeze(experts)
    groups: Any = [p for p in model.parameters() if p.requires_grad]
    if variant != "unsplit":
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": groups, "name": "parameters"}
        )
    engine, *_ = partita.initialize(model=model, model_parameters=groups,
                                    config=config(stage, 0.0, False))  # fmt: skip
    if variant == "frozen":
        freeze(experts, engine.dims.ep_ranks.index(engine.dims.rank) * len(experts))
    return engine


def _steps(engine: Any, steps: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[float]:
    losses = []
    for batch in steps:
        x, y = batch[engine.dims.rank]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def expert_weights(engine: Any) -> dict[str, list[float]]:
    """This rank's experts' full weights under their global state-dict names (module
    parameters, equal to the masters in fp32; gathered at stage 3, collective there)."""
    from partita.zero import GatheredParameters

    layer = engine.module.moe
    rank = engine.dims.ep_ranks.index(engine.dims.rank) if engine.dims.ep_ranks else 0
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts"
    out = {}
    for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
        g = rank * layer.num_local_experts + i
        with GatheredParameters(list(expert.parameters())):
            for name, p in expert.named_parameters():
                out[f"{prefix}.{g}.{name}"] = p.detach().reshape(-1).tolist()
    return out


def save(
    ep: int, stage: int, folder: str, variant: str, async_save: bool = False
) -> dict[str, Any]:
    """Trains SAVED_AT steps at `ep` x (4 / ep) and ZeRO `stage`, saves under `folder`
    (tag TAG; with `async_save` written while training goes on), trains on to STEPS: every
    step's loss and the experts' weights at the save."""
    engine = _engine(ep, stage, variant)
    steps = batches(SAVED_WORLD)
    losses = _steps(engine, steps[:SAVED_AT])
    engine.save_checkpoint(folder, tag=TAG, async_save=async_save)
    weights = expert_weights(engine)
    losses += _steps(engine, steps[SAVED_AT:])
    engine.destroy()
    return {"losses": losses, "weights": weights}


def resume(
    ep: int, stage: int, folder: str, variant: str, again: str | None = None
) -> dict[str, Any]:
    """A fresh engine at `ep` and `stage` (this spawn's world) loads `folder`, saves it
    again under `again` when given (a round trip), and trains the remaining steps: their
    losses and the experts' weights right after the load."""
    engine = _engine(ep, stage, variant)
    path, _ = engine.load_checkpoint(folder, tag=TAG)
    assert path is not None
    assert engine.global_steps == SAVED_AT
    weights = expert_weights(engine)
    if again is not None:
        engine.save_checkpoint(again, tag=TAG)
    losses = _steps(engine, batches(engine.dims.world_size)[SAVED_AT:])
    engine.destroy()
    return {"losses": losses, "weights": weights}


def plain(folder: str) -> dict[str, Any]:
    """A one-process module (every expert, no engine) loads the consolidated weights: its
    missing and unexpected keys and its loss on each saved rank's next micro-batch."""
    torch.manual_seed(SEED + 1)  # other weights than the saved ones
    model = Net(1, K)
    state = get_fp32_state_dict_from_zero_checkpoint(folder, tag=TAG)
    missing, unexpected = model.load_state_dict(state, strict=False)
    with torch.no_grad():
        losses = [model(x, y).item() for x, y in batches(SAVED_WORLD)[SAVED_AT]]
    return {"missing": list(missing), "unexpected": list(unexpected), "losses": losses}


def grid(case: str, **kwargs: Any) -> Any:
    """One case: ``save``, ``resume`` or ``plain``."""
    cases: dict[str, Callable[..., Any]] = {"save": save, "resume": resume, "plain": plain}
    return cases[case](**kwargs)


def reference(world: int, frozen: bool = False) -> list[list[float]]:
    """``[step][rank]`` losses of one process holding every expert that trains SAVED_AT steps
    on SAVED_WORLD micro-batches each and then the rest on `world` micro-batches each,
    stepping on the mean of a step's micro-batch losses (`moe_workers.reference`); `frozen`:
    with the experts' last biases frozen as the "frozen" variant's."""
    model = Reference(K, residual=False)
    if frozen:
        freeze(model.experts)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
    out = []
    for batch in batches(world):
        losses = [model(x, y) for x, y in batch]
        torch.stack(losses).mean().backward()
        for p in params:
            if p.grad is None:  # an expert no token reached steps on zeros (as the engine)
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        out.append([loss.item() for loss in losses])
    return out
