"""Rank body for tests/test_state_access.py (module level so spawned ranks can import it)."""

from __future__ import annotations

from typing import Any

import torch

import partita
from engine_workers import base_config
from models import global_batches, make_model, rank_micro_batch
from partita import comm, utils

STAGES = (0, 1, 2, 3)


def _probe(engine: Any, rank: int, world: int, micro: int) -> dict[str, Any]:
    """Two steps, a boundary backward, then every read and write of the state interface."""
    for i, batch in enumerate(global_batches(3, micro * world)):
        engine.backward(engine(*rank_micro_batch(batch, rank, world, micro, 0)))
        if i < 2:
            engine.step()
    states = engine.param_states
    params = list(engine.module.parameters())
    trained = [p for p in params if states.owns(p)]
    out: dict[str, Any] = {
        "owns": [states.owns(p) for p in params],
        "holds_frozen": [states.holds(p) for p in params if not p.requires_grad],
        "ranges": [states.owned_ranges(p) for p in trained],
        "local_param": [utils.safe_get_local_fp32_param(p) for p in trained],
        "local_exp_avg": [utils.safe_get_local_optimizer_state(p, "exp_avg") for p in trained],
    }
    for what in ("param", "grad", "exp_avg", "exp_avg_sq", "step"):
        out[what] = [states.full_state(p, what) for p in trained]
    # Each rank writes its own elements; the full value must then be 0.25 everywhere.
    target = trained[1]
    local = utils.safe_get_local_fp32_param(target)
    utils.safe_set_local_fp32_param(target, torch.full_like(local, 0.25))
    out["after_set_local"] = utils.safe_get_full_fp32_param(target)
    shape = out["param"][2].shape
    utils.safe_set_full_optimizer_state(trained[2], torch.full(shape, 3.0), "exp_avg")
    out["after_set_full_state"] = utils.safe_get_full_optimizer_state(trained[2], "exp_avg")
    frozen = next(p for p in params if not p.requires_grad)
    try:
        utils.safe_get_full_fp32_param(frozen)
        out["frozen_error"] = None
    except ValueError as err:
        out["frozen_error"] = str(err)
    # After the step the gradients are released until the next backward ([Note: released
    # gradients]): there is none to read, and writing one says so.
    engine.step()
    out["grad_after_step"] = [states.full_state(p, "grad") for p in trained]
    try:
        utils.safe_set_full_grad(trained[0], torch.zeros(out["param"][0].shape))
        out["set_grad_error"] = None
    except ValueError as err:
        out["set_grad_error"] = str(err)
    return out


def state_probe_all_stages() -> dict[int, dict[str, Any]]:
    """The probe under every ZeRO stage, one engine after the other in the same ranks."""
    rank, world = comm.get_rank(), comm.get_world_size()
    results = {}
    for stage in STAGES:
        zero = {"stage": stage, "reduce_bucket_size": 3000}
        if stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        config = base_config(2, 1, zero_optimization=zero)
        model = make_model(frozen=True)
        params = [p for p in model.parameters() if p.requires_grad]
        engine, _, _, _ = partita.initialize(model=model, model_parameters=params, config=config)
        results[stage] = _probe(engine, rank, world, 2)
        engine.destroy()
    return results
