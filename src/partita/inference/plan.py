"""The sharding plan: which slice of each weight a tensor-parallel rank holds.

[Note: tensor-parallel plan]
A transformer block reads the residual stream, computes, and writes back into it. The linears
that read it (q/k/v, gate/up, fc1) split column-wise: each rank computes its share of heads or
hidden units, with no communication. The linears that write back (o_proj, down_proj, fc2,
GPT-2's c_proj...) split row-wise: each rank multiplies its share of the input features and
one all-reduce sums the partial outputs. So a standard block costs two all-reduces per
forward (attention, MLP), and everything else (norms, embeddings) is replicated, except an
output head with weights of its own, split by vocabulary (see [Note: vocabulary-parallel]).

Where each module's style comes from, first match wins: an explicit policy
(``injection_policy``), the model config's ``base_model_tp_plan`` (Hugging Face's own plan,
for the families that have one), then rules by layer name in the style of DeepSpeed's AutoTP.
A linear inside a block that no rule names is refused, as is a head count the tensor-parallel
size does not divide: guessing would give wrong numbers without an error.

A fused QKV projection is split per head, so each rank gets matching query, key and value
heads: GPT-2's ``c_attn`` holds [q | k | v] (three ranges per rank); GPT-NeoX's and Falcon's
``query_key_value`` interleave per head or per key/value group (one contiguous range), except
Falcon's multi-query layout [q heads | k | v], where each rank takes its query heads and the
single key and value head whole.

ALiBi (Falcon-RW's ``alibi=True``) adds a per-head bias that the model builds once for all
heads and hands to every attention module, as ``alibi`` and baked into a 4-D attention mask:
each rank keeps the rows of its own heads (`ShardPlan.head_ranges`, a pre-hook in
`partita.inference.shard`), so the bias of head h still meets head h.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["PlanError", "RankSlice", "ShardPlan", "build_plan"]

ROW_NAMES = frozenset(
    {"o_proj", "down_proj", "out_proj", "dense_4h_to_h", "c_proj", "dense", "fc2", "w2"}
)
"""Linears that write back into the residual stream: row-parallel, one all-reduce each."""
COLUMN_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "dense_h_to_4h",
     "w1", "w3", "query", "key", "value", "fc_in", "wi"}
)  # fmt: skip
"""Linears that read the residual stream: column-parallel, no communication."""
FUSED_QKV_NAMES = frozenset({"c_attn", "query_key_value"})
"""Fused query/key/value projections, split per head (see [Note: tensor-parallel plan])."""
STYLES = frozenset({"colwise", "rowwise", "packed_colwise", "fused_qkv", "moe_tp_experts",
                    "replicate", "embedding_rowwise"})  # fmt: skip
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
_WIDTH_ATTRS = ("embed_dim", "split_size", "all_head_size")


class PlanError(ValueError):
    """A model (or a part of it) that cannot be split as asked; names the module and why."""


@dataclass(frozen=True)
class RankSlice:
    """What one rank holds of one tensor: the given ranges along `dim`, concatenated."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    zero: bool = False
    """True: this rank holds zeros of the full shape (a row-parallel bias, added once by
    rank 0 and summed by the all-reduce)."""

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The local shape of a tensor of shape `full`."""
        if self.zero:
            return full
        out = list(full)
        out[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(out)


@dataclass
class ShardPlan:
    """How one rank holds the model (see [Note: tensor-parallel plan])."""

    tp_size: int
    tp_rank: int
    slices: dict[str, RankSlice] = field(default_factory=dict)
    """Parameter name -> its slice; a parameter not listed is replicated."""
    reduce: list[str] = field(default_factory=list)
    """Modules whose output is all-reduced over the tensor-parallel group, in model order."""
    attrs: dict[str, dict[str, int]] = field(default_factory=dict)
    """Attention module -> attribute -> this rank's value (head counts, widths)."""
    styles: dict[str, str] = field(default_factory=dict)
    """Module or parameter name -> its style, for messages and tests."""
    vocab: dict[str, str] = field(default_factory=dict)
    """Vocabulary-parallel modules: name -> "embedding" (input) or "head" (output)."""
    vocab_range: tuple[int, int] = (0, 0)
    """This rank's token ids [start, stop) when vocabulary-parallel."""
    vocab_chunk: int = 0
    """Rows per rank (the last rank may hold fewer: its logits are padded to this)."""
    vocab_size: int = 0
    """The whole vocabulary."""
    head_ranges: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Attention module -> (first head, stop, all heads) whose ALiBi rows this rank keeps."""


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(re.escape(text).replace(r"\*", r"\d+"))


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _in_block(name: str) -> bool:
    return any(part.isdigit() for part in name.split("."))


class _Styles:
    """Looks up a module's or parameter's style: policy, then the config's plan, then rules."""

    def __init__(self, model: nn.Module, policy: Mapping[Any, Any] | None) -> None:
        prefix = getattr(model, "base_model_prefix", "")
        self.prefix = prefix + "." if prefix and hasattr(model, prefix) else ""
        self.policy: list[tuple[re.Pattern[str], str]] = []
        self.classes: dict[type, frozenset[str]] = {}
        for key, value in (policy or {}).items():
            if isinstance(key, type):  # DeepSpeed's {LayerClass: ("o_proj", ...)}
                self.classes[key] = frozenset(value)
            elif isinstance(key, str) and value in STYLES:
                self.policy.append((_pattern(key), value))
            else:
                raise PlanError(f"injection_policy: entry {key!r}: {value!r} is neither "
                                f"'pattern': style (one of {sorted(STYLES)}) nor "
                                "LayerClass: (row-parallel names)")  # fmt: skip
        hf = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        self.hf = [(_pattern(k), v) for k, v in hf.items()]
        self.owner: dict[str, tuple[type, str]] = {}  # linear -> (layer class, path in it)
        for name, module in model.named_modules():
            if type(module) in self.classes:
                for sub, child in module.named_modules(prefix=name):
                    if _is_linear(child):
                        self.owner[sub] = (type(module), sub[len(name) + 1 :])  # innermost

    def _relative(self, name: str) -> str:
        return name[len(self.prefix) :] if name.startswith(self.prefix) else name

    def explicit(self, name: str) -> str | None:
        """The style from the policy or the config's plan, or None."""
        for table in (self.policy, self.hf):
            for pattern, style in table:
                if pattern.fullmatch(name) or pattern.fullmatch(self._relative(name)):
                    return style
            if table is self.policy and (self.policy or self.classes):
                owner = self.owner.get(name)
                if owner is not None:
                    leaf, names = name.rsplit(".", 1)[-1], self.classes[owner[0]]
                    if leaf in names or owner[1] in names:  # DeepSpeed: the named linears sum
                        return "rowwise"
                    return "fused_qkv" if leaf in FUSED_QKV_NAMES else "colwise"
        return None

    @property
    def has_plan(self) -> bool:
        return bool(self.policy or self.hf or self.classes)


def _rule_style(leaf: str) -> str:
    if leaf in ROW_NAMES:
        return "rowwise"
    if leaf in FUSED_QKV_NAMES:
        return "fused_qkv"
    if leaf in COLUMN_NAMES:
        return "colwise"
    return "unknown"


def _chunk(size: int, n: int, r: int, what: str) -> tuple[int, int]:
    if size % n:
        raise PlanError(f"{what}: size {size} does not split evenly over tp_size {n}")
    step = size // n
    return (r * step, (r + 1) * step)


def _heads(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) from a Hugging Face config."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = getattr(config, "num_key_value_heads", None)
    if getattr(config, "model_type", "") == "falcon":
        multi = config.multi_query and not config.new_decoder_architecture
        kv = 1 if multi else (config.num_kv_heads if config.new_decoder_architecture else heads)
    kv = int(kv or heads)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    head_dim = int(getattr(config, "head_dim", None) or (hidden // heads if heads else 0))
    return heads, kv, head_dim


@dataclass
class _Builder:
    model: nn.Module
    n: int
    r: int
    plan: ShardPlan

    def params(self, name: str, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for pname, param in module.named_parameters(recurse=False):
            yield f"{name}.{pname}" if name else pname, param

    def linear(self, name: str, module: nn.Module, style: str) -> None:
        conv = type(module).__name__ == "Conv1D"  # weight stored [in, out]
        out_dim, in_dim = (1, 0) if conv else (0, 1)
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        bias = getattr(module, "bias", None)
        if style == "colwise":
            rng = _chunk(weight.shape[out_dim], self.n, self.r, f"{name} (output features)")
            self.plan.slices[f"{name}.weight"] = RankSlice(out_dim, (rng,))
            if getattr(module, "bias", None) is not None:
                self.plan.slices[f"{name}.bias"] = RankSlice(0, (rng,))
        elif style == "rowwise":
            rng = _chunk(weight.shape[in_dim], self.n, self.r, f"{name} (input features)")
            self.plan.slices[f"{name}.weight"] = RankSlice(in_dim, (rng,))
            if bias is not None:
                size = bias.shape[0]
                self.plan.slices[f"{name}.bias"] = RankSlice(0, ((0, size),), zero=self.r > 0)
            self.plan.reduce.append(name)
        elif style == "fused_qkv":
            ranges = self.fused_ranges(name, weight.shape[out_dim])
            self.plan.slices[f"{name}.weight"] = RankSlice(out_dim, ranges)
            if getattr(module, "bias", None) is not None:
                self.plan.slices[f"{name}.bias"] = RankSlice(0, ranges)
        self.plan.styles[name] = style
        if conv and style != "rowwise":  # Conv1D shapes its output by its `nf` attribute
            local = self.plan.slices[f"{name}.weight"].shape(tuple(weight.shape))
            self.plan.attrs[name] = {"nf": local[1]}

    def fused_ranges(self, name: str, size: int) -> tuple[tuple[int, int], ...]:
        config = getattr(self.model, "config", None)
        kind = getattr(config, "model_type", "")
        heads, kv, head_dim = _heads(config)
        if kind == "gpt2":  # [q | k | v], each hidden wide
            part = size // 3
            a, b = _chunk(part, self.n, self.r, f"{name} (query heads)")
            return tuple((p * part + a, p * part + b) for p in range(3))
        if kind == "gpt_neox" or (kind == "falcon" and kv != 1):  # per head / kv group
            return (_chunk(size, self.n, self.r, f"{name} (fused heads)"),)
        if kind == "falcon":  # multi-query: [q heads | k | v]; k and v stay whole
            q = heads * head_dim
            a, b = _chunk(q, self.n, self.r, f"{name} (query heads)")
            return ((a, b), (q, size))
        raise PlanError(
            f"{name}: fused layer of a '{kind}' model with an unknown layout; pass "
            "injection_policy naming its style (DeepSpeed: 'Please provide policy')"
        )

    def param(self, name: str, param: torch.Tensor, style: str) -> None:
        """A parameter named by the plan itself (MoE experts stored as 3-D tensors)."""
        dim = -1 if style == "rowwise" else -2
        size = param.shape[dim]
        ranges: tuple[tuple[int, int], ...]
        if style == "packed_colwise":  # [gate | up] along dim -2
            a, b = _chunk(size // 2, self.n, self.r, name)
            ranges = ((a, b), (size // 2 + a, size // 2 + b))
        elif style in ("colwise", "rowwise"):
            ranges = (_chunk(size, self.n, self.r, name),)
        else:
            raise PlanError(f"{name}: style {style!r} is not supported for a parameter")
        self.plan.slices[name] = RankSlice(dim, ranges)
        self.plan.styles[name] = style


def _module_style(styles: _Styles, name: str, module: nn.Module) -> str:
    style = styles.explicit(name)
    if style is not None:
        if style not in STYLES:
            raise PlanError(f"{name}: the plan's style {style!r} is not supported by partita "
                            f"(supported: {', '.join(sorted(STYLES))})")  # fmt: skip
        return style
    # Hugging Face's plans list what they split: the rest is replicated. Without one, an
    # explicit policy overrides the named layers and the rules place the others.
    if styles.hf or not _in_block(name) or not _is_linear(module):
        return "replicate"
    return _rule_style(name.rsplit(".", 1)[-1])


def build_plan(
    model: nn.Module,
    tp_size: int,
    tp_rank: int,
    policy: Mapping[Any, Any] | None = None,
    vocab_parallel: bool = False,
) -> ShardPlan:
    """The plan for rank `tp_rank` of `tp_size`; raises `PlanError` naming the module that
    cannot be split. Works on a model on the meta device (only shapes are read).
    An untied output head is split by vocabulary rows; `vocab_parallel` splits the input
    embedding (and a tied head) too (see [Note: vocabulary-parallel])."""
    plan = ShardPlan(tp_size, tp_rank)
    if tp_size == 1:
        return plan
    styles = _Styles(model, policy)
    _vocab_plan(model, plan, styles, vocab_parallel)
    builder = _Builder(model, tp_size, tp_rank, plan)
    for name, module in model.named_modules():
        if name in plan.vocab:
            continue
        style = _module_style(styles, name, module)
        if style == "unknown":
            raise PlanError(
                f"{name} ({type(module).__name__}): no rule says how to split this layer; "
                "pass injection_policy={'<pattern>': 'colwise'|'rowwise'|'replicate'} "
                "(DeepSpeed: 'Please provide policy')"
            )
        if style in ("colwise", "rowwise", "fused_qkv") and _is_linear(module):
            builder.linear(name, module, style)
        elif style == "moe_tp_experts":
            plan.reduce.append(name)
            plan.styles[name] = style
        for pname, param in builder.params(name, module):
            pstyle = styles.explicit(pname) if styles.has_plan else None
            if pstyle in ("packed_colwise", "colwise", "rowwise") and param.dim() == 3:
                builder.param(pname, param, pstyle)
    _check_experts(plan)
    _attention_attrs(model, plan)
    return plan


def _check_experts(plan: ShardPlan) -> None:
    for name, style in plan.styles.items():
        if style == "rowwise" and name not in plan.reduce:
            owner = name.rsplit(".", 1)[0]
            if plan.styles.get(owner) != "moe_tp_experts":
                raise PlanError(f"{name}: a row-parallel parameter needs its module "
                                f"({owner}) marked 'moe_tp_experts' to sum its output")  # fmt: skip


def _attention_attrs(model: nn.Module, plan: ShardPlan) -> None:
    """Per-rank head counts and widths for each attention module whose projections are split,
    checked against the model config (heads and key/value heads must split evenly)."""
    heads, kv, _ = _heads(getattr(model, "config", None))
    n = plan.tp_size
    parents = {name.rsplit(".", 1)[0] for name, style in plan.styles.items()
               if style in ("colwise", "fused_qkv") and name.rsplit(".", 1)[-1] in
               ("q_proj", "c_attn", "query_key_value", "query")}  # fmt: skip
    for parent in sorted(parents):
        # One key/value head stays whole in a fused projection (Falcon's multi-query
        # attention), but separate k/v projections split column-wise would cut it.
        split_kv = plan.styles.get(f"{parent}.k_proj") == "colwise"
        if heads % n or (kv % n and (kv != 1 or split_kv)):
            raise PlanError(
                f"{parent}: {heads} attention heads and {kv} key/value heads do not split "
                f"evenly over tp_size {n}"
            )
        module = model.get_submodule(parent)
        values: dict[str, int] = {}
        for attr in (*_HEAD_ATTRS, *_WIDTH_ATTRS):
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                keep = attr in ("num_kv_heads", "num_key_value_heads") and value == 1
                values[attr] = value if keep else value // n
        if values:
            plan.attrs[parent] = values
        if getattr(getattr(model, "config", None), "alibi", False):
            start, stop = _chunk(heads, n, plan.tp_rank, f"{parent} (ALiBi heads)")
            plan.head_ranges[parent] = (start, stop, heads)


def _vocab_plan(model: nn.Module, plan: ShardPlan, styles: _Styles, embedding: bool) -> None:
    """[Note: vocabulary-parallel]
    The input embedding and the output head are the model's largest replicated tensors
    (GPT-2 124M: 31% of its weights). Split by vocabulary rows, rank r holds token ids
    [r*c, min((r+1)*c, V)) with c = ceil(V/N): the embedding looks up the ids it holds, zeroes
    the others' rows and sums over the group (one all-reduce); the head computes the logits of
    its ids, padded to c columns, and an all-gather assembles the vocabulary (padding cut).
    A tied head shares the embedding's slice.

    The head alone is split so by default, when it has weights of its own (not tied to the
    embedding) and no policy names it ``replicate``: each decode step otherwise multiplies the
    whole head on every rank (Llama 134M: a fifth of its weights), and both peers split it
    too (Transformers' ``_tp_plan`` "colwise_gather_output", DeepSpeed AutoTP's lm_head).
    `embedding` (``vocab_parallel``) splits the embedding as well, a tied head with it."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    names = {id(m): n for n, m in model.named_modules()}
    if not isinstance(head, nn.Linear) or id(head) not in names:
        if embedding:
            raise PlanError(
                f"vocab_parallel: {type(model).__name__} has no nn.Embedding input embedding "
                "and nn.Linear output head (get_input_embeddings/get_output_embeddings)"
            )
        return
    tied = isinstance(emb, nn.Embedding) and head.weight is emb.weight
    if not embedding and (tied or styles.explicit(names[id(head)]) == "replicate"):
        return
    modules: list[tuple[nn.Module, str]] = [(head, "head")]
    size = head.out_features
    if embedding:
        if not isinstance(emb, nn.Embedding):
            raise PlanError(
                f"vocab_parallel: {type(model).__name__} has no nn.Embedding input embedding "
                "and nn.Linear output head (get_input_embeddings/get_output_embeddings)"
            )
        if head.out_features != emb.num_embeddings:
            raise PlanError(f"vocab_parallel: {names[id(head)]} has {head.out_features} "
                            f"outputs but the embedding {emb.num_embeddings} rows")  # fmt: skip
        modules.insert(0, (emb, "embedding"))
    chunk = -(-size // plan.tp_size)
    start, stop = min(plan.tp_rank * chunk, size), min((plan.tp_rank + 1) * chunk, size)
    plan.vocab_range, plan.vocab_chunk, plan.vocab_size = (start, stop), chunk, size
    for module, kind in modules:
        name = names[id(module)]
        plan.vocab[name] = kind
        plan.styles[name] = f"vocab_{kind}"
        plan.slices[f"{name}.weight"] = RankSlice(0, ((start, stop),))
        if getattr(module, "bias", None) is not None:
            plan.slices[f"{name}.bias"] = RankSlice(0, ((start, stop),))
