"""Rank-side code of tests/test_hf_moe.py: a tiny Mixtral from Transformers (built from a
config, nothing downloaded) with its experts split by `partita.moe.expert_parallel`, trained
through partita; and the one-process reference on the whole batch."""

from __future__ import annotations

from typing import Any

import torch

STEPS, SEQ, PER_RANK, SEED, LR = 3, 16, 2, 7, 1e-3
CKPT_STEPS, SAVE_AT = 4, 2
"""Checkpoint runs: steps in all, and the step after which the checkpoint is saved."""
SGD_LR, CLIP = 0.5, 0.5
"""SGD (no normalisation hides a mis-scaled expert gradient) with clipping (reads the norm)."""
EXPERTS, TOP_K, VOCAB = 8, 2, 128


def mixtral(kind: str = "mixtral") -> torch.nn.Module:
    """The tiny MoE model every run of `kind` starts from (same seed, same weights): Mixtral,
    or Qwen3-MoE (its own router normalisation and expert sizes)."""
    import transformers as tf

    common = {
        "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": TOP_K,
        "max_position_embeddings": 64, "attn_implementation": "eager",
    }  # fmt: skip
    if kind == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **common, num_experts=EXPERTS, moe_intermediate_size=24, intermediate_size=48,
            head_dim=8, norm_topk_prob=True,
        )  # fmt: skip
        cls: Any = tf.Qwen3MoeForCausalLM
    else:
        config = tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=EXPERTS)
        cls = tf.MixtralForCausalLM
    torch.manual_seed(SEED)
    return cls(config).float()


def batches(world: int, steps: int = STEPS) -> list[torch.Tensor]:
    """Each step's whole batch of token ids (world x PER_RANK sequences)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=g) for _ in range(steps)]


def reference(
    world: int, sgd: bool = False, kind: str = "mixtral", steps: int = STEPS, freeze: bool = False
) -> list[float]:
    """One process, every expert, torch's AdamW (or SGD with clipping) on the whole batch:
    the per-step losses; `freeze` as `_engine`'s."""
    model = mixtral(kind)
    if freeze:
        model.model.layers[0].mlp.experts.down_proj.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=SGD_LR)
        if sgd
        else torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    )
    losses = []
    for ids in batches(world, steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if sgd:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(
    ep: int, stage: int, sgd: bool = False, kind: str = "mixtral", autoep: bool = False
) -> dict[str, Any]:
    """This rank's share of each step through partita at `ep` and ZeRO `stage`: the mean of
    every rank's loss per step, and what each rank holds of the experts."""
    import partita
    from partita import comm
    from partita.moe import expert_parallel

    # By the API, or by DeepSpeed's AutoEP config section (the engine splits the experts).
    model = mixtral(kind) if autoep else expert_parallel(mixtral(kind), ep)
    config = {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}}
        if sgd
        else {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": CLIP if sgd else 0.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "steps_per_print": 1000,
    }
    if autoep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    before = comm.COUNTERS.bytes("all_to_all", "moe")
    losses = _steps(engine, batches(comm.get_world_size()))
    experts = model.model.layers[0].mlp.experts
    out = {
        "losses": losses,
        "local_experts": experts.gate_up_proj.shape[0] if stage < 3 else None,
        "ep_ranks": list(engine.dims.ep_ranks),
        "moe_bytes": comm.COUNTERS.bytes("all_to_all", "moe") - before,
    }
    engine.destroy()
    return out


def _engine(ep: int, stage: int, freeze: bool = False) -> Any:
    """A fresh engine on the tiny Mixtral at `ep` (1: every expert on every rank) and ZeRO
    `stage`, AdamW; with `freeze` the first layer's stacked ``down_proj`` is frozen."""
    import partita
    from partita.moe import expert_parallel

    model = mixtral() if ep == 1 else expert_parallel(mixtral(), ep)
    if freeze:
        model.model.layers[0].mlp.experts.down_proj.requires_grad_(False)
    config = {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = partita.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _steps(engine: Any, todo: list[torch.Tensor]) -> list[float]:
    """Trains `engine` on `todo` (whole batches; this rank takes its rows): each step's mean
    loss over the ranks."""
    from partita import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for ids in todo:
        mine = ids[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total, tag="test")
        losses.append(total.item() / world)
    return losses


def resumed(folder: str, save: tuple[int, int], loads: list[tuple[int, int]]) -> dict[str, Any]:
    """Trains CKPT_STEPS steps at ``save = (ep, stage)``, saving after SAVE_AT; then for each
    ``(ep, stage)`` of `loads` a fresh engine loads that checkpoint and trains the remaining
    steps. The losses of each run, and the error a frozen stacked expert weight gives."""
    from partita import comm

    todo = batches(comm.get_world_size(), CKPT_STEPS)
    engine = _engine(*save)
    first = _steps(engine, todo[:SAVE_AT])
    engine.save_checkpoint(folder, tag="mid")
    out: dict[str, Any] = {"saved": first + _steps(engine, todo[SAVE_AT:]), "loaded": []}
    engine.destroy()
    for ep, stage in loads:
        engine = _engine(ep, stage)
        engine.load_checkpoint(folder, tag="mid")
        out["loaded"].append(_steps(engine, todo[SAVE_AT:]))
        engine.destroy()
    out["frozen"] = _frozen_round_trip(folder, save, loads, todo)
    return out


def _frozen_round_trip(
    folder: str, save: tuple[int, int], loads: list[tuple[int, int]], todo: list[torch.Tensor]
) -> dict[str, Any]:
    """With the first layer's stacked ``down_proj`` frozen: trained SAVE_AT steps at `save`,
    saved, trained on; each load layout of `loads` starts from that weight scrambled, loads the
    checkpoint and trains the remaining steps. The losses, and whether each load gave back the
    frozen rows this rank holds (against the saving run's whole weight)."""
    import partita
    from partita import comm

    def frozen(engine: Any) -> torch.Tensor:
        return engine.module.model.layers[0].mlp.experts.down_proj

    def held(engine: Any) -> torch.Tensor:  # this rank's rows (stage 3: gathered first)
        with partita.zero.GatheredParameters([frozen(engine)]):
            return frozen(engine).detach().clone()

    engine = _engine(*save, freeze=True)
    first = _steps(engine, todo[:SAVE_AT])
    engine.save_checkpoint(folder, tag="frozen")
    ep = save[0]
    whole = comm.all_gather_object(held(engine))
    group = comm.get_rank() - comm.get_rank() % ep  # this rank's expert-parallel group
    full = torch.cat(whole[group : group + ep])  # every expert's rows, in expert order
    out: dict[str, Any] = {"saved": first + _steps(engine, todo[SAVE_AT:]), "loaded": []}
    engine.destroy()
    for load_ep, stage in loads:
        engine = _engine(load_ep, stage, freeze=True)
        scramble = partita.zero.GatheredParameters([frozen(engine)], modifier_rank=0)
        with scramble, torch.no_grad():  # not the saved values: the load must bring them back
            frozen(engine).mul_(-3.0)
        engine.load_checkpoint(folder, tag="frozen")
        mine = held(engine)
        per = full.shape[0] // load_ep
        at = (comm.get_rank() % load_ep) * per
        out["loaded"].append(
            {
                "losses": _steps(engine, todo[SAVE_AT:]),
                "rows": bool(torch.equal(mine, full[at : at + per])),
            }
        )
        engine.destroy()
    return out


def refused(section: dict[str, Any]) -> str:
    """The error `initialize` raises for an AutoEP `section` on a tiny Mixtral ("" if none)."""
    import partita
    from partita.config import ConfigError

    config = {"train_micro_batch_size_per_gpu": PER_RANK, "expert_parallel": section}
    try:
        partita.initialize(model=mixtral(), config=config)
    except (ConfigError, ValueError) as error:
        return str(error)
    return ""


def consolidated(ep: int, stage: int) -> dict[str, Any]:
    """Two steps at `ep` and ZeRO `stage` (the first layer's stacked ``down_proj`` frozen,
    saved too), then the engine's consolidated 16-bit state dict loaded strictly into a model
    holding every expert, on rank 0: its loss on a batch every rank also runs through the
    engine, and the engine's."""
    from partita import comm

    engine = _engine(ep, stage, freeze=True)
    _steps(engine, batches(comm.get_world_size(), 2))
    ids = batches(1, 3)[2]  # the same sequences on every rank
    with torch.no_grad():
        distributed = engine(input_ids=ids, labels=ids).loss.item()
    state = engine.consolidated_16bit_state_dict()
    engine.destroy()
    if state is None:
        return {"distributed": distributed}
    whole = mixtral()
    whole.load_state_dict(state, strict=True)
    with torch.no_grad():
        loss = whole(input_ids=ids, labels=ids).loss.item()
    experts = whole.model.layers[0].mlp.experts
    return {"distributed": distributed, "whole": loss, "rows": experts.down_proj.shape[0]}


def grid(cases: list[dict[str, Any]]) -> list[Any]:
    """Every case in one set of processes (``{"refused": section}``: `refused`)."""
    out: list[Any] = []
    for c in cases:
        if "refused" in c:
            out.append(refused(c["refused"]))
        elif "resumed" in c:
            out.append(resumed(**c["resumed"]))
        elif "consolidated" in c:
            out.append(consolidated(**c["consolidated"]))
        else:
            out.append(train(**c))
    return out
