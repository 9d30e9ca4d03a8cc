"""Tiled compute (`partita.tiling`): `TiledLinear` and the sequence-tiled `TiledMLP`,
`sequence_tiled_compute` and `TiledFusedLogitsLoss` give the untiled computation's outputs and
gradients, hand each parameter its gradient once, keep the activation bytes their docstrings
say, refuse bad arguments by name, and train under ZeRO 0-3 at 2 ranks like one process.

Bitwise checks use integer-valued tensors: every product and partial sum is then an exactly
representable integer, so any order of the same additions gives the same bits, and a tiling
that drops, repeats or misplaces a term cannot pass. Random float64 checks hold the same
computations to 1e-12 relative: tiling only reorders additions of a few dozen terms (each
reorder moves a sum by at most n * 2^-53 of its terms' magnitudes)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from partita.testing import run_distributed_grid
from partita.tiling import (
    TiledFusedLogitsLoss,
    TiledLinear,
    TiledLinearReturnBias,
    TiledMLP,
    sequence_tiled_compute,
)
from partita.tiling.linear import uniform_parts
from partita.tiling.sequence import shard_bounds
from tiling_workers import STEPS, WORLD, reference, tiling_grid

F64_RTOL = 1e-12


def ints(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Integer values in [-3, 3] (exact arithmetic in any summation order)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=gen).to(dtype)


def integer_weights(module: nn.Module, seed: int = 1) -> nn.Module:
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(ints(*p.shape, seed=seed + i, dtype=p.dtype))
    return module


def assert_same(got: torch.Tensor, want: torch.Tensor, rtol: float = 0.0) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=0.0)


# --- TiledLinear ---------------------------------------------------------------------------


def test_uniform_parts_gives_the_larger_parts_first_and_empty_trailing_parts() -> None:
    assert uniform_parts(10, 3) == [0, 4, 7, 10]
    assert uniform_parts(40, 32) == [0, *range(2, 18, 2), *range(17, 41)]
    assert uniform_parts(2, 4) == [0, 1, 2, 2, 2]


def tiled_pair(in_f: int, out_f: int, bias: bool, splits: tuple[int, int], cls: Any = None):
    base = integer_weights((cls or nn.Linear)(in_f, out_f, bias=bias))
    kwargs = {} if cls is None else {"linear_cls": cls}
    tiled = TiledLinear if cls is None else TiledLinearReturnBias
    return base, tiled(
        in_f, out_f, bias=bias, in_splits=splits[0], out_splits=splits[1], init_linear=base,
        **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("in_f,out_f", [(32, 32), (23, 29), (29, 23)])
@pytest.mark.parametrize("splits", [(1, 1), (2, 2), (5, 3), (1, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_linear_outputs_and_gradients_equal_linear_bitwise(
    in_f: int, out_f: int, splits: tuple[int, int], bias: bool
) -> None:
    base, tiled = tiled_pair(in_f, out_f, bias, splits)
    x = ints(3, 2, in_f, seed=7)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = base(xa), tiled(xb)
    assert_same(out_b, out_a)
    grad = ints(*out_a.shape, seed=8)
    out_a.backward(grad)
    out_b.backward(grad)
    assert_same(xb.grad, xa.grad)
    for o in range(tiled.out_splits):
        r = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        for i in range(tiled.in_splits):
            c = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            tile = tiled.linears[o][i]
            assert_same(tile.weight.grad, base.weight.grad[r, c])
            assert (tile.bias is not None) == (bias and i == tiled.in_splits - 1)
            if tile.bias is not None:
                assert_same(tile.bias.grad, base.bias.grad[r])


def test_tiled_linear_random_float64_within_reordering_and_split_input() -> None:
    torch.manual_seed(0)
    base = nn.Linear(23, 29).double()
    tiled = TiledLinear(23, 29, in_splits=4, out_splits=3, init_linear=base, dtype=torch.float64)
    x = torch.randn(5, 23, dtype=torch.float64)
    assert_same(tiled(x), base(x), rtol=F64_RTOL)
    parts = torch.split(x, [b - a for a, b in itertools.pairwise(tiled.in_parts)], -1)
    tiled.input_is_already_split, tiled.combine_out_splits = True, False
    outs = tiled(list(parts))
    assert len(outs) == 3
    assert_same(torch.cat(outs, -1), base(x), rtol=F64_RTOL)


class ReturnsBias(nn.Linear):
    """Megatron-style: returns (output without bias, bias)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return nn.functional.linear(x, self.weight), self.bias


@pytest.mark.parametrize("bias", [False, True])
def test_tiled_linear_return_bias_returns_the_bias_apart(bias: bool) -> None:
    base, tiled = tiled_pair(23, 29, bias, (3, 2), cls=ReturnsBias)
    x = ints(4, 23, seed=3)
    (out_a, bias_a), (out_b, bias_b) = base(x), tiled(x)
    assert_same(out_b, out_a)
    assert (bias_b is None) == (not bias)
    if bias:
        assert_same(bias_b, bias_a)


def test_each_tile_is_a_module_of_its_own_with_linear_state_dict_keys() -> None:
    tiled = TiledLinear(8, 6, in_splits=2, out_splits=3)
    assert not isinstance(tiled.linears, nn.ModuleList)  # ZeRO-3: a unit per tile
    assert len(tiled.linears) == 3 and len(tiled.linears[-1]) == 2
    assert isinstance(tiled.linears[2][1], nn.Linear)
    assert "linears.2.1.weight" in tiled.state_dict()
    with pytest.raises(IndexError, match="index 3"):
        tiled.linears[3]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"in_splits": 0}, r"in_splits=0 must be in the range \[1, in_features=32\]"),
        ({"in_splits": 33}, r"in_splits=33 must be in the range \[1, in_features=32\]"),
        ({"out_splits": 41}, r"out_splits=41 must be in the range \[1, out_features=40\]"),
    ],
)
def test_tiled_linear_refuses_splits_outside_the_features(kwargs: dict, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        TiledLinear(32, 40, **kwargs)


def test_tiled_linear_names_bad_inputs_and_sources() -> None:
    tiled = TiledLinear(8, 6, in_splits=2, out_splits=2)
    with pytest.raises(ValueError, match=r"weight of shape \(6, 7\), expected \(6, 8\)"):
        tiled.copy_params_from(nn.Linear(7, 6))
    with pytest.raises(ValueError, match="bias=True here, but the source has no bias"):
        tiled.copy_params_from(nn.Linear(8, 6, bias=False))
    with pytest.raises(ValueError, match="last dimension is 7, in_features=8"):
        tiled(torch.zeros(2, 7))
    tiled.input_is_already_split = True
    with pytest.raises(ValueError, match="in_splits=2, but forward got 3 input parts"):
        tiled([torch.zeros(2, 4)] * 3)


# --- sequence-tiled compute ----------------------------------------------------------------

H, W, V = 4, 16, 32


def make_mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    mlp = nn.Sequential(nn.Linear(H, W), nn.ReLU(), nn.Linear(W, H))
    return integer_weights(mlp.to(dtype))


def mlp_fn(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def run_twins(
    make: Callable[[], nn.Module], x: torch.Tensor, plain: Callable, tiled: Callable, grad: Any
) -> tuple[tuple, tuple]:
    """(output, input gradient, parameter gradients) of `plain` and of `tiled` on twin
    modules and inputs, each backward seeded with `grad`."""
    results = []
    for run in (plain, tiled):
        module, xi = make(), x.clone().requires_grad_()
        out = run(module, xi)
        out.backward(grad(out) if callable(grad) else grad)
        results.append((out.detach(), xi.grad, [p.grad for p in module.parameters()]))
    return results[0], results[1]


def assert_twins(a: tuple, b: tuple, rtol: float = 0.0) -> None:
    assert_same(b[0], a[0], rtol)
    assert_same(b[1], a[1], rtol)
    for ga, gb in zip(a[2], b[2], strict=True):
        assert_same(gb, ga, rtol)


def test_shard_bounds_cut_as_torch_chunk_does() -> None:
    for length in (1, 5, 10, 12, 125):
        for shards in (1, 2, 3, 4, 7, 200):
            want = [len(c) for c in torch.arange(length).chunk(shards)]
            assert [b - a for a, b in shard_bounds(length, shards)] == want
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"shards={bad!r}, expected an int of at least 1"):
            shard_bounds(10, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(1, 12, H), (2, 13, H), (13, H)])
@pytest.mark.parametrize("shards", [1, 3, 4, 13, 20])
def test_tiled_mlp_equals_the_mlp_bitwise(shape: tuple, shards: int) -> None:
    x = ints(*shape, seed=5)
    a, b = run_twins(
        make_mlp, x, mlp_fn, lambda m, xi: TiledMLP.apply(mlp_fn, m, xi, shards, None),
        ints(*shape, seed=6),
    )  # fmt: skip
    assert_twins(a, b)


def test_tiled_mlp_random_float64_and_gradient_accumulation() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 11, H, dtype=torch.float64)

    def make() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(H, W), nn.GELU(), nn.Linear(W, H)).double()

    def twice(run: Callable) -> Callable:
        def both(module: nn.Module, xi: torch.Tensor) -> torch.Tensor:
            run(module, xi).sum().backward()  # gradients already there are added to
            return run(module, xi)

        return both

    tiled = twice(lambda m, xi: TiledMLP.apply(mlp_fn, m, xi, 3, None))
    a, b = run_twins(make, x, twice(mlp_fn), tiled, torch.ones_like)
    assert_twins(a, b, rtol=F64_RTOL)


@pytest.mark.parametrize("how", ["partita", "torch_reentrant"])
def test_tiled_mlp_under_activation_checkpointing_equals_the_mlp_bitwise(how: str) -> None:
    """Checkpointing reruns the tiled forward, whose backward then recomputes again (three
    forwards of the MLP); the gradients stay the untiled ones."""
    from torch.utils.checkpoint import checkpoint

    import partita.activations

    def tiled(module: nn.Module, xi: torch.Tensor) -> torch.Tensor:
        def body(h: torch.Tensor) -> torch.Tensor:
            return TiledMLP.apply(mlp_fn, module, h, 3, None) * 2

        if how == "partita":
            return partita.activations.checkpoint(body, xi)
        return checkpoint(body, xi, use_reentrant=True)

    x = ints(2, 9, H, seed=11)
    a, b = run_twins(make_mlp, x, lambda m, xi: m(xi) * 2, tiled, ints(2, 9, H, seed=12))
    assert_twins(a, b)


def count_hooks(module: nn.Module) -> dict[str, int]:
    counts = {name: 0 for name, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: counts.__setitem__(n, counts[n] + 1))
    return counts


def test_each_parameter_gets_its_gradient_once_per_tiled_backward() -> None:
    """ZeRO's hooks start a reduction when a gradient arrives: four shards must still be one
    arrival ([Note: parameter gradients of a tiled computation])."""
    mlp, head = make_mlp(), integer_weights(nn.Linear(H, V))
    seen_mlp, seen_head = count_hooks(mlp), count_hooks(head)
    x = ints(2, 12, H, seed=2).requires_grad_()
    h = TiledMLP.apply(mlp_fn, mlp, x, 4, None)
    h = sequence_tiled_compute(mlp_fn, 12, 4, {"x": h}, {"module": mlp}, "x", None, 1, None)
    y = torch.randint(0, V, (2, 12))
    TiledFusedLogitsLoss.apply(head_loss, head, h, y, None, 4, None, "sum").backward()
    assert set(seen_mlp.values()) == {2}  # two tiled calls of the same MLP
    assert set(seen_head.values()) == {1}


def stc(reduction: Any, dim: int, shards: int) -> Callable:
    """`sequence_tiled_compute` of `mlp_fn` (dim 1) or of a per-shard sum (dim 0)."""

    def fn(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        out = module(x)
        return out if dim == 1 else out.sum()

    def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return sequence_tiled_compute(
            fn, x.shape[1], shards, {"x": x}, {"module": module}, "x", [], dim, reduction
        )

    return run


def stc_plain(reduction: Any, dim: int, shards: int) -> Callable:
    def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if dim == 1:
            out = module(x)
        else:  # one value per shard, stacked
            out = torch.stack(
                [module(x[:, a:b]).sum() for a, b in shard_bounds(x.shape[1], shards)]
            )
        return {None: out, "sum": out.sum(), "mean": out.mean()}[reduction]

    return run


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
@pytest.mark.parametrize("dim", [1, 0])
@pytest.mark.parametrize("shards", [1, 3, 5])
def test_sequence_tiled_compute_equals_the_untiled_computation_bitwise(
    reduction: Any, dim: int, shards: int
) -> None:
    """16 tokens: 16, 6 + 6 + 4 and 4 x 4. A mean's incoming gradient 1 / count is exact
    when the count is a power of two (128 elements for dimension 1; 1 or 4 shards): bitwise on
    integers then; the mean of 3 shards is checked in float64 to `F64_RTOL`."""
    exact = reduction != "mean" or dim == 1 or len(shard_bounds(16, shards)) != 3
    dtype = torch.float32 if exact else torch.float64
    x = ints(2, 16, H, seed=9, dtype=dtype)
    grad = torch.ones_like if reduction is None else torch.tensor(1.0, dtype=dtype)
    a, b = run_twins(
        lambda: make_mlp(dtype), x, stc_plain(reduction, dim, shards), stc(reduction, dim, shards),
        grad,
    )  # fmt: skip
    assert_twins(a, b, rtol=0.0 if exact else F64_RTOL)


def head_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(head(x).view(-1, V), y.reshape(-1), reduction="sum")


def masked_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    per_token = nn.functional.cross_entropy(head(x).view(-1, V), y.reshape(-1), reduction="none")
    return (per_token * m).sum()


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shards", [1, 3, 4])
def test_tiled_fused_logits_loss_equals_the_untiled_loss(
    reduction: str, masked: bool, shards: int
) -> None:
    """float64 (cross-entropy's exp and log are not exact on integers), and the incoming
    gradient 3.0 (what gradient accumulation or a loss scale sends) reaches every gradient."""
    torch.manual_seed(0)
    x = torch.randn(2, 12, H, dtype=torch.float64)
    y = torch.randint(0, V, (2, 12))
    mask = torch.randint(0, 2, (2, 12)).double() if masked else None
    fn = masked_loss if masked else head_loss
    extra = () if mask is None else (mask.reshape(-1),)
    bounds = shard_bounds(24, shards)

    def plain(head: nn.Module, xi: torch.Tensor) -> torch.Tensor:
        rows, ys = xi.reshape(-1, H), y.reshape(-1)
        losses = torch.stack(
            [fn(head, rows[a:b], ys[a:b], *(e[a:b] for e in extra)) for a, b in bounds]
        )
        return losses.sum() if reduction == "sum" else losses.mean()

    def tiled(head: nn.Module, xi: torch.Tensor) -> torch.Tensor:
        return TiledFusedLogitsLoss.apply(fn, head, xi, y, mask, shards, None, reduction)

    def make() -> nn.Module:
        torch.manual_seed(1)
        return nn.Linear(H, V).double()

    a, b = run_twins(make, x, plain, tiled, torch.tensor(3.0, dtype=torch.float64))
    assert_twins(a, b, rtol=F64_RTOL)


def test_sequence_tiled_compute_names_bad_arguments() -> None:
    mlp, x = make_mlp(), torch.zeros(2, 8, H)

    def call(**change: Any) -> None:
        args: dict[str, Any] = {
            "fn": lambda x, module: module(x), "seqlen": 8, "shards": 2,
            "kwargs_to_shard": {"x": x}, "kwargs_to_pass": {"module": mlp},
            "grad_requiring_tensor_key": "x", "output_reduction": None,
        }  # fmt: skip
        args.update(change)
        sequence_tiled_compute(**args)

    with pytest.raises(ValueError, match=r"output_reduction='avg', expected one of \(None, 'mean'"):
        call(output_reduction="avg")
    with pytest.raises(ValueError, match=r"grad_requiring_tensor_key='h' is not among .*\['x'\]"):
        call(grad_requiring_tensor_key="h")
    with pytest.raises(
        ValueError, match=r"kwargs_to_shard\['x'\] must be a tensor \[batch, seqlen=9"
    ):
        call(seqlen=9)
    with pytest.raises(ValueError, match="shards=0"):
        call(shards=0)
    computed = torch.ones(3, requires_grad=True) * 2
    with pytest.raises(ValueError, match=r"kwargs_to_pass\['scale'\] needs a gradient"):
        call(kwargs_to_pass={"module": mlp, "scale": computed})


def test_tiled_fused_logits_loss_names_bad_arguments() -> None:
    head, x, y = nn.Linear(H, V), torch.zeros(2, 6, H), torch.zeros(2, 6, dtype=torch.long)

    def call(*, fn: Any = head_loss, y: Any = y, mask: Any = None, reduction: str = "sum") -> None:
        TiledFusedLogitsLoss.apply(fn, head, x, y, mask, 2, None, reduction)

    with pytest.raises(ValueError, match="output_reduction='none', expected 'mean' or 'sum'"):
        call(reduction="none")
    with pytest.raises(ValueError, match=r"x's \[batch, seq\] \(2, 6\) differs from y's \(2, 5\)"):
        call(y=y[:, :5])
    with pytest.raises(ValueError, match=r"mask must be \[batch, seq\] = \(2, 6\), got \(12,\)"):
        call(mask=torch.ones(12))
    with pytest.raises(ValueError, match=r"fn must return a scalar loss, got shape \(6, 32\)"):
        call(fn=lambda head, x, y: head(x))


# --- memory: bytes autograd keeps ------------------------------------------------------------


class _Handle:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytes:
    """Bytes of the storages autograd holds for backward (saved tensors), parameters left out:
    each saved tensor is packed into a handle whose death (its graph freed) releases it, so
    `now` is what the live graphs keep and `peak` its largest value."""

    def __init__(self, params: Any) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self.skip:
            return t
        if key not in self.refs:
            self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
            self.now += self.sizes[key]
            self.peak = max(self.peak, self.now)
        self.refs[key] += 1
        handle = _Handle(t)
        weakref.finalize(handle, self._release, key)
        return handle

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.now -= self.sizes.pop(key)

    def hooks(self) -> Any:
        unpack = lambda h: h.tensor if isinstance(h, _Handle) else h  # noqa: E731
        return torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)


def kept_bytes(module: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
    """(bytes kept after forward, peak bytes kept during forward and backward, bytes kept at
    the end) of ``run(x * 1)`` (a fresh activation, as a layer's input is)."""
    saved = SavedBytes(module.parameters())
    with saved.hooks():
        out = run(x.clone().requires_grad_() * 1.0)
        after_forward = saved.now
        out.backward(torch.ones_like(out))
    return after_forward, saved.peak, saved.now


F32 = 4


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_tiled_mlp_keeps_its_input_and_one_shards_intermediates(shards: int) -> None:
    """Untiled, an MLP keeps its input (B*S*H) and its activation (B*S*W) from forward to
    backward; tiled, only the input, and in backward one shard's copy of its input (s*H) and
    activation (s*W) on top (B=2, so a sequence slice is not contiguous and is copied, unless it
    is the whole sequence)."""
    b, s = 2, 12
    mlp = make_mlp()
    x = torch.randn(b, s, H)
    untiled = kept_bytes(mlp, lambda h: mlp(h), x)
    assert untiled == (b * s * (H + W) * F32, b * s * (H + W) * F32, 0)
    tiled = kept_bytes(mlp, lambda h: TiledMLP.apply(mlp_fn, mlp, h, shards, None), x)
    shard = b * (s // shards)
    copied = 0 if shards == 1 else shard * H  # one shard: the whole input, contiguous
    assert tiled == (b * s * H * F32, (b * s * H + copied + shard * W) * F32, 0)


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_tiled_fused_logits_loss_keeps_one_shards_logits(shards: int) -> None:
    """Untiled, the loss keeps the head's input (T*H), the log-probabilities (T*V), the
    targets (T int64) and cross-entropy's 4-byte total weight; tiled, the input and targets
    between forward and backward, and in backward one shard's log-probabilities (t*V) and total
    weight on top (a shard of the flat contiguous input is a view: no copy)."""
    tokens = 2 * 12
    head = integer_weights(nn.Linear(H, V))
    x, y = torch.randn(2, 12, H), torch.randint(0, V, (2, 12))
    untiled = kept_bytes(head, lambda h: head_loss(head, h, y), x)
    assert untiled == ((tokens * (H + V) + 1) * F32 + tokens * 8,) * 2 + (0,)
    tiled = kept_bytes(
        head,
        lambda h: TiledFusedLogitsLoss.apply(head_loss, head, h, y, None, shards, None, "sum"),
        x,
    )
    shard = tokens // shards
    inputs = tokens * H * F32 + tokens * 8
    assert tiled == (inputs, inputs + (shard * V + 1) * F32, 0)


# --- DeepSpeed's names -----------------------------------------------------------------------


def test_deepspeed_names_are_partitas_and_the_positional_form_matches() -> None:
    from partita.compat.deepspeed.runtime.sequence_parallel import ulysses_sp
    from partita.compat.deepspeed.runtime.zero import tiling

    assert (
        tiling.TiledLinear is TiledLinear and tiling.TiledLinearReturnBias is TiledLinearReturnBias
    )
    assert (
        ulysses_sp.TiledMLP is TiledMLP and ulysses_sp.TiledFusedLogitsLoss is TiledFusedLogitsLoss
    )
    assert ulysses_sp.sequence_tiled_compute is sequence_tiled_compute
    mlp, x = make_mlp(), ints(2, 8, H, seed=4)
    fn = lambda x, module: module(x)  # noqa: E731
    want = sequence_tiled_compute(fn, 8, 3, {"x": x}, {"module": mlp}, "x", None, 1, "sum")
    got = ulysses_sp.SequenceTiledCompute.apply(
        fn, 8, 3, ["x"], ["module"], "x", None, 1, "sum", x, mlp
    )
    assert_same(got, want)
    with pytest.raises(AttributeError, match="AutogradComputeMLP"):
        ulysses_sp.AutogradComputeMLP  # noqa: B018


# --- ZeRO at 2 ranks ---------------------------------------------------------------------------

TRAIN = [
    {"kind": "train", "stage": 3, "gas": 1, "dtype": "float32"},
    {"kind": "train", "stage": 2, "gas": 2, "dtype": "float32"},
    {"kind": "train", "stage": 0, "gas": 1, "dtype": "float32"},
    {"kind": "train", "stage": 3, "gas": 2, "dtype": "float64"},
]


GATHERS = [{"kind": "gathers", "parts": parts} for parts in ("", "mlp", "loss", "linear")]
COPY = [{"kind": "copy"}]


@pytest.fixture(scope="module")
def grid() -> list[list[Any]]:
    return run_distributed_grid(tiling_grid, WORLD, TRAIN + GATHERS + COPY, timeout=300)


@pytest.fixture(scope="module")
def trained(grid: list[list[Any]]) -> list[list[dict]]:
    return grid[: len(TRAIN)]


@pytest.mark.parity
def test_tiled_net_trains_like_one_untiled_process(trained: list[list[dict]]) -> None:
    """`TiledLinear` projection and head, two `TiledMLP`s and a `TiledFusedLogitsLoss`, ZeRO 0,
    2 and 3 at 2 ranks, 1 or 2 micro-batches per step, SGD: per-step losses within rtol 1e-6 of
    one process training the untiled net with torch.optim on the same global batch; float64
    final weights within 1e-12 (SGD moves a weight by lr times its gradient's rounding, a few
    2^-53 of gradients of order 1 over 4 steps)."""
    for case, ranks in zip(TRAIN, trained, strict=True):
        dtype = getattr(torch, case["dtype"])
        want = reference(dtype, case["gas"])
        for got in ranks:
            assert len(got["losses"]) == STEPS
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=0.0
            )
            if dtype == torch.float64:
                for name, value in want["state"].items():
                    torch.testing.assert_close(got["state"][name], value, rtol=0.0, atol=1e-12)


def test_zero3_gathers_each_tile_as_a_unit_of_its_own(trained: list[list[dict]]) -> None:
    """Every tile of both `TiledLinear`s is one ZeRO-3 unit holding exactly that tile's
    elements (weight, and bias on a row's last tile): the full weight is never gathered."""
    units = dict(trained[0][0]["units"])
    proj = {f"proj.linears.{o}.{i}": 2 * 3 + (i == 1) * 2 for o in range(3) for i in range(2)}
    head = {f"head.linears.{o}.{i}": (4 - o) * 2 for o in range(2) for i in range(3)}
    for name, numel in {**proj, **head}.items():
        assert units.get(name) == numel, (name, units)


def test_zero3_backward_gathers_with_tiled_mlps_as_without(grid: list[list[Any]]) -> None:
    """A tiled MLP's recomputation runs its block once per shard: under ZeRO-3 (units released
    as soon as used, no prefetch) the backward still gathers each unit once, in the untiled
    order and with the same elements live, on every rank. The LM head of a tiled loss is
    called only inside the loss (no forward with a graph of its own), so the reuse distance
    does not release it: it stays gathered (its 64 elements live) until the end of backward,
    the behaviour docs/parallelism.md states."""
    untiled, tiled_mlp, tiled_loss = grid[len(TRAIN) : len(TRAIN) + 3]
    for plain, mlp, loss in zip(untiled, tiled_mlp, tiled_loss, strict=True):
        assert [name for name, _ in plain] == ["head", "mlps.1", "mlps.0", "proj"]
        assert mlp == plain
        assert loss == [("head", 64)] + [(name, live + 64) for name, live in plain[1:]]


def test_zero3_backward_gathers_one_tile_at_a_time(grid: list[list[Any]]) -> None:
    """With units released as soon as used, the tiled head's backward gathers its 6 tiles one
    after another, each alone in memory (the same live elements after each gather: one padded
    tile), fewer than the untiled head's gather holds."""
    untiled, tiled = grid[len(TRAIN)], grid[len(TRAIN) + 3]
    for plain, tiles in zip(untiled, tiled, strict=True):
        head = [(name, live) for name, live in tiles if name.startswith("head.")]
        assert sorted(name for name, _ in head) == [
            f"head.linears.{o}.{i}" for o in range(2) for i in range(3)
        ]
        assert len({live for _, live in head}) == 1
        assert head[0][1] < dict(plain)["head"]


def test_copy_params_from_under_zero3_writes_rank_0s_values_everywhere(
    grid: list[list[Any]],
) -> None:
    """On a model ZeRO-3 has sharded, `copy_params_from` is collective: each tile is gathered,
    written with rank 0's source and re-sharded, so every rank holds rank 0's values even
    though each passed its own source."""
    for rank in grid[-1]:
        assert_same(rank["got"]["weight"], rank["want"]["weight"])
        assert_same(rank["got"]["bias"], rank["want"]["bias"])
