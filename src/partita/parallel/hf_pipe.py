"""Hugging Face causal language models as pipelines, split where their ``base_model_pp_plan``
says they may be.

[Note: Hugging Face pipeline plans]
Transformers declares, per architecture, the children of the base model a pipeline may cut
between (``config.base_model_pp_plan``, e.g. Llama's ``embed_tokens``, ``layers``, ``norm``, each
with its input and output names) and the head after them (the model's ``_pp_plan``:
``lm_head``). `pipeline_from_hf` reads those two plans and builds a `PipelineModule` of the
model's own modules, one pipeline layer per plan entry and one per decoder layer of a module
list, so the usual partition methods balance the decoder layers over the stages. Only the
hidden states cross a stage boundary: what the base model's forward computes once for every
layer (positions, the rotary embeddings, the causal mask) each decoder layer computes again from
the hidden states' shape, so a batch is unpadded token ids of one length (no attention mask and
no cache, as in pre-training). A head tied to the input embedding (``tie_word_embeddings``) is a
`TiedLayerSpec` shared by the first and the last stage, whose gradients the pipeline sums.
The default loss is the model's own (``model.loss_function``: labels shifted by one, ``-100``
ignored), so ``train_batch`` over (input_ids, labels) trains what ``model(input_ids,
labels=labels).loss`` measures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partita.parallel.pipe_module import LayerSpec, PipelineModule, TiedLayerSpec
from partita.parallel.topology import ProcessTopology

_EMBED = "embed"
"""The tied key of an input embedding shared with the head."""


class HFDecoderLayer(nn.Module):
    """One decoder layer of the plan's module list, with what the base model's forward gives
    every layer made here from the hidden states ([Note: Hugging Face pipeline plans])."""

    def __init__(
        self, layer: nn.Module, base: nn.Module, index: int, shared: _PerBatch | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = getattr(base, "rotary_emb", None)
        kinds = getattr(base.config, "layer_types", None)
        self.sliding = kinds is not None and kinds[index] == "sliding_attention"
        # Not a submodule: what the stage's decoder layers share for one batch shape.
        self._shared = shared if shared is not None else _PerBatch(base.config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Runs the layer on `hidden` (batch, sequence, hidden) at positions 0..S-1."""
        positions, mask, rotary = self._shared.inputs(hidden, self.sliding, self.rotary)
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": positions}
        if rotary is not None:
            kwargs["position_embeddings"] = rotary
        out = self.layer(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class _PerBatch:
    """What the base model's forward computes once for all its layers (positions, the causal
    or sliding-window mask, the rotary embeddings), made here once per batch shape and handed
    to every decoder layer of the pipeline that asks for the same shape: recomputed per layer,
    an eager model's [S, S] mask would be built once per layer and micro-batch."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self._key: tuple[Any, ...] | None = None
        self._made: dict[Any, Any] = {}

    def inputs(
        self, hidden: torch.Tensor, sliding: bool, rotary: nn.Module | None
    ) -> tuple[torch.Tensor, Any, Any]:
        """(position ids, mask, rotary embeddings or None) for `hidden`'s shape."""
        # Tensors made under inference mode cannot join a later training graph: keyed apart.
        inference = torch.is_inference_mode_enabled()
        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device, inference)
        if key != self._key:
            self._key, self._made = key, {}
        if "positions" not in self._made:
            self._made["positions"] = torch.arange(hidden.shape[1], device=hidden.device)[None]
        positions = self._made["positions"]
        if sliding not in self._made:
            from transformers import masking_utils

            make = (
                masking_utils.create_sliding_window_causal_mask
                if sliding
                else masking_utils.create_causal_mask
            )
            self._made[sliding] = make(self.config, hidden, None, None, position_ids=positions)
        if rotary is None:
            return positions, self._made[sliding], None
        if "rotary" not in self._made:
            with torch.no_grad():  # cos and sin of positions: no parameters, no gradient
                self._made["rotary"] = rotary(hidden, position_ids=positions)
        return positions, self._made[sliding], self._made["rotary"]


class HFEntry(nn.Module):
    """A plan entry that runs as the model runs it, on one tensor: the embedding (token ids ->
    hidden states), the final norm, the head (hidden states -> logits)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the module."""
        return self.module(x)


def tied_logits(shared: HFEntry, hidden: torch.Tensor) -> torch.Tensor:
    """A head tied to the input embedding: hidden states times the embedding matrix."""
    weight: torch.Tensor = shared.module.weight  # type: ignore[assignment]
    return nn.functional.linear(hidden, weight)


def pipeline_from_hf(
    model: nn.Module,
    num_stages: int | None = None,
    topology: ProcessTopology | None = None,
    loss_fn: Callable[..., Any] | None = None,
    partition_method: str = "parameters",
    activation_checkpoint_interval: int = 0,
    virtual_stages: int = 1,
) -> PipelineModule:
    """A `PipelineModule` of a Hugging Face causal language model's own modules, cut where
    its ``base_model_pp_plan`` allows ([Note: Hugging Face pipeline plans]); every other
    argument as `PipelineModule`'s. `loss_fn(logits, labels)` defaults to the model's loss.
    Collective, like `PipelineModule`: every rank passes the same (identically built) model.
    Raises ValueError, naming the model, when it has no plan or the plan is not one of
    embedding, hidden-state layers, head."""
    layers = hf_pipeline_layers(model)
    if loss_fn is None:
        loss_fn = _model_loss(model)
    return PipelineModule(
        layers,
        num_stages=num_stages,
        topology=topology,
        loss_fn=loss_fn,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        virtual_stages=virtual_stages,
    )


def hf_pipeline_layers(model: nn.Module) -> list[Any]:
    """The pipeline layers of `model` in its plans' order (see `pipeline_from_hf`)."""
    name = type(model).__name__
    base = getattr(model, "base_model", model)
    plan = dict(getattr(base.config, "base_model_pp_plan", None) or {})
    head_plan = dict(getattr(model, "_pp_plan", None) or {})
    if not plan or not head_plan:
        raise ValueError(
            f"{name} has no pipeline plan (config.base_model_pp_plan and the model's "
            "_pp_plan): build a PipelineModule of LayerSpecs instead"
        )
    entries = list(plan.items())
    first_name, (first_in, _) = entries[0]
    if list(first_in) != ["input_ids"]:
        raise ValueError(
            f"{name}: the first entry of base_model_pp_plan ({first_name!r}) takes "
            f"{list(first_in)}, not ['input_ids']; partita pipelines token-id models only"
        )
    embed = getattr(base, first_name)
    head_name = next(iter(head_plan))
    head = getattr(model, head_name)
    tied = getattr(head, "weight", None) is getattr(embed, "weight", 0)
    first: Any = (
        TiedLayerSpec(_EMBED, HFEntry, embed, tied_weight_attr="module.weight")
        if tied
        else HFEntry(embed)
    )
    out: list[Any] = [first]
    for key, (inputs, _) in entries[1:]:
        module = getattr(base, key)
        if "hidden_states" not in inputs:
            raise ValueError(
                f"{name}: base_model_pp_plan entry {key!r} takes {list(inputs)}; partita "
                "pipelines entries of hidden states only"
            )
        if isinstance(module, nn.ModuleList):
            shared = _PerBatch(base.config)
            out += [HFDecoderLayer(layer, base, i, shared) for i, layer in enumerate(module)]
        else:
            out.append(HFEntry(module))
    if tied:
        out.append(
            TiedLayerSpec(
                _EMBED, HFEntry, embed, forward_fn=tied_logits, tied_weight_attr="module.weight"
            )
        )
    else:
        out.append(HFEntry(head))
    return out


def _model_loss(model: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own causal-LM loss over (logits, labels)."""
    loss_function = model.loss_function
    vocab = int(model.config.vocab_size)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_function(logits, labels, vocab_size=vocab)

    return loss


__all__ = ["LayerSpec", "hf_pipeline_layers", "pipeline_from_hf"]
