"""Per-rank bodies for the mixed-precision parity tests, and their plain-torch reference.

`mixed_case` trains a partita engine in bf16 or fp16 and, on rank 0, runs `reference_run16`:
the same training written with torch alone (no partita import), which the test compares with
the engine step by step. The reference is computed inside the spawned rank so it runs with the
same intra-op thread count as the engine's forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from models import global_batches, make_model, rank_micro_batch

LR = 5e-3
WEIGHT_DECAY = 0.01
MICRO = 2
BUCKET = 3000
"""reduce_bucket_size: several gradient buckets / reduction units for the tiny model."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def engine_config(
    precision: str,
    stage: int,
    fp16: dict[str, Any] | None,
    gas: int = 1,
    comm_dtype: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ds_config of a case: AdamW, micro batch 2, `gas` micro steps, no clipping; `extra`
    adds or overrides top-level keys (``prescale_gradients``, ``gradient_predivide_factor``,
    ``gradient_clipping``)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET},
        **(extra or {}),
    }
    if comm_dtype is not None:
        config["communication_data_type"] = comm_dtype
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
    gas: int = 1,
    comm_dtype: str | None = None,
    extra: dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trains the engine `steps` steps of `gas` micro steps (see `_train`); rank 0 also returns
    the plain-torch reference of the same run under ``"reference"``. `model_kwargs` go to
    `models.make_model` for both.

    `inject=(rank, steps)`: that rank's gradient of the first parameter gets an inf in element
    0 at those steps (only with ``gas=1``). `comm_dtype` sets ``communication_data_type``,
    `extra` more top-level keys (see `engine_config`).
    """
    if inject is not None and gas != 1:
        raise ValueError(f"inject={inject!r} needs gas=1, got gas={gas}")
    # One intra-op thread: these models are far too small to gain from more, and on a busy
    # machine idle-spinning threads cost seconds per case. The reference runs in this process
    # too, so it computes with the same thread count as the engine either way.
    torch.set_num_threads(1)
    config = engine_config(precision, stage, fp16, gas, comm_dtype, extra)
    result, rank, world = _train(config, steps, inject, model_kwargs or {})
    if rank == 0:
        dtype = DTYPES[precision]
        setup = RefSetup(
            dtype=dtype,
            world=world,
            gas=gas,
            comm_dtype=None if comm_dtype is None else DTYPES[comm_dtype],
            reduce_every_micro_step=stage >= 2,
            fp32_landing=stage >= 1,
            prescale=bool(config.get("prescale_gradients", False)),
            predivide=float(config.get("gradient_predivide_factor", 1.0)),
            average=config.get("gradient_allreduce_op", "mean").lower() == "mean",
            clip=float(config["gradient_clipping"]),
            model_kwargs=model_kwargs or {},
        )
        scaler = None if precision == "bf16" else RefScaler.from_config(config["fp16"])
        result["reference"] = reference_run16(setup, steps, scaler, inject)
    return result


def _train(
    config: dict[str, Any],
    steps: int,
    inject: tuple[int, tuple[int, ...]] | None,
    model_kwargs: dict[str, Any],
) -> tuple[dict[str, Any], int, int]:
    """The engine run: this rank's micro-step losses, the loss scale each step used, whether
    each step was applied, the reported gradient norms, and the final 16-bit weights and fp32
    masters (full, on every rank). Returns (result, rank, world size)."""
    # partita is imported here, not at the top, so that this module's reference half visibly
    # runs on torch alone.
    import partita
    from partita import comm
    from partita.utils import safe_get_full_fp32_param

    rank, world = comm.get_rank(), comm.get_world_size()
    gas = config["gradient_accumulation_steps"]
    model = make_model(**model_kwargs)
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    armed = [False]
    if inject is not None and inject[0] == rank:
        next(engine.module.parameters()).register_hook(_inf_hook(armed))
    out: dict[str, list[Any]] = {"losses": [], "scales": [], "applied": [], "norms": []}
    for step, batch in enumerate(global_batches(steps, MICRO * gas * world)):
        armed[0] = inject is not None and step in inject[1]
        out["scales"].append(engine.cur_scale)
        for m in range(gas):
            loss = engine(*rank_micro_batch(batch, rank, world, MICRO, m))
            engine.backward(loss)
            engine.step()
            out["losses"].append(loss.item())
        out["applied"].append(engine.was_step_applied())
        out["norms"].append(engine.get_global_grad_norm())
    params = list(engine.module.parameters())
    with partita.zero.GatheredParameters(params):
        weights = [p.detach().clone() for p in params]
    masters = [safe_get_full_fp32_param(p) for p in params]
    result = {**out, "final_scale": engine.cur_scale, "weights": weights, "masters": masters}
    engine.destroy()
    return result, rank, world


@dataclass
class RefScaler:
    """DeepSpeed's fp16 loss scaling, stated from its documented behaviour.

    ``loss_scale > 0``: a static scale (overflowed steps are still skipped). Otherwise dynamic:
    it starts at ``2**initial_scale_power``; an overflow first spends one unit of
    ``hysteresis`` and, once one unit is left, halves the scale (not below
    ``min_loss_scale``); every ``loss_scale_window`` consecutive clean steps double the scale
    and refill the hysteresis. With ``consecutive_hysteresis`` every clean step refills it, so
    only overflows in a row halve the scale.
    """

    scale: float
    dynamic: bool
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    hysteresis_left: int = 2
    clean_steps: int = 0
    consecutive: bool = False

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
            consecutive=bool(fp16.get("consecutive_hysteresis", False)),
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
        if self.consecutive:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps % self.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.hysteresis


@dataclass(frozen=True)
class RefSetup:
    """How the reference computes and averages gradients (what a partita stage does)."""

    dtype: torch.dtype
    """The model's 16-bit dtype."""
    world: int
    """Data-parallel ranks simulated."""
    gas: int = 1
    """Micro steps per optimizer step."""
    comm_dtype: torch.dtype | None = None
    """dtype the sum over ranks is taken in (None: the model's dtype)."""
    reduce_every_micro_step: bool = False
    """Stages 2-3: every micro step's gradients are averaged over ranks and accumulated in
    fp32. Stages 0-1: 16-bit gradients accumulate locally and are averaged once per step."""
    fp32_landing: bool = False
    """Stages 1-3: the averaged gradient goes into an fp32 gradient shard (the factor after the
    sum applied in `comm_dtype`). Stage 0: it goes back into the 16-bit gradient buffer (then
    the factor after the sum is applied in 16-bit)."""
    prescale: bool = False
    """DeepSpeed's ``prescale_gradients``: divide by world before the sum, nothing after."""
    predivide: float = 1.0
    """DeepSpeed's ``gradient_predivide_factor`` f: divide by f before the sum, multiply by
    f/world after it (ignored when `prescale`)."""
    clip: float = 0.0
    """Max global norm of the unscaled gradients (0: no clipping)."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of `models.make_model`."""
    average: bool = True
    """False for ``gradient_allreduce_op: "sum"``: no factor on either side of the sum."""

    @property
    def factors(self) -> tuple[float, float]:
        """(before, after): what the gradients are multiplied by around the sum."""
        if not self.average:
            return 1.0, 1.0
        if self.prescale:
            return 1.0 / self.world, 1.0
        return 1.0 / self.predivide, self.predivide / self.world


def _backward(
    model: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    rank: int,
    setup: RefSetup,
    micro: int,
    scale: float,
) -> float:
    """Forward and backward of the 16-bit model on one micro-batch of one rank (gradients
    accumulate in the model's 16-bit ``.grad``): the fp32 loss is divided by the accumulation
    steps, then multiplied by the loss scale. Returns the loss."""
    loss = model(*rank_micro_batch(batch, rank, setup.world, MICRO, micro))
    scaled = loss / setup.gas if setup.gas > 1 else loss
    if scale != 1.0:
        scaled = scaled.float() * scale
    scaled.backward()
    return loss.item()


def _average(per_rank: list[list[torch.Tensor]], setup: RefSetup) -> list[torch.Tensor]:
    """Every rank's gradients, each multiplied by the `before` factor in `comm_dtype`, summed in
    `comm_dtype` (each addition rounded to it, as an all-reduce or the two-rank exchange does),
    then multiplied by the `after` factor: in fp32 for stages 1-3, in 16-bit for stage 0 (see
    `RefSetup`). A factor of 1 is not applied."""
    comm_dtype = setup.comm_dtype or setup.dtype
    before, after = setup.factors
    out = []
    for grads in zip(*per_rank, strict=True):
        sent = [g.to(comm_dtype, copy=True) for g in grads]
        if before != 1.0:
            sent = [g.mul_(before) for g in sent]
        total = sent[0]
        for g in sent[1:]:
            total.add_(g)
        if not setup.fp32_landing:
            total = total.to(setup.dtype)
        if after != 1.0:
            total.mul_(after)
        out.append(total.float())
    return out


def _step_grads(
    model: torch.nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    setup: RefSetup,
    scale: float,
    poison: int | None,
    losses: list[list[float]],
) -> list[torch.Tensor]:
    """One optimizer step's averaged fp32 gradients (still scaled). `poison`: the rank whose
    first gradient gets an inf in element 0."""
    micro_rounds = range(setup.gas) if setup.reduce_every_micro_step else [None]
    acc = [torch.zeros(p.shape) for p in model.parameters()]
    for round_ in micro_rounds:
        per_rank = []
        for r in range(setup.world):
            for p in model.parameters():
                p.grad = None
            for m in range(setup.gas) if round_ is None else [round_]:
                losses[r].append(_backward(model, batch, r, setup, m, scale))
            grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            if r == poison:
                grads[0].view(-1)[0] = float("inf")
            per_rank.append(grads)
        for a, g in zip(acc, _average(per_rank, setup), strict=True):
            a.add_(g)
    return acc


def reference_run16(
    setup: RefSetup,
    steps: int,
    scaler: RefScaler | None,
    inject: tuple[int, tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """Mixed-precision data-parallel training written with torch alone.

    A 16-bit model computes each rank's gradients; they are averaged over ranks (see
    `_average`), upcast to fp32 and divided by the loss scale; a step with any non-finite
    gradient is skipped; otherwise the gradients are clipped (``clip_grad_norm_``, when
    `RefSetup.clip` is set) and fused ``torch.optim.AdamW`` updates fp32 master weights,
    which are cast back into the 16-bit model (round to nearest even).
    """
    model = make_model(**setup.model_kwargs).to(setup.dtype)
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    losses: list[list[float]] = [[] for _ in range(setup.world)]
    scales, applied, norms = [], [], []
    batches = global_batches(steps, MICRO * setup.gas * setup.world)
    for step, batch in enumerate(batches):
        scale = 1.0 if scaler is None else scaler.scale
        scales.append(scale)
        poison = inject[0] if inject is not None and step in inject[1] else None
        grads = _step_grads(model, batch, setup, scale, poison, losses)
        for m, g in zip(masters, grads, strict=True):
            m.grad = g.mul_(1.0 / scale) if scale != 1.0 else g
        norms.append(float(torch.nn.utils.get_total_norm(grads)))
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        applied.append(finite)
        if finite:
            if setup.clip > 0.0:
                torch.nn.utils.clip_grad_norm_(masters, setup.clip)
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
        "norms": norms,
        "weights": [p.detach().clone() for p in model.parameters()],
        "masters": masters,
    }
