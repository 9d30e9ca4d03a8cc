"""Rank-side code of tests/test_hf_pipe.py: a tiny Llama from Transformers split into a
pipeline by its ``base_model_pp_plan`` (`partita.parallel.hf_pipe.pipeline_from_hf`), trained
with `train_batch`, and the one-process reference: the same model's own forward and loss on the
same micro-batches with torch's AdamW."""

from __future__ import annotations

from typing import Any

import torch

import partita
from partita.parallel.hf_pipe import pipeline_from_hf

VOCAB = 128
SEQ = 16
LR = 1e-3


def tiny_model(arch: str, tied: bool) -> Any:
    """A tiny causal LM built from a config (the same weights on every rank: seeded)."""
    import transformers

    torch.manual_seed(7)
    kw = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        attn_implementation="eager",
    )  # fmt: skip
    if arch == "qwen2":  # sliding-window layers: their own mask
        cfg = transformers.Qwen2Config(
            **kw, use_sliding_window=True, sliding_window=6, max_window_layers=2
        )
        return transformers.Qwen2ForCausalLM(cfg)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))


def micro_batches(case: dict[str, Any]) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """``[step][dp_rank][micro_step]`` -> (input_ids, labels); some labels ignored (-100)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(case["steps"]):
        ids = torch.randint(0, VOCAB, (case["dp"], case["gas"], case["micro"], SEQ), generator=gen)
        labels = ids.clone()
        labels[..., :3] = -100
        out.append(
            [[(ids[r, i], labels[r, i]) for i in range(case["gas"])] for r in range(case["dp"])]
        )
    return out


def reference(case: dict[str, Any]) -> list[float]:
    """One process: the model's own forward and loss, torch's AdamW, per-step mean losses."""
    model = tiny_model(case["arch"], case["tied"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    n = case["gas"] * case["dp"]
    losses = []
    for step in micro_batches(case):
        total = torch.zeros(())
        for rank_batches in step:
            for ids, labels in rank_batches:
                loss = model(ids, labels=labels).loss
                (loss / n).backward()
                total += loss.detach()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(float(total / n))
    return losses


def train(case: dict[str, Any]) -> dict[str, Any]:
    """The pipeline: `pipeline_from_hf` at ``case["stages"]``, `train_batch` per step."""
    module = pipeline_from_hf(tiny_model(case["arch"], case["tied"]), num_stages=case["stages"])
    cfg = {
        "train_micro_batch_size_per_gpu": case["micro"],
        "gradient_accumulation_steps": case["gas"],
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": case.get("clip", 0.0),
        "zero_optimization": {"stage": case.get("stage", 0)},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = partita.initialize(model=module, config=cfg)
    dp_rank = engine.grid.get_data_parallel_rank()
    losses = [float(engine.train_batch(iter(step[dp_rank]))) for step in micro_batches(case)]
    out = {"losses": losses, "stage": engine.stage_id, "parts": module.partitions()}
    engine.destroy()
    return out


def bad(case: dict[str, Any]) -> str:
    """`pipeline_from_hf` of a model without a pipeline plan: the error, on every rank."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)
    try:
        pipeline_from_hf(transformers.GPT2LMHeadModel(cfg), num_stages=case["stages"])
    except ValueError as err:
        return str(err)
    return "no error"


def grid(kind: str, case: dict[str, Any]) -> Any:
    """One case: ``kind`` "train" or "bad"."""
    return train(case) if kind == "train" else bad(case)
