"""Per-rank bodies for the mixed-precision parity tests, and their plain-torch reference.

`mixed_case` trains a partita engine in bf16 or fp16 and, on rank 0, runs `reference_run16`:
the same training written with torch alone (no partita import), which the test compares with
the engine step by step. The reference is computed inside the spawned rank so it runs with the
same intra-op thread count as the engine's forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from models import global_batches, make_model, rank_micro_batch

LR = 5e-3
WEIGHT_DECAY = 0.01
MICRO = 2
BUCKET = 3000
"""reduce_bucket_size: several gradient buckets / reduction units for the tiny model."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def engine_config(precision: str, stage: int, fp16: dict[str, Any] | None) -> dict[str, Any]:
    """The ds_config of a case: AdamW, micro batch 2, no accumulation, no clipping."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    else:
        config["fp16"] = {"enabled": True, **(fp16 or {})}
    if stage == 3:
        # Some parameters persistent (gathered for good), the rest sharded and re-gathered.
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    return config


def _inf_hook(when: list[bool]) -> Any:
    """A tensor hook that puts +inf into element 0 of the gradient while ``when[0]`` is set."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if when[0]:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    return hook


def mixed_case(
    precision: str,
    stage: int,
    steps: int,
    fp16: dict[str, Any] | None = None,
    inject: tuple[int, tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """Trains the engine `steps` steps; returns this rank's per-step losses, the loss scale each
    step used, whether each step was applied, and the final 16-bit weights and fp32 masters.

    `inject=(rank, steps)`: that rank's gradient of the first parameter gets an inf in element
    0 at those steps. Rank 0 also returns the plain-torch reference under ``"reference"``.
    """
    import partita
    from partita import comm
    from partita.utils import safe_get_full_fp32_param

    # One intra-op thread: these models are far too small to gain from more, and on a busy
    # machine idle-spinning threads cost seconds per case. The reference runs in this process
    # too, so it computes with the same thread count as the engine either way.
    torch.set_num_threads(1)
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make_model()
    config = engine_config(precision, stage, fp16)
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    armed = [False]
    if inject is not None and inject[0] == rank:
        next(engine.module.parameters()).register_hook(_inf_hook(armed))
    losses, scales, applied = [], [], []
    for step, batch in enumerate(global_batches(steps, MICRO * world)):
        armed[0] = inject is not None and step in inject[1]
        scales.append(engine.cur_scale)
        loss = engine(*rank_micro_batch(batch, rank, world, MICRO, 0))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        applied.append(engine.was_step_applied())
    params = list(engine.module.parameters())
    with partita.zero.GatheredParameters(params):
        weights = [p.detach().clone() for p in params]
    masters = [safe_get_full_fp32_param(p) for p in params]
    result: dict[str, Any] = {
        "losses": losses,
        "scales": scales,
        "final_scale": engine.cur_scale,
        "applied": applied,
        "weights": weights,
        "masters": masters,
    }
    engine.destroy()
    if rank == 0:
        scaler = None if precision == "bf16" else RefScaler.from_config(config["fp16"])
        result["reference"] = reference_run16(DTYPES[precision], world, steps, scaler, inject)
    return result


@dataclass
class RefScaler:
    """DeepSpeed's fp16 loss scaling, stated from its documented behaviour.

    ``loss_scale > 0``: a static scale (overflowed steps are still skipped). Otherwise dynamic:
    it starts at ``2**initial_scale_power``; an overflow first spends one unit of
    ``hysteresis`` and, once one unit is left, halves the scale (not below
    ``min_loss_scale``); every ``loss_scale_window`` consecutive clean steps double the scale
    and refill the hysteresis.
    """

    scale: float
    dynamic: bool
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    hysteresis_left: int = 2
    clean_steps: int = 0

    @classmethod
    def from_config(cls, fp16: dict[str, Any]) -> RefScaler:
        """The scaler for an ``fp16`` config block (every dynamic key given explicitly)."""
        if fp16.get("loss_scale", 0) > 0:
            return cls(scale=float(fp16["loss_scale"]), dynamic=False)
        return cls(
            scale=2.0 ** fp16["initial_scale_power"],
            dynamic=True,
            window=fp16["loss_scale_window"],
            hysteresis=fp16["hysteresis"],
            min_scale=float(fp16["min_loss_scale"]),
            hysteresis_left=fp16["hysteresis"],
        )

    def update(self, overflow: bool) -> None:
        """Adjusts the scale after one step."""
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.hysteresis


def _rank_grads(
    model: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    rank: int,
    world: int,
    scale: float,
) -> tuple[float, list[torch.Tensor]]:
    """One rank's loss and 16-bit gradients: forward and backward of the 16-bit model on that
    rank's micro-batch, the fp32 loss multiplied by the loss scale before backward."""
    for p in model.parameters():
        p.grad = None
    loss = model(*rank_micro_batch(batch, rank, world, MICRO, 0))
    (loss.float() * scale if scale != 1.0 else loss).backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _average(per_rank: list[list[torch.Tensor]], world: int) -> list[torch.Tensor]:
    """Sum over ranks in 16-bit (each addition rounded to 16 bits, as a 16-bit all-reduce or
    two-rank exchange does), then the 1/world factor applied in 16-bit after the sum
    (DeepSpeed's default: no pre-division)."""
    out = []
    for i in range(len(per_rank[0])):
        total = per_rank[0][i].clone()
        for r in range(1, world):
            total.add_(per_rank[r][i])
        if world > 1:
            total.mul_(1.0 / world)
        out.append(total)
    return out


def reference_run16(
    dtype: torch.dtype,
    world: int,
    steps: int,
    scaler: RefScaler | None,
    inject: tuple[int, tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """Mixed-precision data-parallel training written with torch alone.

    A 16-bit model computes each rank's gradients; they are averaged over ranks in 16-bit,
    upcast to fp32 and divided by the loss scale; a step with any non-finite gradient is
    skipped; otherwise fused ``torch.optim.AdamW`` updates fp32 master weights, which are cast
    back into the 16-bit model (round to nearest even).
    """
    model = make_model().to(dtype)
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    losses: list[list[float]] = [[] for _ in range(world)]
    scales, applied = [], []
    for step, batch in enumerate(global_batches(steps, MICRO * world)):
        scale = 1.0 if scaler is None else scaler.scale
        scales.append(scale)
        per_rank = []
        for r in range(world):
            loss, grads = _rank_grads(model, batch, r, world, scale)
            if inject is not None and inject[0] == r and step in inject[1]:
                grads[0].view(-1)[0] = float("inf")
            losses[r].append(loss)
            per_rank.append(grads)
        for m, g in zip(masters, _average(per_rank, world), strict=True):
            m.grad = g.float().mul_(1.0 / scale) if scale != 1.0 else g.float()
        finite = all(bool(torch.isfinite(m.grad).all()) for m in masters)  # type: ignore[arg-type]
        applied.append(finite)
        if finite:
            opt.step()
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
        if scaler is not None:
            scaler.update(not finite)
    return {
        "losses": losses,
        "scales": scales,
        "final_scale": 1.0 if scaler is None else scaler.scale,
        "applied": applied,
        "weights": [p.detach().clone() for p in model.parameters()],
        "masters": masters,
    }
