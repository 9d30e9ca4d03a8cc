"""Rank-side code of tests/test_tp_checkpoints.py: checkpoints of tensor-parallel training
loaded at another tensor degree, and into `partita.init_inference`.

The models are tests/tp_training_workers.py's tiny Llama (grouped key/value heads, an untied
head split by vocabulary) and GPT-2 (a fused [q | k | v] Conv1D split per head, Megatron's
stride 3; a tied head). Every step trains the same global batch of `GLOBAL` rows whatever the
data-parallel size, so a run that changes its tensor degree at the checkpoint continues the
one-process run on the whole batch (`reference`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import partita
from tp_training_workers import CLIP, LR, SEQ, VOCAB, build_model

GLOBAL = 4
"""Rows of each step's global batch (the micro-batch is ``GLOBAL / dp``)."""
STEPS = 4
SAVED_AFTER = 2
"""Steps trained before the checkpoint; the rest are trained by the engine that loads it."""


def batches() -> list[torch.Tensor]:
    """The global batch of each step."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=gen) for _ in range(STEPS)]


def probe() -> torch.Tensor:
    """The tokens whose logits the inference cases compare."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))


FROZEN = "model.layers.0.mlp.down_proj.weight"
"""A split (row-parallel) weight the `frozen` cases do not train: saved as a module tensor per
slice, re-cut at the loading degree like the rest."""


def _freeze(model: nn.Module, frozen: bool) -> nn.Module:
    if frozen:
        model.get_parameter(FROZEN).requires_grad_(False)
    return model


def reference(kind: str, frozen: bool = False) -> dict[str, Any]:
    """One process, the whole model and batch, AdamW and clip_grad_norm_ from torch: the
    per-step losses and gradient norms before clipping, and the logits of `probe` after
    `SAVED_AFTER` steps (the checkpoint's state). With `frozen`, `FROZEN` is not trained."""
    model = _freeze(build_model(kind), frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    losses: list[float] = []
    norms: list[float] = []
    logits = torch.empty(0)
    for step, ids in enumerate(batches()):
        if step == SAVED_AFTER:
            with torch.no_grad():
                logits = model(input_ids=probe()).logits
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "logits": logits}


def _engine(kind: str, tp: int, stage: int, perturb: bool = True, frozen: bool = False) -> Any:
    """A fresh engine at tensor degree `tp` over the world (data-parallel over the rest); with
    `perturb` its model's weights are moved off the saved ones, so that only a load can make
    them right; with `frozen`, `FROZEN` is not trained."""
    dp = dist.get_world_size() // tp
    model = _freeze(build_model(kind), frozen)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL // dp,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return partita.initialize(model=model, config=config)[0]


def _train(engine: Any, steps: range) -> list[float]:
    """Trains global batches `steps` on this rank's data-parallel rows; the global losses."""
    dims = engine.dims
    rows = GLOBAL // dims.dp_world_size
    losses = []
    for step in steps:
        ids = batches()[step][dims.dp_rank * rows : (dims.dp_rank + 1) * rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        t = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(t, group=dims.dp_group)
        losses.append(float(t) / dims.dp_world_size)
    return losses


def _state(engine: Any) -> dict[str, dict[str, torch.Tensor | None]]:
    """This rank's master weights and optimizer state, by parameter name and key."""
    states = engine.param_states
    keys = ["param", *states.optimizer_state_keys()]
    return {
        name: {what: states.local_state(p, what) for what in keys}
        for name, p in engine.module.named_parameters()
    }


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names and keys whose tensors are not bitwise equal."""
    wrong = [f"{n}: missing" for n in a.keys() ^ b.keys()]
    for name in a.keys() & b.keys():
        for what, x in a[name].items():
            y = b[name].get(what)
            same = (x is None and y is None) or (
                x is not None and y is not None and x.shape == y.shape and torch.equal(x, y)
            )
            if not same:
                wrong.append(f"{name}: {what}")
    return sorted(wrong)


def resume(
    model_kind: str,
    save: tuple[int, int],
    load: tuple[int, int],
    folder: str,
    round_trip: bool = False,
    frozen: bool = False,
) -> dict[str, Any]:
    """Trains `SAVED_AFTER` steps at ``save = (tp, stage)``, saves; a fresh engine at
    ``load = (tp, stage)`` loads the checkpoint and trains the remaining steps. With
    `round_trip` the loading engine saves again at once, and a third engine at `save`'s
    degree and stage loads that: its master weights and optimizer state must be the first
    engine's, bitwise (re-cutting only moves elements). `frozen`: see `FROZEN`."""
    first = _engine(model_kind, *save, perturb=False, frozen=frozen)
    losses = _train(first, range(SAVED_AFTER))
    first.save_checkpoint(folder, tag="saved")
    saved_state = _state(first) if round_trip else {}
    second = _engine(model_kind, *load, frozen=frozen)
    second.load_checkpoint(folder, tag="saved")
    if round_trip:
        second.save_checkpoint(folder, tag="again")
    losses += _train(second, range(SAVED_AFTER, STEPS))
    out: dict[str, Any] = {
        "losses": losses,
        "tp": (first.get_tensor_parallel_world_size(), second.get_tensor_parallel_world_size()),
    }
    if round_trip:
        third = _engine(model_kind, *save, frozen=frozen)
        third.load_checkpoint(folder, tag="again")
        out["round_trip_differs"] = _differences(saved_state, _state(third))
    return out


def inference(model_kind: str, folder: str, tp: int) -> torch.Tensor:
    """`partita.init_inference` at tensor degree `tp` straight from the training checkpoint
    in `folder` (no conversion); the logits of `probe`."""
    model = build_model(model_kind)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    engine = partita.init_inference(
        model,
        tensor_parallel={"tp_size": tp},
        dtype=torch.float32,
        checkpoint=os.path.join(folder, "saved"),
    )
    return engine(input_ids=probe()).logits


def grid(case: str, **kwargs: Any) -> Any:
    """One case of the grid: "resume" or "inference" (their functions' arguments)."""
    return resume(**kwargs) if case == "resume" else inference(**kwargs)
