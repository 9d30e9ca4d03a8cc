"""Vocabulary-parallel cross-entropy: the loss of an output head split by vocabulary, computed
from each rank's slice of the logits, which are never gathered whole.

[Note: vocabulary-parallel loss]
Megatron's ``vocab_parallel_cross_entropy``. Rank r holds the logits of token ids
[r*c, (r+1)*c). Per token: the maximum over the vocabulary (all-reduce MAX, [N] fp32), then, in
one all-reduce SUM of a [2, N] float64 tensor ([3, N] with label smoothing), the sum of
exp(logit - max) and the target's shifted logit, which only its owner contributes (the others
add zero). The loss is ``log(sum) - target``, the formula of torch's ``log_softmax`` +
``nll_loss``; the sum is accumulated in float64, so that what is left against torch's fp32 sum
over the whole row is torch's own rounding (an fp32 sum per rank, then across ranks, added
its own, which AdamW's first steps turned into logits 1e-5 apart after two steps in
tests/test_tp_checkpoints.py). Backward needs no collective: the gradient of the local slice is
``softmax - one_hot`` scaled by the loss's gradient, formed in torch's order (``p * g - g``
with ``p = exp(log p)``). Memory: the forward saves one [N, c] fp32 softmax, a 1/tp share of
what a gathered ``log_softmax`` saves (the exp to sum is taken a block of rows at a time), and
the backward writes the gradient into it (Megatron does so too), so a second backward through the
same graph (``retain_graph``) raises instead of reading it.
Labels outside [0, vocabulary) other than ``ignore_index`` are not checked (that would need a
host sync): they count as a target logit of zero.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from partita.comm import ReduceOp, all_reduce
from partita.comm.process_group import ProcessGroup, get_rank, get_world_size
from partita.parallel.tensor import ColumnParallelLinear

__all__ = [
    "TAG",
    "Reduction",
    "VocabParallelCausalLMLoss",
    "install_causal_lm_loss",
    "vocab_parallel_cross_entropy",
]

TAG = "tp"
"""The tag the loss's collectives are counted under (the tensor dimension's)."""

Reduction = Literal["mean", "sum", "none"]


_CHUNK = 1 << 20
"""Elements of the rows whose exp is summed at once: the exp is a temporary, kept to 4 MiB."""


def _sum_exp(shifted: torch.Tensor) -> torch.Tensor:
    """Per row, the float64 sum of exp(`shifted`), a block of rows at a time (each row's sum is
    the same whichever block it is in)."""
    rows = max(1, _CHUNK // max(shifted.shape[-1], 1))
    return torch.cat([b.exp().sum(dim=-1, dtype=torch.float64) for b in shifted.split(rows)])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses of [N, c] local logits against [N] global target ids (see
    [Note: vocabulary-parallel loss])."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ProcessGroup | None,
        start: int,
        vocab: int,
        ignore_index: int,
        smoothing: float,
    ) -> torch.Tensor:
        width = logits.shape[-1]
        maximum = logits.amax(dim=-1).float()
        all_reduce(maximum, op=ReduceOp.MAX, group=group, tag=TAG)
        shifted = logits.float() - maximum.unsqueeze(-1)  # a new tensor: written in place below
        local = target - start
        owned = (local >= 0) & (local < width)
        local = torch.where(owned, local, torch.zeros_like(local))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(owned, picked, torch.zeros_like(picked))  # the owner's alone
        # Summed in float64 (exact enough that the only rounding left against torch's
        # one-kernel fp32 sum is torch's own; AdamW's first steps amplify the rest). Label
        # smoothing also needs the sum over the vocabulary of the shifted logits.
        f64 = torch.float64
        extra = [shifted.sum(dim=-1, dtype=f64)] if smoothing else []
        stacked = torch.stack([_sum_exp(shifted), picked.to(f64), *extra])
        all_reduce(stacked, group=group, tag=TAG)  # one SUM for all of them
        lse = stacked[0].log().float()
        loss = lse - stacked[1].float()
        if smoothing:  # torch's: (1 - e) * nll + e * mean over the vocabulary of -log p
            loss = (1.0 - smoothing) * loss + smoothing * (lse - (stacked[2] / vocab).float())
        valid = target != ignore_index
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        # exp(log p), as torch's log_softmax backward forms it (not exp / sum: a rounding apart)
        softmax = shifted.sub_(lse.unsqueeze(-1)).exp_()
        ctx.save_for_backward(softmax, local, owned & valid, valid)
        ctx.smoothing, ctx.vocab, ctx.dtype, ctx.used = smoothing, vocab, logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.used:
            raise RuntimeError(
                "vocab_parallel_cross_entropy: a second backward through the same loss "
                "(retain_graph) is not supported: the first wrote its gradient into the saved "
                "softmax"
            )
        ctx.used = True
        softmax, local, hit, valid = ctx.saved_tensors
        out = softmax  # in place, as Megatron: the saved softmax is not read again
        scale = torch.where(valid, grad.float(), torch.zeros_like(grad, dtype=torch.float32))
        scale = scale.unsqueeze(-1)
        out.mul_(scale)  # p * g, then minus g at the target: torch's order of operations
        if ctx.smoothing:
            out.sub_(scale * (ctx.smoothing / ctx.vocab))
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, local] -= hit.to(out.dtype) * scale.squeeze(-1) * (1.0 - ctx.smoothing)
        return out.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup | None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """torch's ``cross_entropy(logits, labels, ignore_index=..., reduction=...,
    label_smoothing=...)`` of the logits split by vocabulary over `group`: this rank (rank r of
    the group) holds `local_logits` [..., c], the columns of token ids [r*c, (r+1)*c);
    `labels` [...] are global token ids. Two all-reduces forward (MAX and SUM, counted under
    the tag "tp"), none backward ([Note: vocabulary-parallel loss]). Computed in fp32; the
    gradient is returned in the logits' dtype. "mean" divides by the labels that are not
    `ignore_index` (nan when none is, as torch)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: unknown reduction {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing {label_smoothing}")
    width = local_logits.shape[-1]
    size = get_world_size(group)
    flat = local_logits.reshape(-1, width)
    target = labels.reshape(-1).to(flat.device)
    losses = _VocabParallelCrossEntropy.apply(
        flat, target, group, get_rank(group) * width, width * size, ignore_index, label_smoothing
    )
    if reduction == "none":
        return losses.view(labels.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()


class _Head(enum.Enum):
    """What the vocabulary-split head returns in the forward under way."""

    GATHERED = "gathered"  # the whole vocabulary (all-gathered): no labels, or no grad
    SHARDED = "sharded"  # this rank's columns, for the vocabulary-parallel loss


class VocabParallelCausalLMLoss:
    """[Note: vocabulary-parallel loss of a Hugging Face causal LM]
    The model's own forward runs unchanged; two things are swapped on the instance. A forward
    pre-hook sees ``labels=`` (with grad enabled) and tells the head to return its columns
    instead of all-gathering them; the model's ``loss_function`` (a settable property of
    ``PreTrainedModel``, read by every ``*ForCausalLM`` and ``GPT2LMHeadModel``) becomes this
    object, which computes Transformers' ``ForCausalLMLoss`` (labels shifted left, padded with
    ``ignore_index``; "sum" over ``num_items_in_batch`` when given, else "mean") with
    `vocab_parallel_cross_entropy`. Why this and not a tensor subclass or a wrapped forward:
    the head and the loss are the only places that see the vocabulary, the model's code,
    signature and outputs stay Transformers', and nothing leaks into ``state_dict``.

    Without labels, or under ``no_grad`` (evaluation, where metrics read whole logits), the
    head gathers as before and the original loss runs. With labels, ``outputs.logits`` is this
    rank's slice [..., vocab / tp] (the point: the whole logits are never built). A model whose
    forward computes its loss without ``self.loss_function`` would read a slice as the whole:
    the post-forward hook raises then, naming the switch that turns this off
    (``tensor_parallel.vocab_parallel_lm_head: false``)."""

    def __init__(self, model: nn.Module, head: ColumnParallelLinear) -> None:
        self.model, self.head = model, head
        self.group = head.place.group
        self.size = head.place.size
        self.original: Callable[..., torch.Tensor] = model.loss_function  # type: ignore[assignment]
        self.state = _Head.GATHERED
        self.calls = 0
        self.handles = (
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
        )
        model.loss_function = self  # type: ignore[assignment]

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("labels") is None or not torch.is_grad_enabled():
            return
        self.state, self.calls, self.head.gather_output = _Head.SHARDED, 0, False

    def _post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.state is not _Head.SHARDED:
            return
        self.state, self.head.gather_output = _Head.GATHERED, True
        if not self.calls:
            raise RuntimeError(
                f"{type(module).__name__} was given labels but did not compute its loss with "
                "self.loss_function, so it read this rank's slice of the vocabulary as the "
                "whole logits; set tensor_parallel.vocab_parallel_lm_head to false"
            )

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Transformers' ``ForCausalLMLoss`` on this rank's columns (the original loss while
        the head gathers)."""
        if self.state is not _Head.SHARDED:
            return self.original(
                logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )  # fmt: skip
        self.calls += 1
        if logits.shape[-1] * self.size != vocab_size:
            raise RuntimeError(
                f"vocabulary-parallel loss: logits of width {logits.shape[-1]} are not this "
                f"rank's 1/{self.size} of the vocabulary {vocab_size}"
            )
        if shift_labels is None:  # tokens < n predict n
            padded = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:]
        reduction: Reduction = "mean" if num_items_in_batch is None else "sum"
        loss = vocab_parallel_cross_entropy(
            logits, shift_labels.to(logits.device), self.group, ignore_index, reduction
        )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    def remove(self) -> None:
        """Puts the model's loss and head back (the head gathers again)."""
        for handle in self.handles:
            handle.remove()
        self.head.gather_output = True
        self.model.loss_function = self.original  # type: ignore[assignment]


def install_causal_lm_loss(model: nn.Module, head_name: str) -> VocabParallelCausalLMLoss | None:
    """Makes `model` compute its loss with the vocabulary-parallel cross-entropy when it is a
    Transformers causal LM (its ``loss_function`` is ``ForCausalLMLoss``) whose head
    `head_name` is split by vocabulary; None (nothing changed) otherwise. See
    [Note: vocabulary-parallel loss of a Hugging Face causal LM]."""
    head = model.get_submodule(head_name)
    if not isinstance(head, ColumnParallelLinear) or not head.gather_output:
        return None
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return None
    return VocabParallelCausalLMLoss(model, head)
