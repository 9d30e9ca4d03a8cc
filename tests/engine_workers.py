"""Per-rank training bodies for engine tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import logging
from typing import Any

import torch

import partita
from models import global_batches, make_model, rank_micro_batch, two_groups
from partita import comm
from partita.precision import full_dtype


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def base_config(micro: int, gas: int, lr: float = 1e-3, clip: float = 0.0, **extra: Any) -> dict:
    """A ds_config with AdamW and the given batch split."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        **extra,
    }


def _inject_inf(param: torch.nn.Parameter, when: list[bool]) -> None:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if when[0]:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    param.register_hook(hook)


def _grads_held(engine: Any) -> int:
    """Bytes of memory behind the ``.grad`` of the module's parameters and of the tensors the
    optimizer steps, plus what the strategy says it holds for gradients besides (its
    gradients and its pooled reduce buffers)."""
    stepped = [p for g in engine.strategy.optimizer.param_groups for p in g["params"]]
    seen: set[int] = set()
    total = 0
    for p in [*engine.module.parameters(), *stepped]:
        if p.grad is not None and p.grad.untyped_storage().data_ptr() not in seen:
            seen.add(p.grad.untyped_storage().data_ptr())
            total += p.grad.untyped_storage().nbytes()
    report = engine.memory_report()
    return total + report.get("grads_held", 0) + report.get("comm_buffers_held", 0)


def assert_no_grads_at_forward(result: dict[str, Any]) -> None:
    """`train`'s steps after the first began their forward holding no gradient memory."""
    held = result["grads_at_forward"]
    assert held and not any(held), f"gradient bytes held at each step's forward: {held}"


def train(
    config: dict,
    steps: int,
    inject_inf: tuple[int, tuple[int, ...]] | None = None,
    model_kwargs: dict | None = None,
    groups: bool = False,
) -> dict[str, Any]:
    """Trains `steps` optimizer steps on the shared global batches; returns per-step global
    mean losses, final parameters (fp32), counters and per-step comm bytes.

    `inject_inf=(rank, steps)` puts an inf into one gradient element on that rank at those steps.
    """
    rank, world = comm.get_rank(), comm.get_world_size()
    micro, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    model = make_model(**(model_kwargs or {}))
    capture = _Capture()
    logging.getLogger("partita").addHandler(capture)
    wd = config["optimizer"]["params"]["weight_decay"]
    params = two_groups(model, wd) if groups else model.parameters()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=params, config=config)
    armed = [False]
    if inject_inf is not None and inject_inf[0] == rank:
        _inject_inf(next(engine.module.parameters()), armed)
    dtype = next(engine.module.parameters()).dtype
    losses, comm_bytes, applied, scales, unchanged = [], [], [], [], []
    # Gradient memory at the first forward of each step after the first: torch's loop holds
    # none there (zero_grad(set_to_none=True)), and neither may partita.
    first_forward = [False]
    at_forward: list[int] = []
    watch = engine.module.register_forward_pre_hook(
        lambda *_: at_forward.append(_grads_held(engine)) if first_forward[0] else None
    )
    for step, batch in enumerate(global_batches(steps, micro * gas * world)):
        armed[0] = inject_inf is not None and step in inject_inf[1]
        before = _full_params(engine)
        step_loss = torch.zeros((), dtype=full_dtype(next(engine.module.parameters())))
        for m in range(gas):
            tokens, targets = rank_micro_batch(batch, rank, world, micro, m)
            first_forward[0] = step > 0 and m == 0
            loss = engine(tokens, targets)
            first_forward[0] = False
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().to(step_loss.dtype) / gas
        comm_bytes.append(engine.last_step_comm_bytes)
        comm.all_reduce(step_loss, tag="test")
        losses.append(step_loss.item() / world)
        applied.append(engine.was_step_applied())
        scales.append(engine.cur_scale)
        after = _full_params(engine)
        unchanged.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
    logging.getLogger("partita").removeHandler(capture)
    watch.remove()
    result = {
        "grads_at_forward": at_forward,
        "losses": losses,
        "params": _full_params(engine),
        "dtype": str(dtype),
        "skipped": engine.skipped_steps,
        "applied": applied,
        "scales": scales,
        "unchanged": unchanged,
        "comm": comm_bytes,
        "grad_bytes": sum(
            p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad
        ),
        "warnings": capture.messages,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "memory": engine.memory_report(),
        **_stage3_stats(engine),
        "numel": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
    }
    engine.destroy()
    return result


def train_grid(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs `train(**case)` for every case in one set of processes (amortises spawn cost)."""
    return [train(**case) for case in cases]


def accessor_probe(config: dict) -> dict[str, Any]:
    """Two steps, then a boundary backward; reads every accessor before the third step."""
    from partita import utils

    rank, world = comm.get_rank(), comm.get_world_size()
    micro = config["train_micro_batch_size_per_gpu"]
    model = make_model()
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    batches = global_batches(3, micro * world)
    for i, batch in enumerate(batches):
        loss = engine(*rank_micro_batch(batch, rank, world, micro, 0))
        engine.backward(loss)
        if i < 2:
            engine.step()
    params = list(engine.module.parameters())
    out: dict[str, Any] = {
        "param": [utils.safe_get_full_fp32_param(p) for p in params],
        "grad": [utils.safe_get_full_grad(p) for p in params],
        "exp_avg": [utils.safe_get_full_optimizer_state(p, "exp_avg") for p in params],
        "local_param": [utils.safe_get_local_fp32_param(p) for p in params],
        "local_exp_avg_sq": [utils.safe_get_local_optimizer_state(p, "exp_avg_sq") for p in params],
    }
    out["exp_avg_sq"] = [utils.safe_get_full_optimizer_state(p, "exp_avg_sq") for p in params]
    target = params[1]
    utils.safe_set_full_fp32_param(target, torch.full_like(target, 0.5, dtype=torch.float32))
    out["after_set_module"] = target.detach().float().clone()
    out["after_set_master"] = utils.safe_get_full_fp32_param(target)
    return out


def _stage3_stats(engine: Any) -> dict[str, Any]:
    """Gather instrumentation of a stage-3 engine (empty for other stages)."""
    strategy = engine.strategy
    if not hasattr(strategy, "scheduler"):
        return {}
    return {
        "peak_live": strategy.scheduler.peak_live_numel,
        "unit_numels": [u.numel for u in strategy.units],
        "padded_numel": sum(u.layout.padded_numel for u in strategy.all_units),
        "persistent_numel": 0 if strategy.persistent is None else strategy.persistent.numel,
        "sub_groups": [m.numel() for m in strategy._masters()],
        "swapped_shards": sum(1 for u in strategy.units if u.swapped_shard_numel),
        "peak_resident_shards": strategy.scheduler.peak_resident_shards,
        "peak_resident_sub_groups": None
        if strategy.swapped is None
        else strategy.swapped.peak_resident,
        "masters_on_device": strategy.masters_on_device,
    }


def generate_after_training(config: dict, kind: str) -> list[list[int]]:
    """Trains 2 steps, then greedy-generates with Hugging Face `generate` under no_grad."""
    rank, world = comm.get_rank(), comm.get_world_size()
    micro = config["train_micro_batch_size_per_gpu"]
    model = make_model(kind=kind)
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    for batch in global_batches(2, micro * world):
        loss = engine(*rank_micro_batch(batch, rank, world, micro, 0))
        engine.backward(loss)
        engine.step()
    engine.eval()
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = engine.module.model.generate(
            prompt, max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    return out.tolist()


def _full_params(engine: Any) -> list[torch.Tensor]:
    """Every parameter's full value, 16-bit ones as fp32 (gathered under stage 3)."""
    params = list(engine.module.parameters())
    with partita.zero.GatheredParameters(params):
        return [p.detach().to(full_dtype(p)).clone() for p in params]


def init_probe(
    config: dict, kind: str, steps: int, remote_device: str | None = None
) -> dict[str, Any]:
    """Builds the model under zero.Init (chunks on `remote_device`), checks it equals an eager
    build, trains `steps` steps, then lets rank 0 overwrite one weight through
    GatheredParameters."""
    rank, world = comm.get_rank(), comm.get_world_size()
    micro = config["train_micro_batch_size_per_gpu"]
    init = partita.zero.Init(remote_device=remote_device, config_dict_or_path=config)
    with init:
        model = make_model(kind=kind, **({"dim": 64, "layers": 4} if kind == "tiny" else {}))
    eager = make_model(kind=kind, **({"dim": 64, "layers": 4} if kind == "tiny" else {}))
    params = list(model.parameters())
    from partita.zero.init import PRE_SHARDED

    held = sum(PRE_SHARDED[p].chunk.untyped_storage().nbytes() for p in params if p in PRE_SHARDED)
    with partita.zero.GatheredParameters(params):
        same_as_eager = all(
            torch.equal(a, b) for a, b in zip(params, eager.parameters(), strict=True)
        )
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    losses = []
    for batch in global_batches(steps, micro * world):
        loss = engine(*rank_micro_batch(batch, rank, world, micro, 0))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        comm.all_reduce(total, tag="test")
        losses.append(total.item() / world)
    target = next(engine.module.parameters())
    with partita.zero.GatheredParameters([target], modifier_rank=0):
        if rank == 0:
            target.data.fill_(0.25)
    with partita.zero.GatheredParameters([target]):
        seen = target.detach().clone()
    from partita.utils import safe_get_full_fp32_param

    master = bool(torch.all(safe_get_full_fp32_param(target) == 0.25))
    memory = engine.memory_report()
    engine.destroy()
    return {
        "same_as_eager": same_as_eager,
        "stats": (init.stats.peak_materialized_bytes, held),
        "numel": sum(p.numel() for p in eager.parameters()),
        "largest_module_bytes": max(
            sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in eager.modules()
        ),
        # A module with its direct children's own weights (what HF initialisation gathers).
        "largest_family_bytes": max(
            sum(p.numel() * 4 for c in [m, *m.children()] for p in c.parameters(recurse=False))
            for m in eager.modules()
        ),
        "losses": losses,
        "seen": bool(torch.all(seen == 0.25)),
        "master": master,
        "memory": memory,
    }


def save16_probe(config: dict, out_dir: str, max_shard_bytes: int) -> list[torch.Tensor]:
    """Trains 2 steps, saves 16-bit weights (sharded files when the limit is small) and
    returns the full parameters for comparison."""
    from partita.zero.save16 import save_16bit_model

    rank, world = comm.get_rank(), comm.get_world_size()
    micro = config["train_micro_batch_size_per_gpu"]
    model = make_model()
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    for batch in global_batches(2, micro * world):
        loss = engine(*rank_micro_batch(batch, rank, world, micro, 0))
        engine.backward(loss)
        engine.step()
    save_16bit_model(engine, out_dir, max_shard_bytes=max_shard_bytes)
    return _full_params(engine)


def monitored_run(out_dir: str) -> list[str]:
    """Three fp16 steps with the CSV and TensorBoard monitors on; returns files written."""
    import os

    config = base_config(
        2,
        1,
        fp16={"enabled": True, "initial_scale_power": 8},
        csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "job"},
        tensorboard={"enabled": True, "output_path": out_dir, "job_name": "tb"},
    )
    train(config, steps=3)
    found = []
    for root, _, files in os.walk(out_dir):
        found += [os.path.relpath(os.path.join(root, f), out_dir) for f in files]
    return sorted(found)
