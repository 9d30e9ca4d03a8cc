"""Per-rank bodies for the DeepSpeedEngine-method tests (module level so spawned ranks can import
them): the accessors scripts call, module state dicts, and offload/reload between phases."""

from __future__ import annotations

from typing import Any

import torch

import partita
from engine_workers import base_config
from models import global_batches, make_model, rank_micro_batch
from partita import comm
from partita.compat.accessors import safe_get_full_fp32_param
from partita.engine.offload_states import resident_state_bytes


def _engine(config: dict, seed: int = 0, frozen: bool = False) -> Any:
    model = make_model(seed=seed, frozen=frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = partita.initialize(model=model, model_parameters=params, config=config)
    return engine


def _train_steps(engine: Any, batches: list, micro: int, gas: int) -> list[float]:
    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for batch in batches:
        for m in range(gas):
            tokens, targets = rank_micro_batch(batch, rank, world, micro, m)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    return losses


def _probe(engine: Any) -> dict[str, Any]:
    names = [
        "bfloat16_enabled", "bf16_enabled", "fp16_enabled", "zero_optimization",
        "zero_optimization_stage", "zero_optimization_partition_gradients",
        "zero_optimization_partition_weights", "get_batch_info", "get_data_parallel_rank",
        "optimizer_name", "get_mom", "loss_scale", "dynamic_loss_scale",
        "initial_dynamic_scale", "zero_offload_optimizer", "zero_cpu_offload",
        "zero_use_cpu_optimizer", "gradient_clipping", "postscale_gradients",
        "get_data_types", "zero_reduce_bucket_size", "zero_param_persistence_threshold",
        "flops_profiler_enabled", "curriculum_learning_enabled", "scheduler_name",
    ]  # fmt: skip
    out = {n: getattr(engine, n)() for n in names}
    out["communication_data_type"] = engine.communication_data_type
    out["zero_offload_optimizer"] = out["zero_offload_optimizer"] is not None
    return out


def accessor_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each config: the accessors before training, the grad norm before and after one
    step, `set_train_batch_size`'s effect, and a refused method's error."""
    results = []
    for case in cases:
        engine = _engine(case["config"])
        out = _probe(engine)
        out["norm_before"] = engine.get_global_grad_norm()
        cfg = case["config"]
        micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
        world = comm.get_world_size()
        _train_steps(engine, global_batches(1, micro * gas * world), micro, gas)
        out["norm_after"] = engine.get_global_grad_norm()
        engine.set_train_batch_size(micro * world * 3)
        out["after_set_batch"] = engine.get_batch_info()
        out["gas_after_set"] = engine.gradient_accumulation_steps()
        engine.set_train_micro_batch_size(micro * 2)
        out["after_set_micro"] = engine.get_batch_info()
        tokens, targets = rank_micro_batch(global_batches(1, 4 * world)[0], 0, 1, 4, 0)
        loss = engine(tokens, targets)
        returned = engine.backward(loss)
        returned_unscaled = engine.backward(engine(tokens, targets), scale_wrt_gas=False)
        gas_now = engine.gradient_accumulation_steps()
        out["backward_returns_share"] = torch.equal(returned, loss.detach() / gas_now)
        out["backward_returns_loss"] = float(returned) == float(loss.detach())
        out["unscaled_returns_loss"] = float(returned_unscaled) == float(loss.detach())
        out["hasattr_refused"] = hasattr(engine, "allreduce_gradients")
        try:
            engine.allreduce_gradients()
        except AttributeError as error:
            out["refused_error"] = (type(error).__name__, str(error))
        try:
            engine.no_such_method_at_all()
        except AttributeError as error:
            out["unknown_error"] = str(error)
        results.append(out)
        engine.destroy()
    return results


def _weights(engine: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    """module_state_dict as fp32 copies (below stage 3 its values are views of live weights)."""
    return {k: v.float().clone() for k, v in engine.module_state_dict(**kwargs).items()}


def state_dict_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An engine built from model A that loads model B's weights with load_module_state_dict
    (before any step: optimizer state is not the module's) trains as an engine built from B
    does, losses and module_state_dict alike; plus exclude_frozen_parameters and a bad key."""
    results = []
    for case in cases:
        cfg, frozen = case["config"], case.get("frozen", False)
        micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
        batches = global_batches(3, micro * gas * comm.get_world_size())
        engine = _engine(cfg, frozen=frozen)
        other = make_model(seed=5, frozen=frozen).state_dict()
        engine.load_module_state_dict({"module": other})
        loaded = engine.module_state_dict()
        # the module's dtype holds what it can of the fp32 values: their rounding
        loaded_equals_other = all(
            torch.equal(loaded[k], other[k].to(loaded[k].dtype)) for k in other
        )
        after_load = _train_steps(engine, batches, micro, gas)
        trained = _weights(engine)
        without_frozen = _weights(engine, exclude_frozen_parameters=True)
        engine.destroy()
        fresh = _engine(cfg, seed=5, frozen=frozen)
        fresh_losses = _train_steps(fresh, batches, micro, gas)
        fresh_weights = _weights(fresh)
        fresh.destroy()
        bad_key = None
        probe = _engine(cfg)
        try:
            probe.load_module_state_dict({"module": {"not.a.key": torch.zeros(1)}})
        except RuntimeError as error:
            bad_key = str(error)
        probe.destroy()
        results.append(
            {
                "keys": sorted(trained),
                "keys_without_frozen": sorted(without_frozen),
                "values": trained,
                "fresh_values": fresh_weights,
                "loaded_equals_other": loaded_equals_other,
                "after_load": after_load,
                "fresh": fresh_losses,
                "bad_key": bad_key,
            }
        )
    return results


def _micro_steps(engine: Any, batches: list, micro: int, gas: int, losses: list[float]) -> Any:
    """Trains `batches`, yielding after every micro step; appends each step's last loss."""
    rank, world = comm.get_rank(), comm.get_world_size()
    for batch in batches:
        for m in range(gas):
            tokens, targets = rank_micro_batch(batch, rank, world, micro, m)
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            yield
        losses.append(float(loss.detach()))


def _offload_run(cfg: dict, include: Any, steps: tuple[int, int], at_micro: int) -> dict[str, Any]:
    """Trains, offloads `include` ("all": DeepSpeed's default, everything) after steps[0]
    steps and `at_micro` micro steps more, probes what works and what refuses while
    offloaded, reloads and trains to steps[0] + steps[1] steps; `include=None` trains without
    offloading (the run to compare with)."""
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    world, rank = comm.get_world_size(), comm.get_rank()
    batches = global_batches(sum(steps), micro * gas * world)
    engine = _engine(cfg)
    losses: list[float] = []
    out: dict[str, Any] = {}
    for done, _ in enumerate(_micro_steps(engine, batches, micro, gas, losses), start=1):
        if include is not None and done == steps[0] * gas + at_micro:
            out = _offload_and_probe(
                engine, include, rank_micro_batch(batches[0], rank, world, micro, 0)
            )
    out.update(losses=losses, weights=engine.module_state_dict())
    engine.destroy()
    return out


def _offload_and_probe(engine: Any, include: Any, batch: tuple) -> dict[str, Any]:
    tokens, targets = batch
    with torch.no_grad():
        loss_before = engine(tokens, targets)
    before = resident_state_bytes(engine)
    engine.offload_states(include=None if include == "all" else include)
    during = resident_state_bytes(engine)
    memory_during = engine.memory_report()
    refused: dict[str, str] = {}
    probes = {
        "step": engine.step,
        "forward": lambda: engine(tokens, targets),
        "save": engine.consolidated_16bit_state_dict,
        "state_read": lambda: safe_get_full_fp32_param(next(engine.module.parameters())),
    }
    generated = None
    for name, call in probes.items():
        try:
            with torch.no_grad():
                value = call()
            if name == "forward":
                generated = value
        except RuntimeError as error:
            refused[name] = str(error)
    engine.reload_states()
    return {
        "before": before,
        "during": during,
        "after": resident_state_bytes(engine),
        "optimizer_state_during": memory_during["optimizer_state"],
        "refused": refused,
        "generated_equal": None if generated is None else torch.equal(generated, loss_before),
    }


def offload_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`_offload_run` for each case (one spawn for the grid)."""
    return [
        _offload_run(c["config"], c["include"], c.get("steps", (2, 2)), c.get("at_micro", 0))
        for c in cases
    ]


def config(stage: int, **extra: Any) -> dict:
    """A small AdamW config at `stage` (gradient clipping on, so the norm matters)."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, **extra.pop("zero", {})}
    return base_config(micro=2, gas=2, clip=1.0, zero_optimization=zero, **extra)


def offload_refusals(_: Any) -> dict[str, str]:
    """The messages of offload_states calls DeepSpeed refuses too."""
    out: dict[str, str] = {}
    param_offload = config(3, zero={"offload_param": {"device": "cpu"}})
    calls = {
        "offload_param": (param_offload, {}),
        "nvme": (config(1), {"device": "nvme"}),
        "unknown_kind": (config(1), {"include": ["optim_states", "bogus"]}),
    }
    for name, (cfg, kwargs) in calls.items():
        engine = _engine(cfg)
        try:
            engine.offload_states(**kwargs)
        except ValueError as error:
            out[name] = str(error)
        engine.destroy()
    return out
