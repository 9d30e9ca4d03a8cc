"""Training loops the cases compare: partita's engine and a plain-torch reference.

The reference is what a user would write with torch alone: the module in 16-bit (or fp32),
fp32 master copies stepped by ``torch.optim.AdamW(fused=True)``, the 16-bit gradients
converted to fp32 (divided by the loss scale under fp16), a step skipped when a gradient is
not finite, and the updated masters converted back into the module. partita computes the same
update with the same kernels, so at world size 1 without clipping the two agree bitwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import partita

from .core import BETAS, EPS, LR, WEIGHT_DECAY
from .model import Shape, build

Batch = tuple[torch.Tensor, torch.Tensor]
DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}


@dataclass
class Run:
    """Per-step losses and the final weights (module dtype) and fp32 masters, on the CPU."""

    losses: list[float]
    weights: list[torch.Tensor]
    masters: list[torch.Tensor]
    applied: list[bool] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    probe: Any = None
    first_masters: list[torch.Tensor] = field(default_factory=list)
    """partita runs: the fp32 masters after the first step."""


def engine_config(
    stage: int, dtype: str, micro: int, clip: float = 0.0, **zero: Any
) -> dict[str, Any]:
    """partita's (DeepSpeed's) config for these runs: AdamW with the shared settings."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": {"stage": stage, **zero},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return config


def inject_inf(param: torch.nn.Parameter, armed: list[bool]) -> None:
    """While ``armed[0]``, one element of ``param``'s gradient becomes inf (an overflow)."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not armed[0]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    param.register_hook(hook)


def train_partita(
    shape: Shape,
    config: dict[str, Any],
    data: list[Batch],
    device: torch.device,
    overflow_at: int | None = None,
    probe: Callable[[Any], Any] | None = None,
    seed: int = 0,
) -> Run:
    """Trains one step per batch with partita; ``probe(engine)`` runs before the engine is
    destroyed (pinned-memory checks read the strategy there)."""
    model = build(shape, seed, device)
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    armed = [False]
    if overflow_at is not None:
        inject_inf(next(engine.module.parameters()), armed)
    run = Run([], [], [])
    for i, (tokens, targets) in enumerate(data):
        armed[0] = i == overflow_at
        run.scales.append(float(engine.cur_scale))
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        run.losses.append(float(loss.detach().float()))
        run.applied.append(bool(engine.was_step_applied()))
        if i == 0:
            run.first_masters = engine_state(engine)[1]
    run.weights, run.masters = engine_state(engine)
    run.probe = probe(engine) if probe is not None else None
    engine.destroy()
    return run


def engine_state(engine: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every parameter's full module-dtype value and fp32 master, on the CPU."""
    from partita.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    with partita.zero.GatheredParameters(params):
        weights = [p.detach().cpu().clone() for p in params]
    masters = [safe_get_full_fp32_param(p).detach().cpu().clone() for p in params]
    return weights, masters


class TorchTrainer:
    """The plain-torch reference (see the module doc); also the speed section's baseline."""

    def __init__(
        self, model: torch.nn.Module, dtype: torch.dtype, clip: float = 0.0, lr: float = LR
    ) -> None:
        self.model = model.to(dtype=dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        if dtype in (torch.float32, torch.float64):  # no separate master: step the module
            self.masters = self.params
        self.opt = torch.optim.AdamW(
            self.masters, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
        )
        self.clip = clip

    def step(self, batch: Batch, scale: float = 1.0) -> tuple[float, bool]:
        """One training step; returns (loss, whether the update was applied)."""
        loss = self.model(*batch)
        (loss.float() * scale if scale != 1.0 else loss).backward()
        grads = [p.grad for p in self.params]
        if self.masters is not self.params:
            for m, g in zip(self.masters, grads, strict=True):
                m.grad = g.float()
        mgrads = [m.grad for m in self.masters]
        if scale != 1.0:
            torch._foreach_mul_(mgrads, 1.0 / scale)
        norm = torch.stack(torch._foreach_norm(mgrads, 2.0)).square().sum().sqrt()
        applied = bool(torch.isfinite(norm))
        if applied:
            if self.clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.masters, self.clip, norm)
            self.opt.step()
            if self.masters is not self.params:
                with torch.no_grad():
                    torch._foreach_copy_(self.params, self.masters)
        for p in {*self.params, *self.masters}:
            p.grad = None
        return float(loss.detach()), applied  # exact for every dtype, float64 included


def train_reference(
    shape: Shape,
    dtype: str,
    data: list[Batch],
    device: torch.device,
    scales: list[float] | None = None,
    overflow_at: int | None = None,
    lr: float = LR,
    seed: int = 0,
) -> Run:
    """The plain-torch reference run on the same model, data and (fp16) loss scales."""
    model = build(shape, seed, device)
    trainer = TorchTrainer(model, DTYPES[dtype], lr=lr)
    armed = [False]
    if overflow_at is not None:
        inject_inf(trainer.params[0], armed)
    run = Run([], [], [])
    for i, batch in enumerate(data):
        armed[0] = i == overflow_at
        loss, applied = trainer.step(batch, scales[i] if scales else 1.0)
        run.losses.append(loss)
        run.applied.append(applied)
    run.weights = [p.detach().cpu().clone() for p in trainer.params]
    run.masters = [m.detach().cpu().float().clone() for m in trainer.masters]
    return run


def compare(a: Run, b: Run) -> dict[str, Any]:
    """Bitwise comparison of two runs: equal flags and the largest differences."""
    weights = all(torch.equal(x, y) for x, y in zip(a.weights, b.weights, strict=True))
    masters = all(torch.equal(x, y) for x, y in zip(a.masters, b.masters, strict=True))
    return {
        "losses_equal": a.losses == b.losses,
        "weights_equal": weights,
        "masters_equal": masters,
        "max_loss_diff": max(abs(x - y) for x, y in zip(a.losses, b.losses, strict=True)),
        "max_master_diff": max(
            float((x - y).abs().max()) for x, y in zip(a.masters, b.masters, strict=True)
        ),
        "losses": a.losses,
    }


FIRST_STEP_RTOL = 2.0**-20
"""How far (relative to |weight| + lr) one update of the same gradients may differ between two
AdamW implementations: about 16 fp32 roundings. An update from wrong or stale gradients is off
by up to lr (1e-3 of a unit weight), 1000 times more."""


def first_step_close(a: Run, b: Run) -> tuple[bool, float]:
    """Whether two partita runs' masters after their first step agree within
    `FIRST_STEP_RTOL` elementwise, and the largest ratio of a difference to its allowance.
    For runs whose optimizers round differently (partita's CPU Adam under offload against
    torch's fused CUDA AdamW): later steps can drift apart by the bf16 rounding of weights
    that sit at a rounding boundary, so only the first update is held elementwise."""
    worst = 0.0
    for x, y in zip(a.first_masters, b.first_masters, strict=True):
        allowance = FIRST_STEP_RTOL * (y.abs() + LR)
        worst = max(worst, float(((x - y).abs() / allowance).max()))
    return worst <= 1.0, worst


def bitwise(figures: dict[str, Any]) -> bool:
    """True when `compare` found losses, weights and masters all equal."""
    return figures["losses_equal"] and figures["weights_equal"] and figures["masters_equal"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seeds torch's CPU and CUDA generators (dropout masks) for the block."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    yield
