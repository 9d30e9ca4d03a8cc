"""Rank workers for tests/test_checkpoint_tp_slices.py: checkpoints of a tensor-parallel model.

The Megatron-style block of tests/tp_mpu_workers.py runs as tensor parallel 2 x data parallel
2 through an ``mpu``. Each case trains two steps, saves, trains two more (the losses are the
reference), then a fresh engine (its weights perturbed, so that only the load can make them
right) loads the checkpoint and trains the same two steps. A one-process engine of the whole
block then loads a tp-2 checkpoint (`full_loader`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import partita
from engine_workers import _full_params
from partita import comm
from partita.checkpoint import CheckpointError
from tp_mpu_workers import MICRO, TP, TensorParallelBlock, _batches, _config, _model, _Mpu

DP = 2
"""Data-parallel ranks of the four (the global batch is ``MICRO * DP`` rows)."""
SAVED_AFTER = 2
"""Steps trained before the save; the batches after it are trained by both engines."""
PARTITION_DIMS = {"col.weight": 0, "col.bias": 0, "row.weight": 1}
"""Megatron's ``partition_dim`` of the block's split parameters (column layer: output rows,
row layer: input columns)."""


def _block(dims: comm.ParallelDims, partition_dims: bool, perturb: bool) -> TensorParallelBlock:
    """This tensor rank's block; with `partition_dims` its split parameters say how they are
    cut (as Megatron's layers do), with `perturb` its weights are moved off the saved ones."""
    model = TensorParallelBlock(_model(), dims.tp_rank, dims.tp_group)
    if partition_dims:
        for name, dim in PARTITION_DIMS.items():
            param = model.get_parameter(name)
            param.partition_dim = dim  # type: ignore[attr-defined]
            param.partition_stride = 1  # type: ignore[attr-defined]
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
    return model


def _optimizer_state(engine: Any) -> dict[str, list[torch.Tensor | None]]:
    """This rank's optimizer state of every parameter (its data-parallel shard)."""
    states = engine.param_states
    return {
        what: [states.local_state(p, what) for p in engine.module.parameters()]
        for what in states.optimizer_state_keys()
    }


def _steps(engine: Any, dims: comm.ParallelDims, steps: range) -> list[float]:
    """Trains the global batches `steps` on this rank's data-parallel share; the losses."""
    batches = _batches(dims.dp_world_size)
    rows = slice(dims.dp_rank * MICRO, (dims.dp_rank + 1) * MICRO)
    losses = []
    for step in steps:
        x, y = batches[step]
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _case(dims: comm.ParallelDims, root: str, stage: int, partition_dims: bool) -> dict[str, Any]:
    """Save after `SAVED_AFTER` steps, load into a fresh engine, train on with both."""
    folder = os.path.join(root, f"stage{stage}-dims{int(partition_dims)}")
    after = range(SAVED_AFTER, SAVED_AFTER + 2)
    config = _config(stage, False, None)
    model = _block(dims, partition_dims, perturb=False)
    engine = partita.initialize(model=model, config=config, mpu=_Mpu(dims))[0]
    _steps(engine, dims, range(SAVED_AFTER))
    engine.save_checkpoint(folder, tag="t")
    saved = {"params": _full_params(engine), "optimizer": _optimizer_state(engine)}
    saved["names"] = [n for n, _ in engine.module.named_parameters()]
    losses = _steps(engine, dims, after)
    engine.destroy()

    model = _block(dims, partition_dims, perturb=True)
    engine = partita.initialize(model=model, config=config, mpu=_Mpu(dims))[0]
    engine.load_checkpoint(folder, tag="t")
    loaded = {"params": _full_params(engine), "optimizer": _optimizer_state(engine)}
    resumed = _steps(engine, dims, after)
    engine.destroy()
    return {"folder": folder, "saved": saved, "loaded": loaded, "losses": losses,
            "resumed": resumed}  # fmt: skip


def tp_checkpoint_worker(cases: list[dict[str, Any]], root: str) -> dict[str, Any]:
    """Every case (`_case`'s keyword arguments) on tp 2 x dp 2 (rank = dp_rank * 2 +
    tp_rank)."""
    dims = comm.ParallelDims.tensor_parallel(TP)
    runs = [_case(dims, root, **case) for case in cases]
    return {"tp_rank": dims.tp_rank, "dp_rank": dims.dp_rank, "runs": runs}


def full_loader(folder: str, refused_folder: str, save_to: str) -> dict[str, Any]:
    """One process, the whole block, no mpu: loads the tp-2 checkpoint in `folder` (weights
    by name, then the losses of the two steps after the save), saves itself (tp 1) under
    `save_to`, and tries to load the one in `refused_folder`, whose split parameters do not
    say along which dimension (the error)."""
    config = _config(0, False, None)
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    engine = partita.initialize(model=model, config=config)[0]
    engine.load_checkpoint(folder, tag="t")
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    losses = []
    for step in range(SAVED_AFTER, SAVED_AFTER + 2):
        x, y = _batches(DP)[step]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.save_checkpoint(save_to, tag="t")
    try:
        engine.load_checkpoint(refused_folder, tag="t")
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    engine.destroy()
    return {"weights": weights, "losses": losses, "refused": refused}


def narrow_loader(folder: str, whole_folder: str) -> dict[str, Any]:
    """Tensor parallel 2 x data parallel 1 at ZeRO stage 2: loads the tp-2 x dp-2 checkpoint
    in `folder` (this rank's weights, then the losses of the two steps after the save on the
    whole global batch), and tries to load the tp-1 checkpoint in `whole_folder` (the
    error)."""
    dims = comm.ParallelDims.tensor_parallel(TP)
    model = _block(dims, partition_dims=True, perturb=True)
    engine = partita.initialize(model=model, config=_config(2, False, None), mpu=_Mpu(dims))[0]
    engine.load_checkpoint(folder, tag="t")
    params = _full_params(engine)
    losses = []
    for step in range(SAVED_AFTER, SAVED_AFTER + 2):
        x, y = _batches(DP)[step]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    try:
        engine.load_checkpoint(whole_folder, tag="t")
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    engine.destroy()
    return {"params": params, "losses": losses, "refused": refused}
