"""Rank-side code of tests/test_moe.py: DeepSpeed's MoE tutorial shape (dense layers around a
``deepspeed.moe.layer.MoE`` of small MLP experts, loss = task loss + COEF * l_aux) trained by
the engine with experts split over expert-parallel ranks, and the one-process reference that
holds every expert, written with plain torch."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import partita
from partita.comm import COUNTERS
from partita.compat.deepspeed.moe.layer import MoE
from partita.compat.deepspeed.moe.utils import (
    split_params_into_different_moe_groups_for_optimizer,
)
from partita.config import ConfigError
from partita.utils import safe_get_full_grad

IN, DIM, FF, CLASSES, EXPERTS = 6, 8, 64, 5, 4
TOKENS = 6  # tokens per sequence
MICRO = 2  # sequences per rank and step
STEPS = 4
LR = 1e-2
SGD_LR = 0.5
COEF = 0.01
SEED = 1234


class Net(nn.Module):
    """fc1 -> MoE of MLP experts (with a residual dense MLP when `residual`) -> fc2."""

    def __init__(
        self,
        ep: int,
        k: int,
        residual: bool = False,
        experts: int = EXPERTS,
        moe_cls: Any = MoE,
        drop: bool = False,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, DIM)
        expert = nn.Sequential(nn.Linear(DIM, FF), nn.ReLU(), nn.Linear(FF, DIM))
        self.moe = moe_cls(
            hidden_size=DIM, expert=expert, num_experts=experts, ep_size=ep, k=k,
            min_capacity=0, drop_tokens=drop, use_residual=residual, use_rts=False,
            top2_2nd_expert_sampling=False,
        )  # fmt: skip
        self.fc2 = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(torch.relu(self.fc1(x)))
        return F.cross_entropy(self.fc2(h).reshape(-1, CLASSES), y.reshape(-1)) + COEF * l_aux


def data(steps: int, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][rank] -> (x [MICRO, TOKENS, IN], y [MICRO, TOKENS])``, the same everywhere."""
    g = torch.Generator().manual_seed(7)
    return [
        [
            (
                torch.randn(MICRO, TOKENS, IN, generator=g),
                torch.randint(0, CLASSES, (MICRO, TOKENS), generator=g),
            )
            for _ in range(world)
        ]
        for _ in range(steps)
    ]


def config(stage: int, clip: float, sgd: bool) -> dict[str, Any]:
    """One micro-batch of MICRO sequences per rank and step."""
    opt = {"type": "SGD", "params": {"lr": SGD_LR}} if sgd else {
        "type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}
    }  # fmt: skip
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": opt,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
        "gradient_clipping": clip,
        "steps_per_print": 1000,
    }


def train(
    ep: int,
    stage: int,
    k: int = 1,
    residual: bool = False,
    clip: float = 0.0,
    sgd: bool = False,
    split: bool = True,
    drop: bool = False,
) -> dict[str, Any]:
    """This rank's per-step losses (it trains on micro-batch `rank` of each step), the
    expert groups it saw and the size of its optimizer state."""
    torch.manual_seed(SEED)
    model = Net(ep, k, residual, drop=drop)
    params: Any = model.parameters()
    if split:  # the tutorial's way: expert parameters in their own optimizer groups
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"}
        )
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=params, config=config(stage, clip, sgd)
    )
    rank, world = engine.dims.rank, engine.dims.world_size
    losses, grads, moved = [], [], []
    expert = model.moe.deepspeed_moe.experts.deepspeed_experts[0][0]
    for batch in data(STEPS, world):
        x, y = batch[rank]
        before = COUNTERS.bytes("all_to_all", "moe")
        loss = engine(x, y)
        engine.backward(loss)
        # bytes sent by all-to-alls this step, and the dispatch buffer's size
        buffer = EXPERTS * model.moe.deepspeed_moe.capacity * DIM * 4
        moved.append((COUNTERS.bytes("all_to_all", "moe") - before, buffer))
        grads.append(safe_get_full_grad(expert.weight).tolist())  # this rank's first expert
        engine.step()
        losses.append(loss.item())
    out = {
        "all_to_all": moved,
        "expert_grads": grads,
        "losses": losses,
        "ep_ranks": list(engine.dims.ep_ranks),
        "edp_ranks": list(engine.dims.edp_ranks),
        "state_numel": state_numel(engine.optimizer),
    }
    engine.destroy()
    return out


def state_numel(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Elements of AdamW's first moment this rank holds, for the expert parameter groups
    (``moe`` set by the split) and the dense ones."""
    out = {"expert": 0, "dense": 0}
    for group in optimizer.param_groups:
        kind = "expert" if group.get("moe") else "dense"
        moments = (optimizer.state[p].get("exp_avg") for p in group["params"])
        out[kind] += sum(m.numel() for m in moments if m is not None)  # none under SGD
    return out


def refusal(what: str) -> str:
    """The error a bad MoE set-up raises (its type and message), before any collective."""
    try:
        if what == "experts_not_divisible":
            Net(ep=2, k=1, experts=3)
        elif what == "k_too_large":
            Net(ep=1, k=5)
        elif what == "ep_not_dividing":
            torch.manual_seed(SEED)
            partita.initialize(model=Net(ep=3, k=1, experts=3), config=config(0, 0.0, False))
        elif what == "stage3_zeropp":
            cfg = config(3, 0.0, False)
            cfg["zero_optimization"]["zero_quantized_weights"] = True
            partita.initialize(model=Net(ep=2, k=1), config=cfg)
    except (ValueError, ConfigError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _run(engine: Any, world: int, rank: int) -> list[float]:
    """Per-step losses of `engine` training on micro-batch `rank` of each step."""
    losses = []
    for batch in data(STEPS, world):
        loss = engine(*batch[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def gating_mismatches() -> list[str]:
    """The gating calls whose outputs differ between DeepSpeed's ``sharded_moe`` and partita's
    (each pair on the same random draws: RTS, Gumbel noise): top-1 with and without RTS and
    RSample, top-2 with and without second-expert sampling, top-k by probability and position,
    with drops and dropless, dense and sparse routes."""
    import deepspeed.moe.sharded_moe as theirs

    from partita.compat.deepspeed.moe import sharded_moe as ours

    calls: list[tuple[str, Any, Any, dict[str, Any]]] = []
    for drop in (True, False):
        for sparse in (False, True):
            common = {"drop_tokens": drop, "sparse_routes": sparse}
            calls += [
                ("top1", theirs.top1gating, ours.top1gating, {"use_rts": True, **common}),
                ("top1-rsample", theirs.top1gating, ours.top1gating,
                 {"noisy_gate_policy": "RSample", "use_rts": False, **common}),
                ("top2", theirs.top2gating, ours.top2gating, common),
                ("top2-greedy", theirs.top2gating, ours.top2gating,
                 {"top2_2nd_expert_sampling": False, **common}),
            ]  # fmt: skip
    bad = []
    for seed in range(4):
        logits = torch.randn(24, 6, generator=torch.Generator().manual_seed(seed))
        for name, a, b, kwargs in calls:
            torch.manual_seed(seed)
            want = a(logits.clone(), 0.5, 2, **kwargs)
            torch.manual_seed(seed)
            got = b(logits.clone(), 0.5, 2, **kwargs)
            if not _same(want, got):
                bad.append(f"{name} {kwargs} seed {seed}")
        for policy in ("probs", "position"):
            want = theirs.topkgating(logits.clone(), 3, 0.5, 2, drop_policy=policy)
            got = ours.topkgating(logits.clone(), 3, 0.5, 2, drop_policy=policy)
            if not _same(want, got):
                bad.append(f"top3 {policy} seed {seed}")
    return bad


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Equal element by element (tensors bitwise, with their dtypes' values)."""
    return len(a) == len(b) and all(
        torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b, strict=True)
    )


def deepspeed_then_partita(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case trained by real DeepSpeed (0.19.8, CPU, gloo: its own ``MoE`` layer and
    ``split_params_into_different_moe_groups_for_optimizer``), then by partita, in the same
    processes, both with torch's fused AdamW as the client optimizer (DeepSpeed's config Adam
    would compile its CPU kernel): both runs' per-step losses."""
    import deepspeed
    from deepspeed.moe.layer import MoE as DSMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    assert "partita" not in (deepspeed.__file__ or ""), "not DeepSpeed itself"
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out: list[dict[str, Any]] = [{"gating_mismatches": gating_mismatches()}]
    for case in cases:
        runs = {}
        for name, init, moe_cls, splitter in (
            ("deepspeed", deepspeed.initialize, DSMoE, split),
            (
                "partita",
                partita.initialize,
                MoE,
                split_params_into_different_moe_groups_for_optimizer,
            ),
        ):
            torch.manual_seed(SEED)
            model = Net(case["ep"], case["k"], moe_cls=moe_cls)
            groups = splitter({"params": list(model.parameters()), "name": "parameters"})
            opt = torch.optim.AdamW(groups, lr=LR, weight_decay=0.01, fused=True)
            cfg = config(case["stage"], 0.0, False)
            del cfg["optimizer"]
            engine, *_ = init(model=model, optimizer=opt, config=cfg)
            runs[name] = _run(engine, world, rank)
            engine.destroy()
        out.append(runs)
    return out


def capacity_reference(world: int, k: int) -> list[list[float]]:
    """``[step][rank]`` losses of one process running the same MoE layer at ep 1 with token
    drops (capacity factor 1: DeepSpeed's rule, per micro-batch as in the sharded run) over
    every rank's micro-batch, stepping on their mean with torch's AdamW."""
    torch.manual_seed(SEED)
    model = Net(1, k, drop=True)  # the experts are copies of one: the same weights as at ep > 1
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    out = []
    for batch in data(STEPS, world):
        losses = [model(x, y) for x, y in batch]
        torch.stack(losses).mean().backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        out.append([loss.item() for loss in losses])
    return out


def consolidated(ep: int, stage: int) -> dict[str, Any]:
    """Two steps at `ep` and ZeRO `stage`, then `consolidated_16bit_state_dict` loaded strictly
    into `Net(ep=1)` (every expert) on rank 0: its loss on a batch every rank also runs
    through the engine, and the engine's."""
    torch.manual_seed(SEED)
    model = Net(ep, 1)
    engine, _, _, _ = partita.initialize(model=model, config=config(stage, 0.0, False))
    rank, world = engine.dims.rank, engine.dims.world_size
    for batch in data(2, world):
        engine.backward(engine(*batch[rank]))
        engine.step()
    x, y = data(1, world)[0][0]  # the same batch on every rank
    engine.eval()
    with torch.no_grad():
        distributed = engine(x, y).item()
    state = engine.consolidated_16bit_state_dict()
    engine.destroy()
    if state is None:
        return {"distributed": distributed}
    whole = Net(1, 1)
    whole.load_state_dict(state, strict=True)
    whole.eval()
    with torch.no_grad():
        loss = whole(x, y).item()
    return {"distributed": distributed, "whole": loss, "experts": len(state)}


def moe_grid(kind: str, **kwargs: Any) -> Any:
    """One case of the grid: ``train``, ``refusal`` or ``consolidated``."""
    return {"train": train, "refusal": refusal, "consolidated": consolidated}[kind](**kwargs)


class Reference(nn.Module):
    """The same model holding every expert, in plain torch: top-k softmax gating, each chosen
    expert run on the tokens routed to it, outputs weighted by the (renormalised) gates."""

    def __init__(self, k: int, residual: bool) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.k = k
        self.fc1 = nn.Linear(IN, DIM)
        expert = nn.Sequential(nn.Linear(DIM, FF), nn.ReLU(), nn.Linear(FF, DIM))
        self.wg = nn.Linear(DIM, EXPERTS, bias=False)
        # Copies draw no random numbers: the next layers start from the same weights.
        self.experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(EXPERTS)])
        self.residual = expert if residual else None
        self.coefficient = nn.Linear(DIM, 2) if residual else None
        self.fc2 = nn.Linear(DIM, CLASSES)

    def moe(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixture's output and this micro-batch's l_aux."""
        tokens = h.reshape(-1, DIM)
        gates = F.softmax(tokens @ self.wg.weight.t(), dim=1)
        top = torch.topk(gates, self.k, dim=1).indices  # distinct gates: ties do not occur
        first = F.one_hot(top[:, 0], EXPERTS).float()
        balance = gates.mean(0) * first.mean(0)
        l_aux = balance.sum() * EXPERTS if self.k == 1 else balance.mean() * EXPERTS**2
        chosen = gates.gather(1, top)
        weights = chosen if self.k == 1 else chosen / chosen.sum(1, keepdim=True)
        out = torch.zeros_like(tokens)
        for r in range(self.k):
            for e, expert in enumerate(self.experts):
                rows = (top[:, r] == e).nonzero().flatten()
                if len(rows):
                    part = expert(tokens[rows]) * weights[rows, r : r + 1]
                    out = out.index_add(0, rows, part)
        out = out.reshape(h.shape)
        if self.residual is not None:
            assert self.coefficient is not None
            mix = F.softmax(self.coefficient(h), dim=-1)
            out = out * mix[..., 0:1] + self.residual(h) * mix[..., 1:]
        return out, l_aux

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux = self.moe(torch.relu(self.fc1(x)))
        return F.cross_entropy(self.fc2(h).reshape(-1, CLASSES), y.reshape(-1)) + COEF * l_aux


def reference(
    world: int, k: int = 1, residual: bool = False, clip: float = 0.0, sgd: bool = False
) -> list[list[float]]:
    """``[step][rank]`` losses of one process that computes every rank's micro-batch loss
    (each micro-batch gated on its own: capacity and l_aux are per rank) and steps on their
    mean, which is what the ranks' averaged gradients are the gradient of."""
    model = Reference(k, residual)
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=SGD_LR)
        if sgd
        else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    )
    out = []
    for batch in data(STEPS, world):
        losses = [model(x, y) for x, y in batch]
        torch.stack(losses).mean().backward()
        for p in model.parameters():  # an expert no token reached steps on zeros, as in the
            if p.grad is None:  # engine (and DeepSpeed): weight decay and moments move
                p.grad = torch.zeros_like(p)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        out.append([loss.item() for loss in losses])
    return out
