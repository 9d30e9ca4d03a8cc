"""Models and per-rank workers of tests/test_tiling.py: a tiled net (`TiledLinear`, `TiledMLP`,
`TiledFusedLogitsLoss`) trained by partita at 2 ranks, and its untiled twin trained by one
process with torch.optim on the same samples."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import partita
from partita.tiling import TiledFusedLogitsLoss, TiledLinear, TiledMLP

H, W, V = 6, 10, 7  # hidden, MLP width, vocabulary
SEQ = 12
STEPS = 4
LR = 0.1  # SGD: a gradient's error moves a weight by lr * error, no amplification
WORLD = 2
SHARDS = 5  # 12 tokens in shards of 3: the cut torch.chunk makes (4 shards, even)


class MLP(nn.Module):
    """A position-wise MLP; `shards` > 1 runs it as `TiledMLP`."""

    def __init__(self, shards: int = 1) -> None:
        super().__init__()
        self.up = nn.Linear(H, W)
        self.down = nn.Linear(W, H)
        self.shards = shards

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shards == 1:
            return self.plain(x)
        return TiledMLP.apply(MLP.plain, self, x, self.shards, None)  # type: ignore[no-any-return]


def head_loss_sum(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The LM head and the summed cross-entropy of a shard of tokens."""
    logits = head(x)
    return nn.functional.cross_entropy(logits.view(-1, V), y.reshape(-1), reduction="sum")


class Net(nn.Module):
    """in-projection, two MLPs, LM head + token-mean cross-entropy. `tiled`: the projection and
    the head are `TiledLinear`s, the MLPs `TiledMLP`s and the loss `TiledFusedLogitsLoss` (its
    sum divided by the token count here, so the incoming gradient is not 1)."""

    def __init__(
        self, tiled: bool, dtype: torch.dtype = torch.float32, parts: str = "linear,mlp,loss"
    ) -> None:
        super().__init__()
        shards = SHARDS if tiled and "mlp" in parts else 1
        if tiled and "linear" in parts:
            self.proj: nn.Module = TiledLinear(H, H, in_splits=2, out_splits=3)
            self.head: nn.Module = TiledLinear(H, V, bias=False, in_splits=3, out_splits=2)
        else:
            self.proj = nn.Linear(H, H)
            self.head = nn.Linear(H, V, bias=False)
        self.mlps = nn.ModuleList([MLP(shards), MLP(shards)])
        self.tiled = tiled and "loss" in parts
        self.to(dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for mlp in self.mlps:
            h = h + mlp(h)
        tokens = y.numel()
        if not self.tiled:
            return head_loss_sum(self.head, h, y) / tokens
        total = TiledFusedLogitsLoss.apply(
            head_loss_sum, self.head, h, y, None, SHARDS, None, "sum"
        )
        return total / tokens  # type: ignore[no-any-return]


def untiled_state(tiled: Net) -> dict[str, torch.Tensor]:
    """`tiled`'s parameters as the untiled `Net`'s state dict (tiles put back together)."""
    state = {k: v for k, v in tiled.state_dict().items() if ".linears." not in k}
    for name in ("proj", "head"):
        layer = getattr(tiled, name)
        if not isinstance(layer, TiledLinear):
            continue
        state[f"{name}.weight"] = torch.cat(
            [torch.cat([t.weight for t in row], dim=1) for row in layer.linears], dim=0
        )
        if layer.use_bias:
            state[f"{name}.bias"] = torch.cat([row[-1].bias for row in layer.linears])
    return state


def make_pair(dtype: torch.dtype, parts: str = "linear,mlp,loss") -> tuple[Net, Net]:
    """An untiled net and a tiled one (its `parts` tiled) with the same weights
    (`TiledLinear.copy_params_from`)."""
    torch.manual_seed(0)
    plain = Net(tiled=False, dtype=dtype)
    tiled = Net(tiled=True, dtype=dtype, parts=parts)
    for name in ("proj", "head"):
        layer = getattr(tiled, name)
        if isinstance(layer, TiledLinear):
            layer.copy_params_from(getattr(plain, name))
        else:
            layer.load_state_dict(getattr(plain, name).state_dict())
    tiled.mlps.load_state_dict(plain.mlps.state_dict())
    return plain, tiled


def samples(count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` sequences of inputs ``[count, SEQ, H]`` and targets ``[count, SEQ]``."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(count, SEQ, H, generator=gen, dtype=torch.float64).to(dtype)
    return x, torch.randint(0, V, (count, SEQ), generator=gen)


def reference(dtype: torch.dtype, gas: int) -> dict[str, Any]:
    """The untiled net, one process, torch.optim.SGD, the whole global batch (2 sequences per
    rank) each step."""
    plain, _ = make_pair(dtype)
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = samples(2 * WORLD * (step + 1), dtype)
        x, y = x[-2 * WORLD :], y[-2 * WORLD :]
        loss = plain(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    del gas  # the global batch is the same however it is cut into micro-batches
    return {"losses": losses, "state": plain.state_dict()}


def train(stage: int, gas: int, dtype: str, parts: str = "linear,mlp,loss") -> dict[str, Any]:
    """The tiled net at `stage` on this rank's 2 sequences per step (in `gas` micro-batches):
    the mean loss over ranks per step, the final weights as the untiled net's state, and each
    ZeRO-3 unit's (name, elements)."""
    torch_dtype = getattr(torch, dtype)
    _, tiled = make_pair(torch_dtype, parts)
    cfg = {
        "train_micro_batch_size_per_gpu": 2 // gas,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
    }
    engine, _, _, _ = partita.initialize(model=tiled, config=cfg)
    rank, losses = dist.get_rank(), []
    for step in range(STEPS):
        x, y = samples(2 * WORLD * (step + 1), torch_dtype)
        x, y = x[-2 * WORLD :][2 * rank : 2 * rank + 2], y[-2 * WORLD :][2 * rank : 2 * rank + 2]
        mean = torch.zeros((), dtype=torch.float64)
        for m in range(gas):
            part = slice(m * (2 // gas), (m + 1) * (2 // gas))
            loss = engine(x[part], y[part])
            engine.backward(loss)
            engine.step()
            mean += loss.detach().double() / gas
        dist.all_reduce(mean)
        losses.append((mean / WORLD).item())
    units = [
        (u.name, sum(p.numel() for p in u.params)) for u in getattr(engine.strategy, "units", [])
    ]
    out = {"losses": losses, "state": _gathered_state(engine.module, stage), "units": units}
    engine.destroy()
    return out


def _gathered_state(module: Net, stage: int) -> dict[str, torch.Tensor]:
    from partita.zero.gather import GatheredParameters

    params = list(module.parameters())
    with GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        return {k: v.detach().clone() for k, v in untiled_state(module).items()}


def gathers(parts: str) -> list[tuple[str, int]]:
    """ZeRO-3 units gathered in one step's backward, with the elements live after each, when
    the net's `parts` are tiled; units are released as soon as used (reuse distance 0, no
    prefetch) so that every gather shows."""
    _, net = make_pair(torch.float32, parts)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {**zero, "stage3_prefetch_bucket_size": 0},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = partita.initialize(model=net, config=cfg)
    x, y = samples(2 * WORLD, torch.float32)
    rank = dist.get_rank()
    scheduler = engine.strategy.scheduler
    loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
    start = len(scheduler.gathers)
    engine.backward(loss)
    out = list(scheduler.gathers[start:])
    engine.destroy()
    return out


def copy_under_zero3() -> dict[str, dict[str, torch.Tensor]]:
    """`TiledLinear.copy_params_from` on a model already sharded by ZeRO-3, every rank passing
    a different source (rank 0's unshifted, the others' shifted by their rank): the tiles
    gathered afterwards, put together (``got``), and rank 0's source (``want``)."""
    from partita.zero.gather import GatheredParameters

    torch.manual_seed(0)
    tiled = TiledLinear(H, V, in_splits=3, out_splits=2)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    engine, _, _, _ = partita.initialize(model=tiled, config=cfg)
    source = nn.Linear(H, V)  # the same on every rank (same seed), until shifted
    want = {"weight": source.weight.detach().clone(), "bias": source.bias.detach().clone()}
    with torch.no_grad():
        for p in source.parameters():
            p.add_(dist.get_rank())
    tiled.copy_params_from(source)
    with GatheredParameters(list(tiled.parameters())):
        weight = torch.cat([torch.cat([t.weight for t in row], 1) for row in tiled.linears], 0)
        bias = torch.cat([row[-1].bias for row in tiled.linears])
        out = {"weight": weight.detach().clone(), "bias": bias.detach().clone()}
    engine.destroy()
    return {"got": out, "want": want}


def tiling_grid(kind: str, **kwargs: Any) -> Any:
    """One case of the grid: ``train``, ``gathers`` or ``copy`` with its arguments."""
    return {"train": train, "gathers": gathers, "copy": copy_under_zero3}[kind](**kwargs)
