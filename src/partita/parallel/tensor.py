"""Tensor-parallel training: column- and row-parallel linears on the mesh's ``tp`` dimension.

[Note: tensor-parallel training]
Which linear splits how comes from the inference planner (`partita.inference.plan`: Hugging
Face's ``base_model_tp_plan``, then DeepSpeed AutoTP's name rules; fused QKV and grouped
key/value heads split per head), so training and inference agree on every slice. Training
adds the backward: each collective of the forward has its adjoint.

- A column-parallel linear reads the replicated residual stream and writes its share of the
  output features. Forward: identity on its input. Backward: each rank holds only its share of
  the input's gradient (the part that flowed through its columns), so the gradient of the input
  is all-reduced over the tensor group (`copy_to_tensor_region`).
- A row-parallel linear reads split features and writes a partial sum of the output. Forward:
  the partial outputs are all-reduced (`reduce_from_tensor_region`); its bias is replicated and
  added once, after the sum. Backward: identity (the output's gradient is the same on every
  rank, and so is what each rank's slice needs).
- An untied output head splits its vocabulary rows (DeepSpeed AutoTP training's lm_head
  ``gather_output``): each rank computes its logits' columns and an all-gather assembles them
  (`gather_from_tensor_region`), whose backward keeps this rank's columns of the gradient.

So a block costs two all-reduces forward and two backward (the linears reading one input
share one copy of it: [Note: one all-reduce per shared input]), and everything between the blocks
(norms, embeddings, the loss) runs replicated on whole activations, with equal gradients on
every tensor rank. The parameters keep their identity (only ``.data`` becomes the slice), so an
optimizer built before `initialize` still steps them, and their names: a checkpoint's keys are
the model's. Split parameters carry ``tensor_model_parallel = True`` (Megatron's flag), which
the gradient norm reads to count replicated parameters once (`partita.zero.shard_step`).
Dropout draws the masks of a one-process run on every tensor rank ([Note: dropout under tensor
parallelism] in `partita.parallel.tp_dropout`).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partita.comm import all_gather, all_reduce, broadcast
from partita.comm.process_group import ProcessGroup
from partita.inference.plan import PlanError, ShardPlan, build_plan
from partita.inference.shard import take_slice
from partita.parallel.tp_dropout import has_dropout, install_split_dropout, sync_generators
from partita.parallel.tp_sequence import (
    SequencePlan,
    install_sequence_parallel,
    plan_sequence_parallel,
    reduce_scatter_sequence,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SharedInput",
    "TensorParallelModel",
    "check_tensor_parallel",
    "copy_to_tensor_region",
    "gather_from_tensor_region",
    "parallelize",
    "reduce_from_tensor_region",
]

TAG = "tp"
"""The tag tensor-parallel collectives are counted under in `partita.comm.COUNTERS`."""
_TRAINING_STYLES = frozenset({"colwise", "rowwise", "fused_qkv", "replicate", "vocab_head"})


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the tensor group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share it
        all_reduce(grad, group=ctx.group, tag=TAG)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward over the tensor group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        all_reduce(out, group=group, tag=TAG)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; this rank's columns of the gradient
    backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, size: int, rank: int
    ) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        local = x.contiguous()
        gathered = local.new_empty((size, *local.shape))
        all_gather(gathered, local, group=group, tag=TAG)
        return gathered.movedim(0, -2).reshape(*local.shape[:-1], size * ctx.width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None, None, None


def copy_to_tensor_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """`x` unchanged; its gradient all-reduced over `group` (a column-parallel input)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """`x` summed over `group`; its gradient passed through (a row-parallel output)."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_tensor_region(
    x: torch.Tensor, group: ProcessGroup | None, size: int, rank: int
) -> torch.Tensor:
    """The `size` ranks' `x` side by side along the last dimension, in rank order; the
    gradient keeps rank `rank`'s columns."""
    return _GatherFromRegion.apply(x, group, size, rank)


def _matmul(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    # transposed: Hugging Face's Conv1D stores its weight as [in, out].
    return x @ weight if transposed else nn.functional.linear(x, weight)


@dataclass(frozen=True)
class _Place:
    """Where a layer sits on the tensor dimension."""

    group: ProcessGroup | None
    size: int
    rank: int


class SharedInput:
    """[Note: one all-reduce per shared input]
    The column-parallel linears of one module (q, k and v of an attention; gate and up of an
    MLP) read the same tensor. Each taking its own `copy_to_tensor_region` would all-reduce
    three input gradients backward where one sum suffices; so the members of one module share
    one copy of their input: backward sums their input gradients locally, then all-reduces
    once (Megatron puts one copy at the block's input). The copy is reused only for the very
    tensor it was made from (identity, not equality), and the references are dropped once
    every member has used it."""

    def __init__(self, members: int) -> None:
        self.members = members
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._uses = 0

    def copy(self, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        """`copy_to_tensor_region(x)`, made once for the members reading the same `x`."""
        if x is not self._x or self._y is None:
            self._x, self._y, self._uses = x, copy_to_tensor_region(x, group), 0
        y, self._uses = self._y, self._uses + 1
        if self._uses >= self.members:  # every member has it: hold nothing between steps
            self._x = self._y = None
        return y


class _SplitLinear(nn.Module):
    """A linear whose weight (and bias) are this rank's part of the split over `place`'s tensor
    group; `transposed`: the weight is stored [in, out] (a Conv1D)."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        place: _Place,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.place = place
        self.transposed = transposed

    def extra_repr(self) -> str:
        return f"tp={self.place.rank}/{self.place.size}"


class ColumnParallelLinear(_SplitLinear):
    """A linear holding this rank's output features (see [Note: tensor-parallel training]);
    with `gather_output`, its output is the whole width (an output head)."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        place: _Place,
        transposed: bool = False,
        gather_output: bool = False,
        shared: SharedInput | None = None,
    ) -> None:
        super().__init__(weight, bias, place, transposed)
        self.gather_output = gather_output
        self.shared = shared
        self.gathered_input = False
        """Sequence parallelism: the input comes from an all-gather along the sequence whose
        backward reduce-scatters the input gradient, so no copy is taken here ([Note:
        sequence-parallel norms] in `partita.parallel.tp_sequence`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features (all of them with `gather_output`)."""
        group = self.place.group
        if self.gathered_input:
            copied = x
        elif self.shared:
            copied = self.shared.copy(x, group)
        else:
            copied = copy_to_tensor_region(x, group)
        y = _matmul(copied, self.weight, self.transposed)
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output:
            y = gather_from_tensor_region(y, self.place.group, self.place.size, self.place.rank)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gather_output={self.gather_output}"


class RowParallelLinear(_SplitLinear):
    """A linear holding this rank's input features; the partial outputs are summed over the
    tensor group and the (replicated) bias added once (see [Note: tensor-parallel training])."""

    sequence_parallel = False
    """Sequence parallelism: the partial outputs are reduce-scattered along the sequence, each
    rank keeping its slice of the sum ([Note: sequence-parallel norms] in
    `partita.parallel.tp_sequence`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output, identical on every rank of the group (with `sequence_parallel`,
        this rank's sequence slice of it)."""
        partial = _matmul(x, self.weight, self.transposed)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.place.group, self.place.size)
        else:
            y = reduce_from_tensor_region(partial, self.place.group)
        return y + self.bias if self.bias is not None else y


@dataclass(frozen=True)
class TensorParallelModel:
    """What `parallelize` did: the plan and the modules it replaced, by name and style."""

    plan: ShardPlan
    replaced: dict[str, str]


def check_tensor_parallel(
    model: nn.Module, tp_size: int, world_size: int, sequence_parallel: bool = False
) -> ShardPlan:
    """Raises, naming the value, unless `model` splits over `tp_size` ranks for training (with
    `sequence_parallel`, the stream between its blocks too) and `tp_size` divides `world_size`;
    reads shapes only (no collective: every rank raises alike). Returns tensor rank 0's plan."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel.autotp_size: {tp_size!r} must be a positive integer")
    if world_size % tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size: {tp_size} does not divide the world size "
            f"{world_size} (tensor groups of consecutive ranks, equal size)"
        )
    _check_heads(model, tp_size)
    _check_custom_plan(model)
    plan = build_plan(model, tp_size, 0)
    for name, style in plan.styles.items():
        if style not in _TRAINING_STYLES:
            raise PlanError(
                f"{name}: style {style!r} is not supported for tensor-parallel training "
                f"(supported: {', '.join(sorted(_TRAINING_STYLES))})"
            )
    if plan.head_ranges:
        raise PlanError(
            f"{next(iter(plan.head_ranges))}: ALiBi attention is not supported for "
            "tensor-parallel training"
        )
    if plan.vocab and plan.vocab_size % tp_size:
        raise PlanError(
            f"{next(iter(plan.vocab))}: vocabulary size {plan.vocab_size} does not split evenly "
            f"over tensor_parallel.autotp_size {tp_size}"
        )
    if sequence_parallel:
        plan_sequence_parallel(model, plan.styles)
    return plan


_SPLIT_LINEAR_STYLES = frozenset({"colwise", "rowwise", "fused_qkv"})


def _check_custom_plan(model: nn.Module) -> None:
    """A ``base_model_tp_plan`` the user set (other than the config class's own) must name
    layers the model has, and split only linears: a mistyped entry would otherwise leave its
    layer replicated, and a split style on another layer would be ignored, both silently."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan or plan == getattr(type(config), "base_model_tp_plan", None):
        return
    prefix = getattr(model, "base_model_prefix", "")
    modules = dict(model.named_modules())
    names = [*modules, *(n for n, _ in model.named_parameters())]
    relative = {n: n[len(prefix) + 1 :] if prefix and n.startswith(prefix + ".") else n
                for n in names}  # fmt: skip
    for key, style in plan.items():
        pattern = re.compile(re.escape(key).replace(r"\*", r"\d+"))
        hits = [n for n in names if pattern.fullmatch(n) or pattern.fullmatch(relative[n])]
        entry = f"base_model_tp_plan entry {key!r}: {style!r}"
        if not hits:
            layouts = sorted({re.sub(r"\.\d+\.", ".*.", relative[n]) for n in modules})
            near = difflib.get_close_matches(key, layouts, n=3)
            hint = f"did you mean {', '.join(map(repr, near))}?" if near else "no close name"
            raise PlanError(f"{entry} names no layer of {type(model).__name__} ({hint})")
        for name in hits:
            module = modules.get(name)
            if style in _SPLIT_LINEAR_STYLES and not (module is not None and _is_linear(module)):
                what = type(module).__name__ if module is not None else "a parameter"
                raise PlanError(
                    f"{name} ({what}): {entry}, but partita splits only nn.Linear and Conv1D "
                    "layers so for tensor-parallel training"
                )


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _check_heads(model: nn.Module, tp_size: int) -> None:
    """Query and key/value heads must split evenly: a rank holding part of a head would
    compute attention on half-heads (the planner keeps a single key/value head whole for
    inference, which a training split of its projection would not)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "model_type", "") == "falcon" or not isinstance(heads, int):
        return  # fused layouts: the planner checks them
    for what, count in (("attention heads", heads), ("key/value heads", kv)):
        if isinstance(count, int) and count % tp_size:
            raise PlanError(
                f"{type(model).__name__}: {count} {what} do not split evenly over "
                f"tensor_parallel.autotp_size {tp_size}"
            )


def _slice_parameter(param: nn.Parameter, plan: ShardPlan, name: str) -> None:
    """Makes `param` hold this rank's slice (in place: its identity is kept)."""
    spec = plan.slices.get(name)
    if spec is None:  # replicated
        return
    full = param.shape[spec.dim]
    with torch.no_grad():
        param.data = take_slice(param.data, spec)
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    # Megatron's layout attributes, which checkpoints record to join the slices when loading
    # at tensor degree 1 ([Note: tensor-parallel slices] in partita.checkpoint.slices): a
    # fused [q | k | v] split per head is Megatron's stride 3. Another layout leaves them out,
    # and such a checkpoint loads at its own degree only.
    stride = len(spec.ranges)
    part, width = full // stride, spec.ranges[0][1] - spec.ranges[0][0]
    first = spec.ranges[0][0]
    if all(
        rng == (k * part + first, k * part + first + width) for k, rng in enumerate(spec.ranges)
    ):
        param.partition_dim = spec.dim % param.dim()  # type: ignore[attr-defined]
        param.partition_stride = stride  # type: ignore[attr-defined]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, new)


def _shared_inputs(plan: ShardPlan) -> dict[str, SharedInput]:
    """One `SharedInput` per module holding two or more column-parallel linears, by linear
    (see [Note: one all-reduce per shared input])."""
    columns = [n for n, style in plan.styles.items() if style in ("colwise", "fused_qkv")]
    parents: dict[str, list[str]] = {}
    for name in columns:
        parents.setdefault(name.rpartition(".")[0], []).append(name)
    shared: dict[str, SharedInput] = {}
    for members in parents.values():
        if len(members) > 1:
            one = SharedInput(len(members))
            shared.update(dict.fromkeys(members, one))
    return shared


def _split_linear(
    model: nn.Module,
    name: str,
    style: str,
    place: _Place,
    plan: ShardPlan,
    shared: SharedInput | None = None,
) -> None:
    old = model.get_submodule(name)
    weight, bias = old.weight, getattr(old, "bias", None)
    assert isinstance(weight, nn.Parameter)
    for pname, param in (("weight", weight), ("bias", bias)):
        # A row-parallel bias is replicated and added after the sum (the planner's inference
        # slice, zeros on ranks > 0, would train apart).
        if isinstance(param, nn.Parameter) and not (pname == "bias" and style == "rowwise"):
            _slice_parameter(param, plan, f"{name}.{pname}")
    transposed = type(old).__name__ == "Conv1D"
    new: nn.Module
    if style == "rowwise":
        new = RowParallelLinear(weight, bias, place, transposed)
    else:
        new = ColumnParallelLinear(weight, bias, place, transposed, style == "vocab_head", shared)
    _replace(model, name, new)


def _broadcast_model(model: nn.Module, place: _Place, ranks: tuple[int, ...]) -> None:
    """Every tensor rank starts from tensor rank 0's whole model, so the slices are of one
    model and the replicated parameters agree."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            broadcast(tensor.data, src=ranks[0], group=place.group, tag="init")


def _dropout_columns(
    model: nn.Module, plan: ShardPlan
) -> dict[str, tuple[tuple[tuple[int, int], ...], int]]:
    """Each column-parallel linear's output ranges on this rank and whole output width (read
    before the split)."""
    columns: dict[str, tuple[tuple[tuple[int, int], ...], int]] = {}
    for name, style in plan.styles.items():
        if style in ("colwise", "fused_qkv"):
            module = model.get_submodule(name)
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            out_dim = 1 if type(module).__name__ == "Conv1D" else 0
            columns[name] = (plan.slices[f"{name}.weight"].ranges, int(weight.shape[out_dim]))
    return columns


def parallelize(
    model: nn.Module,
    group: ProcessGroup | None,
    ranks: tuple[int, ...],
    rank: int,
    sequence_parallel: bool = False,
) -> TensorParallelModel:
    """Splits `model` in place over the tensor group `group` (global `ranks`, in tensor-rank
    order; this process is tensor rank `rank`): column- and row-parallel linears replace the
    planned ones, attention modules get this rank's head counts; with `sequence_parallel`, the
    stream between the blocks is split by sequence ([Note: sequence-parallel norms] in
    `partita.parallel.tp_sequence`). Collective over `group` (every rank of it calls it);
    `check_tensor_parallel` first, so bad shapes raise before."""
    size = len(ranks)
    check_tensor_parallel(model, size, size, sequence_parallel)
    plan = build_plan(model, size, rank)
    sequence: SequencePlan | None = None
    if sequence_parallel:
        sequence = plan_sequence_parallel(model, plan.styles)
    place = _Place(group, size, rank)
    _broadcast_model(model, place, ranks)
    replaced: dict[str, str] = {}
    shared = _shared_inputs(plan)
    # Dropout draws one-process masks ([Note: dropout under tensor parallelism]).
    dropout = has_dropout(model)
    columns = _dropout_columns(model, plan) if dropout else {}
    for name, style in plan.styles.items():
        if style in ("colwise", "fused_qkv", "rowwise", "vocab_head"):
            _split_linear(model, name, style, place, plan, shared.get(name))
            replaced[name] = style
    for name, values in plan.attrs.items():
        if name in replaced:  # Conv1D's width ("nf"): the new module reads its weight
            continue
        module = model.get_submodule(name)
        for attr, value in values.items():
            setattr(module, attr, value)
    if dropout:
        sync_generators(place.group, ranks[0], next(iter(model.parameters())).device)
        rows = [name for name, style in replaced.items() if style == "rowwise"]
        install_split_dropout(model, columns, rows, size, rank, sequence=sequence is not None)
    if sequence is not None:
        install_sequence_parallel(model, sequence, place.group, size, rank)
    return TensorParallelModel(plan, replaced)
