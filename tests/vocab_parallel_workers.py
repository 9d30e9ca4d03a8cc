"""Rank-side code of tests/test_vocab_parallel_loss.py: `vocab_parallel_cross_entropy` on
slices of seeded logits (and of a head's weight) against torch's ``cross_entropy`` on the whole,
and tiny Hugging Face Llama and GPT-2 (untied heads, so split by vocabulary) trained with
``tensor_parallel.autotp_size``, their saved logits measured by saved-tensor hooks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import partita
from partita.comm import COUNTERS, new_group
from partita.parallel.vocab_loss import Reduction, vocab_parallel_cross_entropy
from tp_training_workers import CLIP, LR, MICRO, batches, build_model

VOCAB, TOKENS, HIDDEN = 64, 24, 16
"""The vocabulary of the models and of the loss cases."""
WIDTH = 48
"""The models' width: none of their activations (48, 96 or 192 wide, or 1/2 or 1/4 of it,
or a head's 6 or 12) is as wide as the vocabulary or its slice at tp 2 or 4 (64, 32, 16)."""
STEPS = 3
REDUCTIONS: tuple[Reduction, ...] = ("mean", "sum", "none")


def model_overrides(kind: str) -> dict[str, Any]:
    """The tiny models of tp_training_workers, wider (see `WIDTH`), with untied heads."""
    if kind == "llama":
        return {"hidden_size": WIDTH, "intermediate_size": 2 * WIDTH}
    return {"n_embd": WIDTH, "tie_word_embeddings": False}


_GROUPS: dict[int, Any] = {}


def _groups(tp: int) -> tuple[Any, int]:
    """Blocks of `tp` consecutive ranks (every rank builds every block, once): this rank's
    group and its rank in it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp not in _GROUPS:
        for first in range(0, world, tp):
            group = new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                _GROUPS[tp] = group
    return _GROUPS[tp], rank % tp


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, a head weight, labels (a quarter ignored) and a weight per token."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels[torch.randperm(TOKENS, generator=gen)[: TOKENS // 4]] = -100
    return hidden, weight, labels, torch.rand(TOKENS, generator=gen)


def function_case(tp: int, reduction: Reduction, smoothing: float) -> dict[str, Any]:
    """Loss and gradients (of the logits and of the head's weight) from this rank's slice, and
    torch's on the whole; the tensor collectives' bytes of the forward and of the backward."""
    group, trank = _groups(tp)
    hidden, weight, labels, scale = _inputs()
    width = VOCAB // tp
    cols = slice(trank * width, (trank + 1) * width)
    ref_w = weight.clone().requires_grad_()
    ref_logits = hidden @ ref_w.t()
    ref_logits.retain_grad()
    ref = nn.functional.cross_entropy(
        ref_logits, labels, reduction=reduction, label_smoothing=smoothing
    )
    (ref * scale).sum().backward() if reduction == "none" else ref.backward()
    local_w = weight[cols].clone().requires_grad_()
    logits = hidden @ local_w.t()
    logits.retain_grad()
    before = COUNTERS.bytes(tag="tp")
    loss = vocab_parallel_cross_entropy(
        logits, labels, group, reduction=reduction, label_smoothing=smoothing
    )
    forward_bytes = COUNTERS.bytes(tag="tp") - before
    (loss * scale).sum().backward() if reduction == "none" else loss.backward()
    assert ref_logits.grad is not None and logits.grad is not None
    return {
        "loss": loss.detach(),
        "ref": ref.detach(),
        "grad": logits.grad,
        "ref_grad": ref_logits.grad[:, cols],
        "weight_grad": local_w.grad,
        "ref_weight_grad": ref_w.grad[cols] if ref_w.grad is not None else None,
        # Each entry sums TOKENS products, with cancellation: its rounding is bounded by the
        # sum of their magnitudes, not by its value.
        "weight_grad_scale": ref_logits.grad[:, cols].abs().t() @ hidden.abs(),
        "forward_bytes": forward_bytes,
        "backward_bytes": COUNTERS.bytes(tag="tp") - before - forward_bytes,
    }


def _config(tp: int, stage: int, vocab_loss: bool | None) -> dict[str, Any]:
    section: dict[str, Any] = {"autotp_size": tp}
    if vocab_loss is not None:
        section["vocab_parallel_lm_head"] = vocab_loss
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": section,
    }


class _SavedLogits:
    """The largest tensor autograd saves whose last dimension is the vocabulary or its slice,
    in bytes; parameters and their views (the head's weight, transposed) aside."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        self.widths, self.peak = widths, 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if t.dim() and t.shape[-1] in self.widths and not isinstance(base, nn.Parameter):
            self.peak = max(self.peak, t.numel() * t.element_size())
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def train_case(kind: str, tp: int, stage: int, vocab_loss: bool | None = None) -> dict[str, Any]:
    """Trains `kind` at tensor size `tp` (``vocab_parallel_lm_head`` = `vocab_loss`): per step
    the global batch's loss, the tensor bytes, the all-gathered bytes of the forward, the
    saved logits' peak; the logits' width with labels and without."""
    dp = dist.get_world_size() // tp
    engine = partita.initialize(
        model=build_model(kind, **model_overrides(kind)), config=_config(tp, stage, vocab_loss)
    )[0]
    dims = engine.dims
    out: dict[str, list[Any]] = {"losses": [], "tp_bytes": [], "gathered": [], "saved": []}
    for ids in batches(dp):
        local = ids[dims.dp_rank * MICRO : (dims.dp_rank + 1) * MICRO]
        saved = _SavedLogits((VOCAB, VOCAB // tp))
        before, gathered = COUNTERS.bytes(tag="tp"), COUNTERS.bytes(op="all_gather", tag="tp")
        with saved.hooks():
            output = engine(input_ids=local, labels=local)
        out["gathered"].append(COUNTERS.bytes(op="all_gather", tag="tp") - gathered)
        engine.backward(output.loss)
        out["tp_bytes"].append(COUNTERS.bytes(tag="tp") - before)
        engine.step()
        t = torch.tensor([float(output.loss)], dtype=torch.float64)
        dist.all_reduce(t, group=dims.dp_group)
        out["losses"].append(float(t) / dims.dp_world_size)
        out["saved"].append(saved.peak)
    with torch.no_grad():
        whole = engine.module(input_ids=local).logits.shape[-1]
    return {**out, "width": output.logits.shape[-1], "width_without_labels": whole}


def reference(kind: str, dp: int) -> list[float]:
    """One process, the whole model and batch, AdamW and clip_grad_norm_ from torch: the
    per-step losses."""
    model = build_model(kind, **model_overrides(kind))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for ids in batches(dp):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def grid(case: str, **kwargs: Any) -> Any:
    """One case: "function" or "train" (their functions' arguments)."""
    return function_case(**kwargs) if case == "function" else train_case(**kwargs)
