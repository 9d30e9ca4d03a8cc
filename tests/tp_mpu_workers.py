"""Rank workers for tests/test_tp_mpu_norm.py: a Megatron-style tensor-parallel block trained
by the engine with a DeepSpeed/Megatron ``mpu`` (tensor parallel 2 x data parallel 2).

The block is LayerNorm -> column-parallel Linear -> tanh -> row-parallel Linear -> bias. Each
tensor rank holds half of the column layer's output rows (weight and bias) and half of the
row layer's input columns; the LayerNorm and the bias after the row layer are replicated on
both tensor ranks (no attribute, as Megatron leaves them). The one-process reference is the
same block whole (the slices concatenated), trained with ``torch.optim.AdamW`` and
``torch.nn.utils.clip_grad_norm_`` on the same global batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import partita
from engine_workers import _full_params
from partita import comm

TP = 2
DIM, HIDDEN = 8, 16
MICRO = 4
STEPS = 4
LR = 1e-2
WEIGHT_DECAY = 0.01
CLIP = 0.05
"""Below every step's gradient norm (the reference asserts it), so clipping acts each step."""
REPLICATED = (0, 1, 2)
"""Indices in ``parameters()`` order of the parameters both tensor ranks hold whole."""
INF_STEP = 1
"""The fp16 case's step (0-based) whose gradient gets an inf on one tensor rank."""


class _Mpu:
    """A Megatron ``parallel_state``-style model-parallel unit over `ParallelDims` groups."""

    def __init__(self, dims: comm.ParallelDims) -> None:
        self.dims = dims

    def get_data_parallel_group(self) -> Any:
        return self.dims.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dims.dp_world_size

    def get_data_parallel_rank(self) -> int:
        return self.dims.dp_rank

    def get_tensor_model_parallel_group(self) -> Any:
        return self.dims.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.dims.tp_world_size

    def get_tensor_model_parallel_rank(self) -> int:
        return self.dims.tp_rank

    # No pipeline stages: the model-parallel group is the tensor-parallel group.
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


class _CopyToTensorRanks(torch.autograd.Function):
    """Identity forward; the input gradient is summed over the tensor ranks (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorRanks(torch.autograd.Function):
    """Partial outputs summed over the tensor ranks; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class FullBlock(nn.Module):
    """The whole block (the reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.col = nn.Linear(DIM, HIDDEN)
        self.row = nn.Linear(HIDDEN, DIM, bias=False)
        self.bias = nn.Parameter(torch.zeros(DIM))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.row(torch.tanh(self.col(self.norm(x)))) + self.bias
        return nn.functional.mse_loss(out.float(), y)


class TensorParallelBlock(nn.Module):
    """Tensor rank `tp_rank`'s part of `FullBlock` (same parameter order)."""

    def __init__(self, full: FullBlock, tp_rank: int, group: Any) -> None:
        super().__init__()
        self.group = group
        rows = slice(tp_rank * HIDDEN // TP, (tp_rank + 1) * HIDDEN // TP)
        self.norm = nn.LayerNorm(DIM)
        self.norm.load_state_dict(full.norm.state_dict())
        self.col = nn.Linear(DIM, HIDDEN // TP)
        self.row = nn.Linear(HIDDEN // TP, DIM, bias=False)
        self.bias = nn.Parameter(full.bias.detach().clone())
        with torch.no_grad():
            self.col.weight.copy_(full.col.weight[rows])
            self.col.bias.copy_(full.col.bias[rows])
            self.row.weight.copy_(full.row.weight[:, rows])
        # Both spellings DeepSpeed reads (`is_model_parallel_parameter`).
        self.col.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.col.bias.model_parallel = True  # type: ignore[attr-defined]
        self.row.weight.tensor_model_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = _CopyToTensorRanks.apply(self.norm(x), self.group)
        partial = self.row(torch.tanh(self.col(h)))
        out = _ReduceFromTensorRanks.apply(partial, self.group) + self.bias
        return nn.functional.mse_loss(out.float(), y)


def full_slices(full: FullBlock, tp_rank: int) -> list[torch.Tensor]:
    """Tensor rank `tp_rank`'s slices of the whole block, in `TensorParallelBlock`'s
    ``parameters()`` order (its own ``bias`` first, then the submodules')."""
    rows = slice(tp_rank * HIDDEN // TP, (tp_rank + 1) * HIDDEN // TP)
    return [
        t.detach().clone()
        for t in (
            full.bias,
            full.norm.weight,
            full.norm.bias,
            full.col.weight[rows],
            full.col.bias[rows],
            full.row.weight[:, rows],
        )
    ]


def _model() -> FullBlock:
    torch.manual_seed(0)
    full = FullBlock()
    with torch.no_grad():  # not the identity: the LayerNorm's gradients matter too
        full.norm.weight.uniform_(0.5, 1.5)
        full.norm.bias.uniform_(-0.5, 0.5)
        full.bias.uniform_(-0.5, 0.5)
    return full


def _batches(dp_world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    n = MICRO * dp_world
    return [
        (torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen))
        for _ in range(STEPS)
    ]


def reference() -> dict[str, Any]:
    """The whole block on the global batches: pre-clip norms and the weights after the steps."""
    full = _model()
    opt = torch.optim.AdamW(full.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    norms = []
    for x, y in _batches(dims_dp_world()):
        opt.zero_grad()
        full(x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(full.parameters(), CLIP)))
        opt.step()
    return {"norms": norms, "slices": [full_slices(full, r) for r in range(TP)]}


def dims_dp_world() -> int:
    return comm.get_world_size() // TP


def _config(stage: int, fp16: bool, nvme: str | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 64}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    if nvme is not None:  # swapped sub-groups of 40 elements: replicated and split ones mixed
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme}, sub_group_size=40)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if fp16:
        # hysteresis 1: the first overflow halves the scale.
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    return config


def _train(
    dims: comm.ParallelDims,
    stage: int,
    fp16: bool = False,
    inf_in: str = "col.weight",
    nvme: str | None = None,
) -> dict[str, Any]:
    """The engine on this rank's slices and its data-parallel share of each global batch; in
    fp16 the gradient of parameter `inf_in` gets an inf at step `INF_STEP` on one rank."""
    tp_rank, dp_rank, dp_world = dims.tp_rank, dims.dp_rank, dims.dp_world_size
    model = TensorParallelBlock(_model(), tp_rank, dims.tp_group)
    config = _config(stage, fp16, nvme)
    engine = partita.initialize(model=model, config=config, mpu=_Mpu(dims))[0]
    inject = [False]
    if fp16 and (tp_rank, dp_rank) == (1, 0):  # one rank of the four sees an inf

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not inject[0]:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        model.get_parameter(inf_in).register_hook(hook)
    out: dict[str, Any] = {"norms": [], "scales": [], "skipped": [], "params": []}
    for step, (x, y) in enumerate(_batches(dp_world)):
        inject[0] = step == INF_STEP
        rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
        xs, ys = x[rows].to(engine.device), y[rows].to(engine.device)
        if fp16:
            xs = xs.half()
        loss = engine(xs, ys)
        engine.backward(loss)
        engine.step()
        out["norms"].append(engine.get_global_grad_norm())
        out["scales"].append(engine.loss_scaler.scale)
        out["skipped"].append(engine.skipped_steps)
        out["params"].append(_full_params(engine))
    out["dims"] = (engine.dims.tp_rank, engine.dims.tp_world_size, dp_rank, dp_world)
    engine.destroy()
    return out


def tp_mpu_worker(cases: list[dict[str, Any]], nvme: str) -> dict[str, Any]:
    """Every case (`_train`'s keyword arguments; ``nvme: True`` swaps the optimizer state to
    a folder under `nvme`), one after the other, on tp 2 x dp 2 (rank = dp_rank * 2 +
    tp_rank); and the reference (the same on every rank)."""
    dims = comm.ParallelDims.tensor_parallel(TP)
    runs = []
    for case in cases:
        runs.append(_train(dims, **{**case, "nvme": nvme if case.get("nvme") else None}))
    return {
        "tp_rank": dims.tp_rank,
        "reference": reference(),
        "runs": runs,
        "refused": _refused_mpus(dims),
    }


def _refused_mpus(dims: comm.ParallelDims) -> list[str]:
    """`ParallelDims.from_mpu`'s errors for two inconsistent mpus: one whose tensor size does
    not match its group, one whose tensor group is its data-parallel group."""
    liar, same = _Mpu(dims), _Mpu(dims)
    liar.get_tensor_model_parallel_world_size = lambda: 4  # type: ignore[method-assign]
    same.get_tensor_model_parallel_group = lambda: dims.dp_group  # type: ignore[method-assign]
    same.get_tensor_model_parallel_rank = lambda: dims.dp_rank  # type: ignore[method-assign]
    errors = []
    for mpu in (liar, same):
        try:
            comm.ParallelDims.from_mpu(mpu)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors
