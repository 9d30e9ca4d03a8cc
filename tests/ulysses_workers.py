"""Rank-side code of tests/test_ulysses.py: a tiny Llama-like model (RMSNorm, rotary positions,
grouped-query attention, SwiGLU) whose attention runs through Ulysses' `DistributedAttention`,
trained by the engine with ``sequence_parallel_size``; DistributedAttention against plain
attention on the whole sequence; and the refusals."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import partita
from partita.comm import ParallelDims
from partita.config import ConfigError
from partita.parallel.ulysses import DistributedAttention, sequence_loss, shard_sequence

VOCAB, SEQ, DIM, HEADS, KV_HEADS, LAYERS = 64, 16, 32, 4, 2, 2
HEAD_DIM = DIM // HEADS
STEPS = 5
LR = 1e-3
SGD_LR = 0.1


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on ``[b, s, h, d]`` tensors, key/value heads shared by groups of query
    heads (written out, so that it runs the same in fp32 and float64 on every CPU)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = scores.shape[-1]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def rotary(positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``[s, 1, head_dim]`` for the given (global) positions."""
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


EXPERTS = 4
"""Experts per MoE layer of `TinyLlama(moe_ep=...)`."""


class ExpertMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class Block(nn.Module):
    def __init__(self, moe_ep: int | None = None) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(DIM), RMSNorm(DIM)
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.gate = nn.Linear(DIM, 2 * DIM, bias=False)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)
        self.attn: DistributedAttention | None = None  # plain attention until set
        self.moe: nn.Module | None = None
        if moe_ep is not None:  # DeepSpeed-MoE in place of the MLP: top-1, nothing dropped
            from partita.moe.layer import MoE

            self.moe = MoE(DIM, ExpertMLP(), num_experts=EXPERTS, ep_size=moe_ep, k=1,
                           drop_tokens=False)  # fmt: skip

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q = rotate(self.q(h).view(b, s, HEADS, HEAD_DIM), cos, sin)
        k = rotate(self.k(h).view(b, s, KV_HEADS, HEAD_DIM), cos, sin)
        v = self.v(h).view(b, s, KV_HEADS, HEAD_DIM)
        ctx = self.attn(q, k, v, 0) if self.attn is not None else local_attention(q, k, v)
        x = x + self.o(ctx.reshape(b, s, HEADS * HEAD_DIM))
        h = self.norm2(x)
        if self.moe is not None:
            return x + self.moe(h)[0]
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """Takes this rank's slice of the sequences (tokens, targets and their global positions)
    and returns its share of the mean cross-entropy of the whole micro-batch; under sequence
    parallelism its value is the whole micro-batch's loss on every rank of the group."""

    def __init__(self, dtype: torch.dtype = torch.float32, moe_ep: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sp_group: Any = None
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(moe_ep) for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.to(dtype)

    def set_sequence_group(self, group: Any, loss_style: str = "share") -> None:
        """Runs attention through Ulysses over `group`, the loss per `loss_style`: "share"
        (`sequence_loss` of the slice's share of the whole sequence's mean), "local_mean"
        (the mean over the slice: Megatron-DeepSpeed's scripts) or "gathered" (the slices'
        means gathered differentiably and weighted by their tokens: Transformers' Trainer)."""
        self.sp_group = group
        self.loss_style = loss_style
        for block in self.blocks:
            block.attn = DistributedAttention(local_attention, group)  # type: ignore[union-attr]

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = rotary(positions, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float().to(x.dtype)
        total = tokens.shape[0] * SEQ  # tokens of the whole micro-batch, all slices
        summed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        if self.sp_group is None:
            return summed / total
        if self.loss_style == "share":
            return sequence_loss(summed / total, self.sp_group)
        mean = summed / targets.numel()
        if self.loss_style == "local_mean":
            return mean
        from torch.distributed.nn.functional import all_gather

        count = torch.tensor(float(targets.numel()), dtype=mean.dtype)
        means, counts = all_gather(mean, self.sp_group), all_gather(count, self.sp_group)
        return sum(m * c for m, c in zip(means, counts, strict=True)) / sum(counts)


def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
        out.append((tokens, (tokens * 5 + 1) % VOCAB))
    return out


def reference(
    steps: int,
    batch: int,
    dtype: torch.dtype,
    clip: float = 0.0,
    sgd: bool = False,
    moe: bool = False,
) -> dict[str, Any]:
    """One process, whole sequences, torch's fused AdamW (what the config's AdamW runs), or
    SGD at `SGD_LR` (which shows any scaling of the gradient); `moe`: every expert here."""
    model = TinyLlama(dtype=dtype, moe_ep=1 if moe else None)
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=SGD_LR)
        if sgd
        else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    )
    losses = []
    for tokens, targets in batches(steps, batch):
        loss = model(tokens, targets, torch.arange(SEQ))
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def config(
    sp: int, stage: int, clip: float = 0.0, gas: int = 1, sgd: bool = False
) -> dict[str, Any]:
    """2 sequences per data-parallel rank and step, in `gas` micro-batches."""
    return {
        "train_micro_batch_size_per_gpu": 2 // gas,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}}
        if sgd
        else {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        "sequence_parallel_size": sp,
        "gradient_clipping": clip,  # DeepSpeed's default is 1.0
        "steps_per_print": 1000,
    }


class SequenceMpu:
    """DeepSpeed's ``parallel_state_sp`` (what ALST's ``register_with_transformers`` returns
    and passes as ``mpu=``): sequence groups of consecutive ranks, one sequence-data-parallel
    group of every rank, model-parallel getters aliased to the sequence ones, and no
    data-parallel getters."""

    def __init__(self, sp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        for start in range(0, world, sp):
            made = dist.new_group(list(range(start, start + sp)))
            if start <= rank < start + sp:
                self.sp_group = made
        self.seq_dp_group = dist.new_group(list(range(world)))

    def get_sequence_parallel_group(self) -> Any:
        return self.sp_group

    def get_sequence_data_parallel_group(self) -> Any:
        return self.seq_dp_group

    def get_sequence_parallel_world_size(self) -> int:
        return dist.get_world_size(self.sp_group)

    def get_sequence_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.seq_dp_group)

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self.sp_group)

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.seq_dp_group)

    get_model_parallel_rank = get_sequence_parallel_rank
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_group = get_sequence_parallel_group


def train(
    sp: int,
    stage: int,
    steps: int = STEPS,
    dtype: str = "float32",
    clip: float = 0.0,
    mpu: bool = False,
    gas: int = 1,
    sgd: bool = False,
    loss_style: str = "share",
    moe_ep: int | None = None,
) -> dict[str, Any]:
    """`steps` engine steps; the losses averaged over the data-parallel ranks (each rank's
    loss is its micro-batch's), the final weights, and this rank's groups. The model gets its
    sequence group from the engine (``engine.get_sequence_parallel_group()``). With `mpu`
    the groups come from a `SequenceMpu` and the config leaves ``sequence_parallel_size``
    out. `moe_ep`: MoE layers with their experts split over `moe_ep` ranks."""
    model = TinyLlama(dtype=getattr(torch, dtype), moe_ep=moe_ep)
    cfg = config(sp, stage, clip, gas, sgd)
    unit = None
    if mpu:
        unit = SequenceMpu(sp)
        del cfg["sequence_parallel_size"]
    engine, _, _, _ = partita.initialize(model=model, config=cfg, mpu=unit)
    model.set_sequence_group(engine.get_sequence_parallel_group(), loss_style)
    dims = engine.dims
    micro, dp = 2 // gas, dims.dp_world_size
    local = SEQ // sp
    positions = torch.arange(dims.sp_rank * local, (dims.sp_rank + 1) * local)
    losses = []
    for tokens, targets in batches(steps, 2 * dp):
        mean = torch.zeros((), dtype=model.head.weight.dtype)
        for m in range(gas):  # rank-major, then by micro step
            start = dims.dp_rank * 2 + m * micro
            mine = slice(start, start + micro)
            tok, tgt = (shard_sequence(t[mine], dims.sp_group) for t in (tokens, targets))
            loss = engine(tok, tgt, positions)
            engine.backward(loss)
            engine.step()
            mean += loss.detach() / gas
        dist.all_reduce(mean)  # each rank's loss: its slice's or its sequences'
        losses.append((mean / dist.get_world_size()).item())
    out = {
        "losses": losses,
        "params": _full_params(engine, stage),
        "sp_ranks": list(dims.sp_ranks),
        "dp_ranks": list(dims.dp_ranks),
        "dp_world": engine.dp_world_size,
        "zero_world": dist.get_world_size(getattr(engine.strategy, "process_group", None)),
        "groups": _deepspeed_groups(engine),
    }
    engine.destroy()
    return out


def _deepspeed_groups(engine: Any) -> list[Any]:
    """What DeepSpeed's ``groups`` getters say (the stand-in's module, imported directly)."""
    from partita.compat.deepspeed.utils import groups

    return [
        groups._get_sequence_parallel_world_size(),
        groups._get_sequence_parallel_rank(),
        groups._get_data_parallel_world_size(),
        groups._get_data_parallel_rank(),
        groups._get_sequence_data_parallel_world_size(),
        groups._get_sequence_parallel_group() is engine.get_sequence_parallel_group(),
    ]


def _full_params(engine: Any, stage: int) -> list[torch.Tensor]:
    from partita.zero.gather import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        return [p.detach().clone() for p in params]


def attention_parity(sp: int, batch_dim_idx: int, kv_heads: int) -> dict[str, Any]:
    """DistributedAttention on this rank's slice against plain attention on the whole
    sequence: the largest differences of the output slice and of the input gradients."""
    dims = ParallelDims.sequence_parallel(sp)
    group = dims.sp_group
    gen = torch.Generator().manual_seed(3)
    b, heads, d = 2, 4, 8
    shape = (b, SEQ) if batch_dim_idx == 0 else (SEQ, b)
    q = torch.randn(*shape, heads, d, generator=gen, requires_grad=True)
    k = torch.randn(*shape, kv_heads, d, generator=gen, requires_grad=True)
    v = torch.randn(*shape, kv_heads, d, generator=gen, requires_grad=True)
    w = torch.randn(*shape, heads, d, generator=gen)

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if batch_dim_idx == 1:
            return local_attention(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
        return local_attention(q, k, v)

    full = plain(q, k, v)
    (full * w).sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    for t in (q, k, v):
        t.grad = None
    seq_dim = 1 - batch_dim_idx
    attn = DistributedAttention(plain, group)
    sliced = [shard_sequence(t, group, dim=seq_dim) for t in (q, k, v, w, full)]
    out = attn(*sliced[:3], batch_dim_idx)
    (out * sliced[3]).sum().backward()
    mine = [shard_sequence(g, group, dim=seq_dim) for g in want]
    got = [shard_sequence(t.grad, group, dim=seq_dim) for t in (q, k, v)]  # type: ignore[arg-type]
    return {
        "out": (out - sliced[4]).abs().max().item(),
        "grads": [(a - b).abs().max().item() for a, b in zip(got, mine, strict=True)],
        "shape": list(out.shape),
    }


def refusal(what: str) -> str:
    """The error this rank raises for one bad input ("" when none)."""
    try:
        if what == "sp3":
            partita.initialize(model=TinyLlama(), config=config(3, 1))
        elif what == "sp8":
            partita.initialize(model=TinyLlama(), config=config(8, 1))
        elif what in ("dp_size_bad", "dp_size_ok"):
            cfg = {**config(2, 1), "data_parallel_size": 3 if what == "dp_size_bad" else 2}
            engine, _, _, _ = partita.initialize(model=TinyLlama(), config=cfg)
            engine.destroy()
        elif what in ("mpu_dp_bad", "mpu_dp_ok"):  # the groups from an mpu, the size from cfg
            cfg = {**config(2, 1), "data_parallel_size": 4 if what == "mpu_dp_bad" else 2}
            del cfg["sequence_parallel_size"]
            unit = SequenceMpu(2)
            engine, _, _, _ = partita.initialize(model=TinyLlama(), config=cfg, mpu=unit)
            engine.destroy()
        elif what == "heads":
            group = ParallelDims.sequence_parallel(4).sp_group
            x = torch.zeros(1, 4, 6, 8)  # 6 heads over 4 ranks
            DistributedAttention(local_attention, group)(x, x, x, 0)
        elif what == "kv_heads":
            group = ParallelDims.sequence_parallel(4).sp_group
            q, kv = torch.zeros(1, 4, 12, 8), torch.zeros(1, 4, 3, 8)  # 3 kv heads, sp 4
            DistributedAttention(local_attention, group)(q, kv, kv, 0)
        elif what == "seq_len":
            group = ParallelDims.sequence_parallel(2).sp_group
            shard_sequence(torch.zeros(1, 7), group)
    except (ConfigError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


RESUME_BATCH = 4
"""Sequences per step in the checkpoint cases, whatever the data-parallel size."""


def _engine(sp: int, stage: int) -> tuple[Any, TinyLlama]:
    """An engine of `RESUME_BATCH` sequences per step at `sp` over the 4 ranks."""
    model = TinyLlama()
    cfg = config(sp, stage)
    cfg["train_micro_batch_size_per_gpu"] = RESUME_BATCH // (dist.get_world_size() // sp)
    engine, _, _, _ = partita.initialize(model=model, config=cfg)
    if sp > 1:  # else plain attention over whole sequences
        model.set_sequence_group(engine.get_sequence_parallel_group())
    return engine, model


def _run(engine: Any, steps: range) -> list[float]:
    """Steps `steps` of the shared batch sequence; each the loss over every rank."""
    dims = engine.dims
    micro = RESUME_BATCH // dims.dp_world_size
    local = SEQ // dims.sp_world_size
    positions = torch.arange(dims.sp_rank * local, (dims.sp_rank + 1) * local)
    losses = []
    for tokens, targets in batches(steps.stop, RESUME_BATCH)[steps.start :]:
        mine = slice(dims.dp_rank * micro, (dims.dp_rank + 1) * micro)
        tok, tgt = tokens[mine], targets[mine]
        if dims.sp_world_size > 1:
            tok, tgt = (shard_sequence(t, dims.sp_group) for t in (tok, tgt))
        loss = engine(tok, tgt, positions)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / dist.get_world_size()).item())
    return losses


def resume(sp: int, stage: int, save_dir: str, loads: list[tuple[int, int]]) -> dict[str, Any]:
    """Trains `STEPS` steps at (`sp`, `stage`), saving a checkpoint after the second; then,
    for each (sp, stage) of `loads`, a new engine loads it and trains the remaining steps.
    The losses of every run, and each run's final weights."""
    engine, _ = _engine(sp, stage)
    first = _run(engine, range(2))
    engine.save_checkpoint(save_dir, tag="two")
    out: dict[str, Any] = {"whole": first + _run(engine, range(2, STEPS))}
    out["whole_params"] = _full_params(engine, stage)
    engine.destroy()
    for load_sp, load_stage in loads:
        engine, _ = _engine(load_sp, load_stage)
        engine.load_checkpoint(save_dir, tag="two")
        out[(load_sp, load_stage)] = _run(engine, range(2, STEPS))
        out[("params", load_sp, load_stage)] = _full_params(engine, load_stage)
        engine.destroy()
    return out


def ulysses_grid(kind: str, **kwargs: Any) -> Any:
    """One case of the grid: ``train``, ``hf``, ``attention``, ``resume`` or ``refusal``
    with its arguments."""
    kinds = {
        "train": train,
        "hf": hf_train,
        "attention": attention_parity,
        "resume": resume,
        "refusal": refusal,
    }
    return kinds[kind](**kwargs)


HF_STEPS = 3


def hf_llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny Transformers Llama (GQA: 4 heads, 2 key/value heads), random weights, SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def hf_samples(count: int) -> list[dict[str, torch.Tensor]]:
    """`count` sequences of `SEQ` tokens with labels (= the tokens) and position ids."""
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (count, SEQ), generator=gen)
    return [
        {"input_ids": t, "labels": t.clone(), "position_ids": torch.arange(SEQ)} for t in tokens
    ]


def hf_share(model: nn.Module, batch: dict[str, Any], total: int, group: Any) -> torch.Tensor:
    """This rank's share of the mean next-token loss over `total` predicted tokens (ALST's
    loss: the labels were shifted before the sequence was cut, -100 where nothing follows)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    labels = batch["shift_labels"]
    share = (
        F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        / total
    )
    return sequence_loss(share, group) if group is not None else share


def hf_reference(steps: int, world: int, dtype: torch.dtype) -> list[float]:
    """One process: every step trains on `world` whole sequences (what 4 ranks read)."""
    model = hf_llama(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    samples = hf_samples(steps * world)
    losses = []
    for step in range(steps):
        chunk = samples[step * world : (step + 1) * world]
        ids = torch.stack([s["input_ids"] for s in chunk])
        labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
        batch = {"input_ids": ids, "position_ids": torch.arange(SEQ)[None], "shift_labels": labels}
        loss = hf_share(model, batch, world * (SEQ - 1), None)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def hf_train(sp: int, stage: int, steps: int = HF_STEPS) -> dict[str, Any]:
    """ALST's path: ``register_with_transformers`` (the mpu) -> ``initialize(mpu=...)`` ->
    ``UlyssesSPDataLoaderAdapter`` over a loader that splits the sequences over every rank;
    ``gradient_accumulation_steps`` = sp (a group trains on its sp ranks' sequences in turn)."""
    from torch.utils.data import DataLoader
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from partita.comm import COUNTERS
    from partita.compat.deepspeed.runtime.sequence_parallel import parallel_state_sp
    from partita.compat.deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    world, rank = dist.get_world_size(), dist.get_rank()
    before = COUNTERS.bytes("all_to_all", "ulysses")
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = hf_llama()
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", sp, micro_batch_size=1, seq_length=SEQ, seq_length_is_variable=True
        )
        cfg = config(sp, stage, gas=sp)
        del cfg["sequence_parallel_size"]
        cfg["train_micro_batch_size_per_gpu"] = 1
        engine, _, _, _ = partita.initialize(model=model, config=cfg, mpu=mpu)
        mine = hf_samples(steps * world)[rank::world]  # a DistributedSampler's split
        loader = UlyssesSPDataLoaderAdapter(
            DataLoader(mine, batch_size=1), sp_rank=mpu.get_sequence_parallel_rank(),
            sp_group=mpu.get_sequence_parallel_group(),
            sp_world_size=mpu.get_sequence_parallel_world_size(), device="cpu",
        )  # fmt: skip
        group, dp = mpu.get_sequence_parallel_group(), engine.dp_world_size
        losses = []
        for _ in range(steps):
            mean = torch.zeros(())
            for _ in range(sp):
                batch = next(loader)
                loss = hf_share(engine, batch, SEQ - 1, group)
                engine.backward(loss)
                engine.step()
                mean += loss.detach() / sp
            dist.all_reduce(mean, group=engine.dims.dp_group)
            losses.append((mean / dp).item())
        engine.destroy()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        parallel_state_sp._release_sequence_parallel_groups()
    return {
        "losses": losses,
        "dp_world": dp,
        "sp": engine.dims.sp_world_size,
        "a2a_bytes": COUNTERS.bytes("all_to_all", "ulysses") - before,
    }


ACCEL_STEPS = 4


def accelerate_main(out: str) -> None:
    """Accelerate's own ALST path (``ParallelismConfig(sp_backend="deepspeed", sp_size=2)``,
    which calls ``register_with_transformers`` and wraps the loader in the adapter) with
    Transformers' Trainer loss (``deepspeed_sp_compute_loss``: the slices' losses gathered
    differentiably and weighted by their tokens), SGD (which shows any scaling of the
    gradient), ZeRO 2, on 2 ranks: each step trains on one
    whole sequence (the ranks read one each; the adapter makes the pair train on both in
    turn). Writes ``OUT/rank{R}.json`` with the per-step losses."""
    import json

    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    PartialState(cpu=True)
    pc = ParallelismConfig(
        sp_backend="deepspeed", sp_size=2,
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length=SEQ, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
        ),
    )  # fmt: skip
    plugin = DeepSpeedPlugin(
        hf_ds_config={
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2},
            "steps_per_print": 1000,
        }
    )
    accelerator = Accelerator(parallelism_config=pc, deepspeed_plugin=plugin)
    model = hf_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    samples = hf_samples(ACCEL_STEPS)
    loader = torch.utils.data.DataLoader(
        [{k: v for k, v in s.items()} for s in samples], batch_size=1
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for batch in loader:
        loss = deepspeed_sp_compute_loss(accelerator, model, batch, False, pc)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"losses": losses, "engine": type(model).__module__}, f)


def accelerate_reference() -> list[float]:
    """One process: each step trains on one whole sequence (plain torch SGD)."""
    model = hf_llama()
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    losses = []
    for s in hf_samples(ACCEL_STEPS):
        loss = model(input_ids=s["input_ids"][None], labels=s["labels"][None]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def trainer_main(out: str) -> None:
    """Transformers' Trainer with ``TrainingArguments(parallelism_config=...)`` (sp 2, the
    ``"deepspeed"`` backend) and a DeepSpeed config, SGD at constant `SGD_LR`, 2 ranks: each
    step trains on one whole sequence. The Trainer's own sequence-parallel loss is recorded
    as it returns it (its log rounds to 4 digits). Writes ``OUT/trainer_rank{R}.json``."""
    import json

    import transformers.trainer as trainer_module
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    losses: list[float] = []
    original = trainer_module.deepspeed_sp_compute_loss

    def recording(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        losses.append(float((result[0] if isinstance(result, tuple) else result).item()))
        return result

    trainer_module.deepspeed_sp_compute_loss = recording  # type: ignore[attr-defined]
    pc = ParallelismConfig(
        sp_backend="deepspeed", sp_size=2,
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length=SEQ, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
        ),
    )  # fmt: skip
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
    }
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, max_steps=ACCEL_STEPS,
        learning_rate=SGD_LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        deepspeed=ds_config, parallelism_config=pc, dataloader_drop_last=True, seed=0,
        train_sampling_strategy="sequential",
        data_seed=0,
    )  # fmt: skip
    model = hf_llama()
    samples = hf_samples(ACCEL_STEPS)
    trainer = Trainer(model=model, args=args, train_dataset=samples)
    trainer.train()
    with open(f"{out}/trainer_rank{dist.get_rank()}.json", "w") as f:
        json.dump({"losses": losses, "engine": type(trainer.model_wrapped).__module__}, f)


if __name__ == "__main__":
    import sys

    if sys.argv[2:] == ["trainer"]:
        trainer_main(sys.argv[1])
    else:
        accelerate_main(sys.argv[1])
