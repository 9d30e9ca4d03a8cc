"""Rank-side code of tests/test_tp_training.py: tiny Hugging Face Llama (grouped key/value
heads, an untied output head) and GPT-2 (fused QKV in Conv1D layers, a tied head) built from
small configs with random weights, trained by the engine with ``tensor_parallel.autotp_size``,
and the one-process ``torch.optim`` reference on the whole batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import partita
from partita.comm import COUNTERS
from partita.config import ConfigError

VOCAB, SEQ, MICRO, STEPS = 64, 8, 2, 3
LR = 1e-2
CLIP = 0.5
"""Below every step's whole-model gradient norm (the reference records it), so clipping acts."""
SEED = 7
"""The dropout runs' seed, set after the model is built (tensor rank t seeds SEED + t before
`initialize`, as a script seeding per rank would: the split hands every tensor rank tensor rank
0's stream)."""
DROPOUT: dict[str, dict[str, float]] = {
    "llama": {"attention_dropout": 0.25},
    "gpt2": {"attn_pdrop": 0.25, "resid_pdrop": 0.25, "embd_pdrop": 0.25},
}
"""Every dropout of the model on: attention probabilities (split by heads), and GPT-2's
embeddings and residual branches (replicated)."""


def build_model(kind: str, dropout: bool = False, **overrides: Any) -> nn.Module:
    """A tiny model of `kind` ("llama" or "gpt2"), same weights on every call; `dropout`:
    with the rates of `DROPOUT`."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model: nn.Module
    if kind == "llama":
        values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      tie_word_embeddings=False, max_position_embeddings=64)  # fmt: skip
        values.update({**(DROPOUT[kind] if dropout else {}), **overrides})
        config = LlamaConfig(**values)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config)
    else:
        values = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        values.update({**(DROPOUT[kind] if dropout else {}), **overrides})
        config = GPT2Config(**values)
        config._attn_implementation = "eager"
        model = GPT2LMHeadModel(config)
    return model.float()


def batches(dp: int) -> list[torch.Tensor]:
    """The global batch of each step: ``dp * MICRO`` sequences of token ids."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (dp * MICRO, SEQ), generator=gen) for _ in range(STEPS)]


def reference(kind: str, dp: int) -> dict[str, list[float]]:
    """One process, the whole model and batch: AdamW and clip_grad_norm_ from torch."""
    model = build_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for ids in batches(dp):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms}


def dropout_reference(kind: str, dp: int) -> dict[str, list[float]]:
    """One process, the whole model, dropout on, drawing the masks the data-parallel ranks
    draw: each step's `dp` micro-batches start from the same generator state (the ranks share
    one seed), their gradients summed as the ranks' average; AdamW and clip_grad_norm_."""
    model = build_model(kind, dropout=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    torch.manual_seed(SEED)
    losses, norms = [], []
    for ids in batches(dp):
        state, total = torch.get_rng_state(), 0.0
        for k in range(dp):
            torch.set_rng_state(state)
            micro = ids[k * MICRO : (k + 1) * MICRO]
            loss = model(input_ids=micro, labels=micro).loss
            (loss / dp).backward()
            total += float(loss.detach())
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(total / dp)
    return {"losses": losses, "norms": norms}


def _config(tp: int, stage: int, sequence: bool = False) -> dict[str, Any]:
    section: dict[str, Any] = {"autotp_size": tp}
    if sequence:
        section["sequence_parallel"] = True
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": section,
    }


def _mean_over_dp(value: float, dims: Any) -> float:
    """The global batch's loss: the mean of the data-parallel ranks' micro-batch means."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=dims.dp_group)
    return float(t) / dims.dp_world_size


def _tp_calls() -> int:
    """Tensor-parallel collectives issued so far, of any kind (on gloo with more than two
    ranks, reduce-scatters and all-gathers run, and are counted, as all-reduces)."""
    return sum(n for (_, tag), n in COUNTERS.total_calls.items() if tag == "tp")


def train(
    model_kind: str,
    tp: int,
    stage: int,
    via: str = "config",
    folder: str | None = None,
    dropout: bool = False,
    recompute: bool | str = False,
    sequence: bool = False,
) -> dict[str, Any]:
    """Trains `model_kind` at tensor size `tp` and ZeRO `stage` (``via`` "tp_model_init": the size
    comes from `partita.tp_model_init` and the config has no tensor_parallel section); with a
    `folder`, then checkpoints and reloads at tensor degree 1 (`reload_whole`). `dropout`: with
    `DROPOUT`'s rates, seeded per tensor rank (see `SEED`); `recompute`: with Transformers'
    gradient checkpointing (torch's checkpoint per block; "reentrant": its reentrant form);
    `sequence`: with
    ``tensor_parallel.sequence_parallel``."""
    world = dist.get_world_size()
    dp = world // tp
    model = build_model(model_kind, dropout=dropout)
    if recompute:
        model.gradient_checkpointing_enable({"use_reentrant": recompute == "reentrant"})
    config = _config(tp, stage, sequence)
    if via == "tp_model_init":
        del config["tensor_parallel"]
        model = partita.tp_model_init(model, tp_size=tp, dtype=torch.float32)
    if dropout:
        torch.manual_seed(SEED + dist.get_rank() % tp)
    engine = partita.initialize(model=model, config=config)[0]
    dims = engine.dims
    losses, norms, tp_bytes, tp_calls = [], [], [], []
    for ids in batches(dp):
        local = ids[dims.dp_rank * MICRO : (dims.dp_rank + 1) * MICRO]
        before = COUNTERS.bytes(tag="tp")
        calls = _tp_calls()
        loss = engine(input_ids=local, labels=local).loss
        engine.backward(loss)
        tp_bytes.append(COUNTERS.bytes(tag="tp") - before)
        tp_calls.append(_tp_calls() - calls)
        engine.step()
        losses.append(_mean_over_dp(float(loss), dims))
        norms.append(float(engine.get_global_grad_norm()))
    split = sorted(
        n for n, p in engine.module.named_parameters() if getattr(p, "tensor_model_parallel", False)
    )
    return {
        "losses": losses,
        "norms": norms,
        "tp_bytes": tp_bytes,
        "tp_calls": tp_calls,
        "dims": (
            engine.get_tensor_parallel_rank(),
            engine.get_tensor_parallel_world_size(),
            engine.get_data_parallel_rank(),
            dims.dp_world_size,
            engine.autotp_size(),
        ),
        "split": split,
        "train_batch_size": engine.train_batch_size(),
        "reloaded": reload_whole(engine, model_kind, folder) if folder else None,
    }


def reload_whole(engine: Any, model_kind: str, folder: str) -> dict[str, Any]:
    """Saves `engine` (tensor-parallel) to `folder` and loads the checkpoint into a fresh
    engine at tensor degree 1 (ZeRO 1 over every rank): the logits of both on the same
    tokens."""
    tokens = batches(1)[0]
    with torch.no_grad():
        split = engine.module(input_ids=tokens).logits
    engine.save_checkpoint(folder, tag="tp")
    config = _config(1, 1)
    del config["tensor_parallel"]
    whole = partita.initialize(model=build_model(model_kind), config=config)[0]
    whole.load_checkpoint(folder, tag="tp")
    with torch.no_grad():
        joined = whole.module(input_ids=tokens).logits
    return {"split": split, "joined": joined, "tp": whole.get_tensor_parallel_world_size()}


REFUSALS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (model kind, model overrides, tensor_parallel section)
    "tp3": ("llama", {}, {"autotp_size": 3}),
    "heads": ("llama", {"num_attention_heads": 2, "num_key_value_heads": 2}, {"autotp_size": 4}),
    "kv_heads": ("llama", {"num_key_value_heads": 2}, {"autotp_size": 4}),
    "vocab": ("llama", {"vocab_size": 66}, {"autotp_size": 4}),
    "features": ("llama", {"intermediate_size": 66}, {"autotp_size": 4}),
    "inner_tp_size": ("llama", {}, {"autotp_size": 2, "tp": {"tp_size": 4}}),
    "ce_backend": ("llama", {}, {"autotp_size": 2, "vocab_parallel_ce_backend": "liger"}),
    "preset": ("llama", {}, {"autotp_size": 2, "preset_model": "llama"}),
}


def refusal(what: str) -> str:
    """The error `initialize` raises for refusal `what`, before any collective."""
    kind, overrides, section = REFUSALS[what]
    config = _config(2, 1)
    config["tensor_parallel"] = section
    try:
        partita.initialize(model=build_model(kind, **overrides), config=config)
    except (ConfigError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def odd_length() -> str:
    """With ``tensor_parallel.sequence_parallel`` at tp 2, a batch of odd length: the error of
    the forward, raised before its first collective (then a whole step at the even length still
    runs on every rank)."""
    engine = partita.initialize(model=build_model("llama"), config=_config(2, 1, True))[0]
    ids = batches(engine.dims.dp_world_size)[0][:MICRO]
    try:
        engine(input_ids=ids[:, :-1], labels=ids[:, :-1])
        message = "accepted"
    except ValueError as error:
        message = str(error)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.destroy()
    return message


def tp_grid(case: str, **kwargs: Any) -> Any:
    """One case of the grid: "train", "refusal" or "odd_length" (their functions' arguments)."""
    if case == "train":
        return train(**kwargs)
    if case == "odd_length":
        return odd_length()
    return refusal(**kwargs)
