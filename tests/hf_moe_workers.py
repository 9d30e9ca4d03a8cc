"""Rank-side code of tests/test_hf_moe.py: a tiny Mixtral from Transformers (built from a
config, nothing downloaded) with its experts split by `partita.moe.expert_parallel`, trained
through partita; and the one-process reference on the whole batch."""

from __future__ import annotations

from typing import Any

import torch

STEPS, SEQ, PER_RANK, SEED, LR = 3, 16, 2, 7, 1e-3
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


def batches(world: int) -> list[torch.Tensor]:
    """Each step's whole batch of token ids (world x PER_RANK sequences)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=g) for _ in range(STEPS)]


def reference(world: int, sgd: bool = False, kind: str = "mixtral") -> list[float]:
    """One process, every expert, torch's AdamW (or SGD with clipping) on the whole batch:
    the per-step losses."""
    model = mixtral(kind)
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(model.parameters(), lr=SGD_LR)
        if sgd
        else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    )
    losses = []
    for ids in batches(world):
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
    rank, world = comm.get_rank(), comm.get_world_size()
    before = comm.COUNTERS.bytes("all_to_all", "moe")
    losses = []
    for ids in batches(world):
        mine = ids[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total, tag="test")
        losses.append(total.item() / world)
    experts = model.model.layers[0].mlp.experts
    out = {
        "losses": losses,
        "local_experts": experts.gate_up_proj.shape[0] if stage < 3 else None,
        "ep_ranks": list(engine.dims.ep_ranks),
        "moe_bytes": comm.COUNTERS.bytes("all_to_all", "moe") - before,
    }
    try:
        engine.save_checkpoint("/nonexistent-partita-hf-moe")
    except NotImplementedError as error:
        out["checkpoint"] = str(error)
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


def grid(cases: list[dict[str, Any]]) -> list[Any]:
    """Every case in one set of processes (``{"refused": section}``: `refused`)."""
    return [refused(c["refused"]) if "refused" in c else train(**c) for c in cases]
