"""The longest sequence that fits: one rank's activations as a function of the sequence length,
fitted from a few traces, and a search over lengths for each sequence-parallel degree and
configuration.

[Note: fitting activations over the sequence length]
For a fixed micro-batch, every tensor a forward saves has a size that is a polynomial of degree
at most two in the tokens a rank holds (position-wise tensors grow linearly, attention's score
matrices with the square; a few, such as rotary tables, not at all). So each saved storage of
three traces at different lengths, matched by the order in which the forward saved them, gives
its own quadratic exactly (Lagrange, in fractions), and at any other length the profile is
rebuilt storage by storage: the sums, each block's part and the largest tensor (a maximum of
quadratics, which is why the storages are fitted one by one rather than the totals). A trace
whose storages do not line up with the others (a model that saves different tensors at
different lengths) is refused rather than guessed, and so is a fit that does not predict a
fourth trace (`CHECK_LENGTH`) storage by storage. Under Ulysses the rank's traces are taken at
its own S/sp tokens ([Note: a rank's activations under Ulysses] in ``ulysses.py``), so the
polynomial is in the rank's tokens and the search steps the sequence by sp tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import torch

from partita.estimate.activations import ActivationProfile
from partita.estimate.memory import (
    PER_PARAM_GROUPS,
    Candidate,
    Estimate,
    Hardware,
    Settings,
    estimate,
)
from partita.estimate.model import ModelShape, describe_module, load_hf_config, meta_model
from partita.estimate.model import trace_rank as _trace_rank
from partita.estimate.plan import rank_need
from partita.estimate.tiled import Tiling
from partita.estimate.ulysses import check_sequence_parallel
from partita.estimate.units import EstimateError, format_bytes

__all__ = [
    "FIT_LENGTHS",
    "Longest",
    "SequenceFit",
    "fit_from",
    "fit_sequence",
    "format_longest",
    "groups",
    "longest_sequence",
    "shape_at",
]

FIT_LENGTHS = (64, 128, 192)
"""The rank's token counts traced for a fit (three points fix a quadratic)."""
CHECK_LENGTH = 320
"""A fourth token count the fit must predict storage by storage, or it is refused."""

Poly = tuple[Fraction, Fraction, Fraction]


def _fit3(xs: Sequence[int], ys: Sequence[int]) -> Poly:
    """The quadratic ``c0 + c1 x + c2 x^2`` through three points, exactly."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d01, d12 = Fraction(y1 - y0, x1 - x0), Fraction(y2 - y1, x2 - x1)
    c2 = (d12 - d01) / (x2 - x0)
    c1 = d01 - c2 * (x0 + x1)
    c0 = y0 - c1 * x0 - c2 * x0 * x0
    return c0, c1, c2


def _at(p: Poly, x: int) -> int:
    value = p[0] + p[1] * x + p[2] * x * x
    if value.denominator != 1 or value < 0:
        raise EstimateError(f"activation fit gives {value} bytes at {x} tokens per rank")
    return int(value)


def _sum(polys: Sequence[Poly]) -> Poly:
    zero = Fraction(0)
    return (
        sum((p[0] for p in polys), zero),
        sum((p[1] for p in polys), zero),
        sum((p[2] for p in polys), zero),
    )


@dataclass(frozen=True)
class SequenceFit:
    """One rank's activations as quadratics of its token count (`local`: seq_len / sp)."""

    sp: int
    storages: tuple[tuple[int, Poly], ...]
    """(block index or -1, bytes as a quadratic) of each saved storage."""
    inputs: tuple[Poly, ...]
    """Each block's input bytes."""
    blocks: tuple[Poly, ...]
    """Each block's saved bytes (the sum of its storages')."""
    total: Poly
    """All saved bytes."""
    distinct: tuple[Poly, ...]
    """The storages' different quadratics (the largest tensor is the largest of these)."""
    tail: tuple[Poly, ...] = ()
    """The storages saved after the last block's (the final norm, the LM head, the loss)."""
    recompute: Poly = (Fraction(0), Fraction(0), Fraction(0))
    """A tiled backward's transient (`ActivationProfile.recompute`)."""

    @classmethod
    def of(
        cls,
        sp: int,
        storages: Sequence[tuple[int, Poly]],
        inputs: Sequence[Poly],
        recompute: Poly | None = None,
    ) -> SequenceFit:
        """The fit of `storages`, block `inputs` and a tiled backward's `recompute`, with the
        sums a profile reads."""
        blocks = tuple(_sum([p for b, p in storages if b == i]) for i in range(len(inputs)))
        distinct = tuple(dict.fromkeys(p for _, p in storages))
        last = max((i for i, (b, _) in enumerate(storages) if b >= 0), default=len(storages))
        tail = tuple(p for _, p in storages[last + 1 :])
        total = _sum([p for _, p in storages])
        tiled = recompute or (Fraction(0), Fraction(0), Fraction(0))
        return cls(sp, tuple(storages), tuple(inputs), blocks, total, distinct, tail, tiled)

    def sizes(self, local: int) -> tuple[tuple[int, int], ...]:
        """Each storage's (block, bytes) at `local` tokens per rank, as a trace lists them."""
        return tuple((b, _at(p, local)) for b, p in self.storages)

    def head_bytes(self, local: int) -> int:
        """What the final norm, the LM head and the loss save at `local` tokens per rank, with
        backward's two transients of the largest tensor when it is theirs (the logits): the
        part of the activations a sequence-tiled loss (`partita.tiling`) would cut to a
        shard's."""
        saved = [_at(p, local) for p in self.tail]
        largest = self.profile(local).largest
        return sum(saved) + (2 * largest if largest in saved else 0)

    def profile(self, local: int) -> ActivationProfile:
        """The `ActivationProfile` of a rank holding `local` tokens of each sequence (without
        the per-storage list: `sizes` gives it)."""
        return ActivationProfile(
            _at(self.total, local),
            tuple(_at(p, local) for p in self.blocks),
            tuple(_at(p, local) for p in self.inputs),
            max((_at(p, local) for p in self.distinct), default=0),
            recompute=_at(self.recompute, local),
        )


def fit_from(
    trace: Callable[[int], ActivationProfile],
    sp: int,
    lengths: Sequence[int] = FIT_LENGTHS,
    check: int | None = CHECK_LENGTH,
) -> SequenceFit:
    """Fits ``trace(local tokens)`` at three `lengths` and checks the fit against a trace at
    `check` tokens (None: unchecked) ([Note: fitting activations over the sequence length])."""
    if len(lengths) != 3 or len(set(lengths)) != 3:
        raise EstimateError(f"a fit needs three different lengths, got {list(lengths)}")
    profiles = [trace(n) for n in lengths]
    layouts = {tuple(b for b, _ in p.storages) for p in profiles}
    if len(layouts) != 1 or len({len(p.block_inputs) for p in profiles}) != 1:
        raise EstimateError(
            "the model saves different tensors at "
            f"{', '.join(str(n) for n in lengths)} tokens per rank: its activations cannot "
            "be fitted over the sequence length"
        )
    storages = tuple(
        (block, _fit3(lengths, [p.storages[i][1] for p in profiles]))
        for i, (block, _) in enumerate(profiles[0].storages)
    )
    inputs = tuple(
        _fit3(lengths, [p.block_inputs[i] for p in profiles])
        for i in range(len(profiles[0].block_inputs))
    )
    if len(inputs) != len(profiles[0].block_saved):
        raise EstimateError("a trace's blocks and block inputs do not match")
    recompute = _fit3(lengths, [p.recompute for p in profiles])
    fit = SequenceFit.of(sp, storages, inputs, recompute)
    if check is not None:
        traced, predicted = trace(check), fit.profile(check)
        if fit.sizes(check) != traced.storages or (
            predicted.block_inputs,
            predicted.recompute,
        ) != (tuple(traced.block_inputs), traced.recompute):
            raise EstimateError(
                f"the activations fitted at {', '.join(map(str, lengths))} tokens per rank do "
                f"not predict the trace at {check}: they do not grow as a quadratic of the "
                "sequence length"
            )
    return fit


def fit_sequence(
    source: object,
    micro_batch: int,
    sp: int,
    dtype: torch.dtype = torch.bfloat16,
    attention: str = "traced",
    lengths: Sequence[int] = FIT_LENGTHS,
    tiling: Tiling | None = None,
) -> tuple[ModelShape, SequenceFit]:
    """The model's shape (without activations) and one Ulysses rank's fitted activations at
    ``sequence_parallel_size`` `sp`, from a Hugging Face config or folder `source`
    (`attention` as in `partita.estimate.ulysses.ATTENTION`)."""
    config = load_hf_config(source)
    check_sequence_parallel(config, sp)
    model = meta_model(config, dtype)
    shape = describe_module(model)
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "model")
    fit = fit_from(lambda n: _trace_rank(model, micro_batch, n, sp, attention, tiling), sp, lengths)
    return replace(shape, name=str(name), micro_batch=micro_batch), fit


def shape_at(shape: ModelShape, fit: SequenceFit, seq_len: int) -> ModelShape:
    """`shape` with the activations of a rank of `fit`'s degree at `seq_len` tokens."""
    if seq_len % fit.sp:
        raise EstimateError(f"seq_len {seq_len} does not divide by sequence_parallel_size {fit.sp}")
    return replace(shape, activations=fit.profile(seq_len // fit.sp), seq_len=seq_len)


@dataclass(frozen=True)
class Longest:
    """The longest sequence one configuration fits at one degree, and the estimates at it and
    at the next length (sp tokens more), which does not fit; `limit`: the search stopped at
    the largest length asked for (the answer is at least that)."""

    sp: int
    candidate: Candidate
    seq_len: int
    at: Estimate | None
    """The estimate at `seq_len`; None when not even sp tokens fit (then `seq_len` is 0)."""
    beyond: Estimate | None
    """The estimate at `seq_len + sp`; None when `limit`."""
    limit: bool = False
    head: int = 0
    """Of the activations at `seq_len`, the head and loss's (`SequenceFit.head_bytes`)."""


def longest_sequence(
    shape: ModelShape,
    fit: SequenceFit,
    candidate: Candidate,
    hardware: Hardware,
    max_seq_len: int,
    settings: Settings | None = None,
) -> Longest:
    """The largest multiple of ``fit.sp`` up to `max_seq_len` at which `candidate` fits
    `hardware` (memory grows with the length, so: doubling, then bisection)."""
    sp = fit.sp

    def at(local: int) -> Estimate:
        return estimate(shape_at(shape, fit, local * sp), candidate, hardware, settings)

    top = max_seq_len // sp
    if top < 1:
        raise EstimateError(
            f"max_seq_len {max_seq_len} is below sequence_parallel_size {sp} tokens"
        )
    first = at(1)
    if not first.fits:
        return Longest(sp, candidate, 0, None, first)
    lo, hi = 1, 2
    while hi <= top and at(hi).fits:
        lo, hi = hi, hi * 2
    if hi > top:
        if at(top).fits:
            return Longest(sp, candidate, top * sp, at(top), None, True, fit.head_bytes(top))
        hi = top
    while hi - lo > 1:  # at(lo) fits, at(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid).fits else (lo, mid)
    return Longest(sp, candidate, lo * sp, at(lo), at(lo + 1), head=fit.head_bytes(lo))


_GROUPS = ("weights", "grads", "optimizer", "buffers", "activations", "slack", "other")
"""The table's columns: `PER_PARAM_GROUPS`, with fp32 masters and moments as "optimizer"."""


def groups(e: Estimate) -> tuple[dict[str, int], int]:
    """One rank's bytes by group where its limit is checked (the device; on CPU ranks device
    and host, one memory), and its bytes elsewhere (host and NVMe; NVMe on CPU ranks)."""
    cpu = e.hardware.accelerator == "cpu"
    out, elsewhere = dict.fromkeys(_GROUPS, 0), 0
    for i in e.items:
        group = PER_PARAM_GROUPS.get(i.name, "other")
        group = "optimizer" if group in ("master", "moments") else group
        out[group] += i.device + (i.host if cpu else 0)
        elsewhere += i.nvme + (0 if cpu else i.host)
    return out, elsewhere


def _mib(n: int) -> str:
    """Bytes in MiB to a tenth: one step of sp tokens can be less than format_bytes shows."""
    return f"{n / 2**20:,.1f} MiB"


def _limit_text(hw: Hardware) -> str:
    """The memory one rank may use, as the estimate checks it."""
    cpu = hw.accelerator == "cpu"
    have = hw.host_memory if cpu else hw.device_memory
    assert have is not None
    usable = int(have * (1.0 - hw.headroom))
    if cpu:  # the node's host memory, shared by its ranks
        usable //= hw.devices_per_node
    kept = f", {hw.headroom:.0%} kept free" if hw.headroom else ""
    where = "host memory per node" if cpu else "per device"
    return f"{format_bytes(have)} {where} ({_mib(usable)} per rank usable{kept})"


def format_longest(
    shape: ModelShape,
    hw: Hardware,
    found: Sequence[Longest],
    positions: int | None = None,
    tiled: bool = False,
) -> str:
    """The table of `found`: per degree and configuration, the longest sequence and one rank's
    memory there by group, with the need one step (sp tokens) longer; `positions`: the model's
    own length limit (``max_position_embeddings``), named where an answer passes it; `tiled`:
    whether the activations were traced with sequence-tiled MLP or loss."""
    head = (
        f"{shape.name}: {shape.trainable / 1e9:.3g}B trainable parameters on {hw.nodes} node(s) "
        f"x {hw.devices_per_node} device(s), micro-batch {shape.micro_batch}; the longest "
        f"sequence that fits {_limit_text(hw)}, one rank's bytes there:"
    )
    names = [*_GROUPS[:5], "head+loss", *_GROUPS[5:]]
    cols = "".join(f" {g:>11s}" for g in names)
    lines = [head, f"{'sp':>3s} {'configuration':30s} {'seq_len':>9s} {'per rank':>8s}{cols}"
             f" {'rank need':>13s} {'+sp tokens':>13s} {'elsewhere':>10s}"]  # fmt: skip
    for r in found:
        label = f"{r.sp:>3d} {r.candidate.label:30s}"
        beyond = "-" if r.beyond is None else _mib(rank_need(r.beyond))
        if r.at is None:
            tokens = f"{r.sp} tokens need" if r.sp > 1 else "1 token needs"
            lines.append(f"{label} {'none':>9s} (even {tokens} {beyond} per rank)")
            continue
        length = (">=" if r.limit else "") + str(r.seq_len)
        values, elsewhere = groups(r.at)
        shown = [*list(values.values())[:5], r.head, *list(values.values())[5:]]
        parts = "".join(f" {format_bytes(v):>11s}" for v in shown)
        lines.append(
            f"{label} {length:>9s} {r.seq_len // r.sp:>8d}{parts}"
            f" {_mib(rank_need(r.at)):>13s} {beyond:>13s} {format_bytes(elsewhere):>10s}"
        )
    lines += _notes(found, positions, tiled)
    return "\n".join(lines)


def _notes(found: Sequence[Longest], positions: int | None, tiled: bool) -> list[str]:
    best = max(found, key=lambda r: r.seq_len, default=None)
    notes = []
    if best is not None and best.seq_len:
        notes.append(
            f"longest: {best.seq_len} tokens at sequence_parallel_size {best.sp} with "
            f"{best.candidate.label}"
        )
    if positions is not None and any(r.seq_len > positions for r in found):
        notes.append(
            f"note: answers above {positions} tokens pass the model's max_position_embeddings "
            "(memory allows them; the model must be trained or scaled for such positions)"
        )
    notes += [
        "note: seq_len steps by sp tokens; the groups are one rank's bytes where its limit is "
        "checked (the device; device and host on CPU ranks) and add up to 'rank need'; "
        "'head+loss' is the part of the activations the final norm, LM head and loss keep "
        "(with backward's transients of the logits), which a sequence-tiled loss would cut; "
        "'+sp tokens': the need one step longer, which does not fit; 'elsewhere': the rank's "
        "offloaded bytes (host, NVMe)",
        "note: activations are one Ulysses rank's: position-wise tensors at seq_len/sp tokens, "
        "attention's own (--attention: traced score matrices, or a fused kernel's) for h/sp "
        "heads of the whole sequence; model states shard over all ranks (dp x sp); "
        + (
            "MLP and loss tiled as --tiled_mlp / --tiled_loss say (a tiled backward's "
            "recompute counted as its transient); "
            if tiled
            else "sequence-tiled MLP and loss (--tiled_mlp, --tiled_loss) not used; "
        )
        + "the all-to-all buffers are not modelled",
    ]
    if any(r.limit for r in found):
        notes.append("note: >= : the search stopped at --max_seq_len")
    return notes
