"""Workers for tests/test_zeropp.py: a tiny GPT-2 under ZeRO-3 with ZeRO++'s options, the bytes
its training gathers move per named group, and the analytic figure for them."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

import partita
from models import global_batches, make_model, rank_micro_batch
from partita import comm
from partita.comm import COUNTERS
from partita.config import ConfigError
from partita.estimate.model import describe_module
from partita.estimate.zeropp import ZeroPP, price, tied_units
from partita.precision import full_dtype
from partita.precision.quantize import blocks_for, packed_nbytes
from partita.zero.stage3.gather import DEFAULT_BLOCK_SIZE, TRAINING, payload_bytes
from partita.zero.stage3.qgz import GRAD_TAG, sent_bytes
from partita.zero.stage3.unit import ShardedUnit

STEPS = 4
GAS = 2
"""Two micro-batches a step: hpZ's secondary copy serves the second forward too."""


def config(**zero: Any) -> dict[str, Any]:
    """Stage 3, every parameter in a unit (no persistent one), each unit released after use so
    backward re-gathers it (DeepSpeed's ZeRO++ tests set the same reuse distance)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            **zero,
        },
    }


def _gather_bytes(unit: ShardedUnit, tag: str, from_secondary: bool) -> tuple[str, int]:
    """(group name, bytes) one gather of `unit` moves, from its layout alone: each segment's
    world chunks exact in the module dtype or packed (one byte per element + 4 per block),
    whether the primary shards send them or the node group's secondary slices (k whole chunks
    each: [Note: secondary copy])."""
    plan, size = unit.gather_plan, unit.flat_full.element_size()
    total = 0
    for info, seg in zip(unit.segments, unit.layout.segments, strict=True):
        quantized = tag == TRAINING and plan.quantizes(info.group is None)
        block = plan.block_size if quantized else None
        total += payload_bytes(seg.chunk_numel, unit.world, block, size)
    return ("hpz" if from_secondary else ""), total


def _secondary_bytes(unit: ShardedUnit) -> int:
    """What hpZ's secondary copy of `unit` holds once filled: 1/h of each segment, in the
    module dtype, or as the packed bytes of its world/h chunks where quantized."""
    plan = unit.gather_plan
    if plan.secondary is None:
        return 0
    h, total = plan.secondary.size, 0
    exact = any(not plan.quantizes(s.group is None) for s in unit.segments)
    if exact:
        total += unit.numel // h * unit.flat_full.element_size()
    for info, seg in zip(unit.segments, unit.layout.segments, strict=True):
        if plan.quantizes(info.group is None) and seg.padded_numel:
            total += unit.world // h * packed_nbytes(seg.chunk_numel, plan.block_size)
    return total


def _record_gathers(events: list[tuple[str, int]]) -> Any:
    """Wraps `ShardedUnit._start_gather` so each training gather appends its analytic
    (group, bytes); returns the original to restore."""
    original = ShardedUnit._start_gather

    def start(self: ShardedUnit, tag: str) -> None:
        original(self, tag)
        if tag == TRAINING:
            events.append(_gather_bytes(self, tag, self._from_secondary))

    ShardedUnit._start_gather = start
    return original


def _first_order_bound(engine: Any) -> float:
    """Sum over parameters of |dL/dw| times half the quantization step of w's block: the
    largest first-order change of the loss when every weight moves by at most its bound
    ([Note: block quantization]). Read after the first backward, from the exact run."""
    from partita import utils

    strategy, bound = engine.strategy, 0.0

    for unit in strategy.units:
        strategy.pin(unit)  # an exact gather ("gathered")
        half_step = torch.zeros(unit.numel)
        block = DEFAULT_BLOCK_SIZE
        for seg in unit.layout.segments:
            rows = unit.flat_full[seg.flat_start : seg.flat_end].detach().float()
            chunk = seg.chunk_numel
            for r in range(unit.world):
                row = rows[r * chunk : (r + 1) * chunk]
                for b in range(blocks_for(chunk, block)):
                    part = row[b * block : (b + 1) * block]
                    start = seg.flat_start + r * chunk + b * block
                    half_step[start : start + part.numel()] = part.abs().max() / 127 / 2
        for p, off in zip(unit.params, unit.layout.offsets, strict=True):
            grad = utils.safe_get_full_grad(p)
            if grad is not None:
                bound += float(
                    (grad.float().abs().reshape(-1) * half_step[off : off + p.numel()]).sum()
                )
        strategy.unpin(unit)
    return bound


def train(
    zero: dict[str, Any], bf16: bool = False, frozen: bool = False, bound: bool = False
) -> dict[str, Any]:
    """Trains STEPS steps; per step the global mean loss, the training gathers' bytes by group
    (counted, and from the layouts), and at the end the parameters and memory; with `bound`,
    only the first step's first-order quantization bound (`_first_order_bound`)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model(kind="gpt2", frozen=frozen)
    cfg = config(**zero) | ({"bf16": {"enabled": True}} if bf16 else {})
    params = [p for p in model.parameters() if p.requires_grad]
    priced = _price(model, world, cfg, bf16)
    engine, _, _, _ = partita.initialize(model=model, model_parameters=params, config=cfg)
    events: list[tuple[str, int]] = []
    original = _record_gathers(events)
    losses, counted, expected, grads = [], [], [], []
    try:
        for batch in global_batches(STEPS, GAS * world):
            before = dict(COUNTERS.total_group_bytes)
            events.clear()
            step_loss = torch.zeros(())
            for m in range(GAS):
                loss = engine(*rank_micro_batch(batch, rank, world, 1, m))
                engine.backward(loss)
                if bound and m == GAS - 1:  # the first step's gradient, then stop
                    first_order = _first_order_bound(engine)
                    engine.destroy()
                    return {"bound": first_order}
                engine.step()
                step_loss += loss.detach().float() / GAS
            comm.all_reduce(step_loss, tag="test")
            losses.append(step_loss.item() / world)
            counted.append(_bytes_since(before, TRAINING))
            grads.append(_bytes_since(before, GRAD_TAG))
            expected.append(_sum_by_group(events))
    finally:
        ShardedUnit._start_gather = original
    units = engine.strategy.units
    out = {
        "losses": losses,
        "counted": counted,
        "expected": expected,
        "units": len(units),
        "grad_counted": grads,
        "grad_expected": _qgz_bytes(engine.strategy),
        "primary_per_step": sum(_gather_bytes(u, TRAINING, False)[1] for u in units),
        "secondary_bytes": sum(u.secondary_bytes for u in units),
        "secondary_expected": sum(_secondary_bytes(u) for u in units),
        "unit_bytes": sum(u.numel * u.flat_full.element_size() for u in units),
        "params": _full_params(engine),
        "price": priced,
    }
    engine.destroy()
    return out


def _price(model: Any, world: int, cfg: dict[str, Any], bf16: bool) -> Any:
    """The estimator's ZeRO++ figures for this job (`partita.estimate.zeropp`), or None for
    a frozen-weights case (its units hold frozen segments the estimator does not gather)."""
    if not all(p.requires_grad for p in model.parameters()):
        return None
    z = cfg["zero_optimization"]
    opts = ZeroPP(
        quantized_weights=z.get("zero_quantized_weights", False),
        quantized_gradients=z.get("zero_quantized_gradients", False),
        gradient_bits=z.get("zero_quantized_gradients_bits", 8),
        error_feedback=z.get("zero_quantized_gradients_error_feedback", False),
        hpz=z.get("zero_hpz_partition_size", 1),
    )
    units = describe_module(model).units
    dtype_bytes, tied = (2 if bf16 else 4), tied_units(model)
    return price(units, world, opts, dtype_bytes, dtype_bytes, gas=GAS, tied=tied)


def _inf_hook(armed: list[bool]) -> Any:
    """A gradient hook putting +inf into element 0 while ``armed[0]``: a forced overflow."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not armed[0]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    return hook


def reduced_grads(
    zero: dict[str, Any], fp16: bool = False, inject: int | None = None, start: int = 0
) -> dict[str, Any]:
    """Trains at learning rate 0 (the weights, so each step's gradients, are the same in every
    run) and returns this rank's reduced master gradients after each step's backward, flat:
    the quantized reductions measured against the exact ones, step by step. `fp16`: a static
    loss scale (the same in every run; an overflowed step is still skipped); `inject`: at that
    step rank 0's first gradient holds an inf in its first micro-batch (the step overflows), and
    each step's applied flag and error-feedback bytes after it are returned; `start`: the run
    begins at that batch of the same sequence (a run without the earlier steps' history)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model(kind="gpt2")
    cfg = config(**zero)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "loss_scale": 128}
    priced = _price(model, world, cfg, False)
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    armed = [False]
    if inject is not None and rank == 0:
        next(engine.module.parameters()).register_hook(_inf_hook(armed))
    grads, applied, held_after = [], [], []
    held = engine.strategy.reducer.quantized
    for step, batch in enumerate(global_batches(STEPS, GAS * world)[start:], start):
        for m in range(GAS):
            armed[0] = step == inject and m == 0
            engine.backward(engine(*rank_micro_batch(batch, rank, world, 1, m)))
            if m == GAS - 1:
                masters = engine.strategy._masters()
                flat = [torch.zeros(x.numel()) if x.grad is None else x.grad for x in masters]
                grads.append(torch.cat([g.detach().float().reshape(-1) for g in flat]).clone())
            engine.step()
        applied.append(engine.was_step_applied())
        held_after.append(None if held is None or held.feedback is None else held.feedback.nbytes)
    feedback = None if held is None or held.feedback is None else held.feedback.nbytes
    engine.destroy()
    return {
        "grads": grads,
        "feedback_bytes": feedback,
        "price": priced,
        "applied": applied,
        "feedback_after": held_after,
    }


def _qgz_bytes(strategy: Any) -> dict[str, int] | None:
    """qgZ: bytes per step each hop sends, from the layouts: every trainable segment of every
    unit reduced once per micro-batch ([Note: quantized gradient reduce-scatter])."""
    groups = strategy.reducer.quantized
    if groups is None:
        return None
    node = lane = 0
    for unit in strategy.all_units:
        for idx in unit.masters:
            a, b = sent_bytes(unit.layout.segments[idx].chunk_numel, groups)
            node, lane = node + a, lane + b
    return {"hpz": GAS * node, "hpz_lane": GAS * lane}


def _bytes_since(before: dict[tuple[str, str, str], int], want: str) -> dict[str, int]:
    """Bytes of collectives tagged `want` per group name since `before` (any op: gloo may run
    a gather as an all-reduce of the same output)."""
    out: dict[str, int] = defaultdict(int)
    for (group, _op, tag), value in COUNTERS.total_group_bytes.items():
        if tag == want and value - before.get((group, _op, tag), 0):
            out[group] += value - before.get((group, _op, tag), 0)
    return dict(out)


def _sum_by_group(events: list[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for group, nbytes in events:
        out[group] += nbytes
    return dict(out)


def _full_params(engine: Any) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with partita.zero.GatheredParameters(params):
        return [p.detach().to(full_dtype(p)).clone() for p in params]


def refusal(zero: dict[str, Any]) -> str:
    """The error `initialize` raises for a stage-3 config with `zero` (every rank alike)."""
    model = make_model(kind="gpt2")
    try:
        partita.initialize(model=model, model_parameters=model.parameters(), config=config(**zero))
    except ConfigError as error:
        return str(error)
    return "no error"


def sharded_all_gather(stage: int, quantized: bool, bf16: bool = False) -> dict[str, Any]:
    """Stage 1 or 2 (`quantized`: with ``zero_quantized_weights``): per step the global mean
    loss and the bytes of the weights' all-gather after the step, counted and from the
    groups' layouts (exact: world x chunk x element size per segment; quantized: world x the
    packed chunk)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model(kind="gpt2")
    cfg = config(zero_quantized_weights=quantized) | ({"bf16": {"enabled": True}} if bf16 else {})
    cfg["zero_optimization"] = {"stage": stage, "zero_quantized_weights": quantized}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=model.parameters(),
                                         config=cfg)  # fmt: skip
    block = DEFAULT_BLOCK_SIZE if quantized else None
    expected = sum(
        payload_bytes(seg.chunk_numel, world, block, g.flat_param.element_size())
        for g in engine.strategy.groups
        for seg in g.layout.segments
        if seg.padded_numel
    )
    losses, counted = [], []
    for batch in global_batches(STEPS, GAS * world):
        before = dict(COUNTERS.total_group_bytes)
        step_loss = torch.zeros(())
        for m in range(GAS):
            loss = engine(*rank_micro_batch(batch, rank, world, 1, m))
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / GAS
        comm.all_reduce(step_loss, tag="test")
        losses.append(step_loss.item() / world)
        counted.append(sum(_bytes_since(before, TRAINING).values()))
    replicas_equal = _replicas_equal(engine)
    engine.destroy()
    return {"losses": losses, "counted": counted, "expected": expected, "equal": replicas_equal}


def _replicas_equal(engine: Any) -> bool:
    """Whether every rank holds the same module weights (the dequantized all-gather gives
    every replica, this rank's own chunk included, the same values)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    first = flat.clone()
    comm.broadcast(first, src=0, tag="test")
    return bool(torch.equal(first, flat))


def zeropp_grid(kind: str, **kwargs: Any) -> Any:
    """One case of the grid: "train", "grads", "sharded" or "refusal"."""
    if kind == "grads":
        return reduced_grads(**kwargs)
    if kind == "sharded":
        return sharded_all_gather(**kwargs)
    return train(**kwargs) if kind == "train" else refusal(**kwargs)
