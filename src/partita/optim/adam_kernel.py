"""partita's CPU Adam/AdamW kernel (``csrc/cpu_adam.cpp``): torch's fused update, bitwise.

`adam_step` updates fp32 CPU tensors exactly as ``torch._fused_adamw_`` / ``torch._fused_adam_``
(the kernels behind ``torch.optim.AdamW(fused=True)``) would, bit for bit, with one division per
element instead of two (see the C++ file's header for why that is exact). Measured on this
project's 2-core CPU host with ``benchmarks/bench_offload.py`` (docs/zero.md, offload).

The kernel is built on first use by `partita.platform.native` and checked against torch's kernel on
random data (both modes, with and without weight decay, both of torch's ``lerp`` branches,
zero and overflowing gradients); when the check fails, there is no compiler, the CPU has
neither AVX-512 nor AVX2, torch does not vectorise with them, or ``PARTITA_CPU_ADAM=0``, it is
not used and `why_not` says why: callers then use torch's kernel.

Work is split over ``torch.get_num_threads()`` of torch's OpenMP threads; the last ``n % W``
elements of each tensor, which torch computes in a differently compiled scalar
loop (W: torch's vector width), are handed to torch's kernel.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from partita.platform import env, native

__all__ = [
    "OUT_DTYPES",
    "AdamArgs",
    "Rows",
    "adam_step",
    "available",
    "plain_fp32",
    "supports",
    "torch_tail",
    "vector_body",
    "why_not",
]

logger = logging.getLogger(__name__)

_SOURCE = native.CSRC / "cpu_adam.cpp"
_WIDTHS = {"AVX512": 16, "AVX2": 8}
"""torch's float vector width per CPU capability: its kernels' split between body and tail."""


class _CArgs(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("step", ctypes.c_double),
        ("decoupled", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class AdamArgs:
    """One update's hyper-parameters, as torch's ``_fused_adam(w)_`` takes them; ``step`` is
    the 1-based number of this update (unused where `adam_step` is given step counters).
    ``decoupled``: AdamW (else Adam with the weight decay added to the gradient)."""

    step: float
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool


_lib: ctypes.CDLL | None = None
_isa = 0
_vector_width = 16
_why_not: str | None = None
_lock = threading.Lock()


def available() -> bool:
    """Whether `adam_step` may be used in this process (builds and checks the kernel once)."""
    global _lib, _why_not
    with _lock:
        if _lib is not None or _why_not is not None:
            return _lib is not None
        _why_not = _load()
        if _why_not is not None:
            _lib = None
            logger.info("partita CPU Adam kernel not used (torch's instead): %s", _why_not)
        return _lib is not None


def _load() -> str | None:
    """Builds, loads and checks the kernel (sets ``_lib``); returns why not, or None."""
    global _lib, _isa, _vector_width
    if not env.cpu_adam_enabled():
        return f"disabled by {env.CPU_ADAM.name}=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _WIDTHS:
        return f"torch's CPU kernels use {capability!r}, not AVX512 or AVX2"
    if (cxx := native.compiler()) is None:
        return "no C++ compiler found (set CXX)"
    try:
        # No contraction beyond the fused multiply-adds the source writes: they are torch's.
        # -fopenmp: libgomp.so.1 resolves to the copy torch has loaded, so the kernel runs on
        # torch's own OpenMP threads.
        symbols = ("partita_adam_isa", "partita_adam_step")
        flags = ["-ffp-contract=off", "-fopenmp"]
        lib = native.load_library(_SOURCE, cxx, symbols, flags=flags)
    except native.LibraryError as exc:
        return str(exc)
    lib.partita_adam_isa.restype = ctypes.c_int
    # Plain addresses: ctypes' per-call type checks of pointer arguments cost microseconds.
    lib.partita_adam_step.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
    lib.partita_adam_step.argtypes += [ctypes.c_void_p, ctypes.c_int64]
    lib.partita_adam_step.restype = None
    isa = lib.partita_adam_isa()
    if isa == 0 or (capability == "AVX512" and isa < 2):
        return f"this CPU lacks the instructions torch's {capability!r} kernels use"
    _lib, _isa, _vector_width = lib, (2 if capability == "AVX512" else 1), _WIDTHS[capability]
    mismatch = _self_check()
    return None if mismatch is None else f"differs from torch's fused kernel: {mismatch}"


def why_not() -> str | None:
    """Why `available` returned False (None when it returned True or was not called)."""
    return _why_not


def supports(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `adam_step` takes these tensors: dense, contiguous fp32 CPU tensors."""
    return all(plain_fp32(t) for t in tensors)


def plain_fp32(t: torch.Tensor) -> bool:
    """Whether `adam_step` takes ``t``: a dense, contiguous fp32 CPU tensor."""
    # Attribute checks only: ``t.device`` builds an object, and this runs for every tensor of
    # every step.
    return t.dtype is torch.float32 and t.is_cpu and t.layout is torch.strided and t.is_contiguous()


_OUT_KINDS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
"""The kernel's codes for the types it writes updated parameters in."""

OUT_DTYPES = tuple(_OUT_KINDS)
"""Types the kernel writes updated parameters in itself (``outs`` of `adam_step`, `Rows`)."""


def vector_body(numel: int) -> int:
    """How many leading elements of a ``numel``-element tensor torch's fused kernel computes in
    vectors; the rest (its scalar tail) round differently and go to torch's kernel, also when
    the tensor is stepped in slices (`Rows`)."""
    return numel - numel % _vector_width


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    args: AdamArgs,
    steps: Sequence[torch.Tensor] | None = None,
    outs: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """One Adam/AdamW update of ``params`` and their moments, in place; bitwise what torch's
    ``_fused_adamw_``/``_fused_adam_`` computes. Needs `available` and `supports` (every
    tensor); grads, moments and params match one to one in size. With ``steps`` (one float32
    0-dim CPU counter per parameter, as torch.optim's fused Adam keeps them) each counter is
    incremented and its new value is that parameter's step, as in ``torch.optim.AdamW.step``;
    without, every parameter takes ``args.step``. ``outs`` (optional, per parameter: None or a
    tensor of its size) also receives the updated parameter, converted as ``out.copy_(param)``
    would (in the kernel's pass when it is a contiguous host tensor of one of `OUT_DTYPES`)."""
    rows = Rows(args)
    for i, group in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        n = group[0].numel()
        out = None if outs is None else outs[i]
        if any(t.numel() != n for t in group) or (out is not None and out.numel() != n):
            sizes = [t.numel() for t in group] + ([] if out is None else [out.numel()])
            raise ValueError(f"adam_step: sizes differ: {sizes}")
        rows.add(*group, counter=None if steps is None else steps[i], out=out)
    rows.run()


class Rows:
    """One kernel call under construction: rows of (slices of) whole parameters at one
    `AdamArgs`, the scalar tails torch's kernel computes, and the copies the kernel cannot
    write (see ``partita_adam_step`` in the C++ file for the row layout)."""

    def __init__(self, args: AdamArgs) -> None:
        assert _lib is not None, "Rows needs available()"
        self.args = args
        self.rows: list[int] = []
        self.tails: list[tuple[torch.Tensor, ...]] = []  # torch's scalar tails: (p, g, m, v)
        self.tail_steps: list[torch.Tensor | None] = []  # their counters (None: args.step)
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (out, source) afterwards

    def add(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        start: int = 0,
        stop: int | None = None,
        counter: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """Elements ``[start, stop)`` of a parameter and its state: whole contiguous fp32 host
        tensors (the caller checked), addressed directly, so a slice costs no tensor views.
        ``counter`` (whole parameters only): the float32 step counter the kernel increments and
        uses instead of ``args.step``. ``out`` (``stop - start`` elements) gets the values."""
        tensors = (param.detach(), grad, exp_avg, exp_avg_sq)
        stop = param.numel() if stop is None else stop
        body = vector_body(param.numel())
        end = min(stop, body)
        direct = None  # the kernel writes host tensors of its types; others are copied after
        if out is not None and out.is_cpu and out.dtype in _OUT_KINDS and out.is_contiguous():
            direct = out
        # A row with a counter is kept even when empty: the kernel increments the counter
        # (a parameter smaller than one vector is all tail, and the tail reads the counter).
        if start < end or counter is not None:
            self.rows += [t.data_ptr() + 4 * start for t in tensors]
            self.rows += [0 if counter is None else counter.data_ptr(), max(0, end - start)]
            self.rows += [0, 0] if direct is None else [direct.data_ptr(), _OUT_KINDS[direct.dtype]]
        if max(start, body) < stop:  # the slice ends in torch's scalar tail
            cut = max(start, body)
            self.tails.append(tuple(t.view(-1)[cut:stop] for t in tensors))
            self.tail_steps.append(counter)
            if direct is not None:
                self.copies.append((direct.view(-1)[cut - start :], self.tails[-1][0]))
        if out is not None and direct is None:
            self.copies.append((out, tensors[0].view(-1)[start:stop]))

    def run(self) -> None:
        """The kernel on every row, torch's kernel on the tails (after: the counters hold this
        update's step then), then the copies."""
        if self.rows:
            _run_table(self.rows, self.args)
        if self.tails:
            step = torch.tensor(self.args.step)
            steps = [step if t is None else t for t in self.tail_steps]
            torch_tail([list(t) for t in zip(*self.tails, strict=True)], self.args, steps)
        for out, src in self.copies:
            out.view(-1).copy_(src)


def _run_table(rows: list[int], args: AdamArgs) -> None:
    """``partita_adam_step`` on rows of 8 integers."""
    assert _lib is not None
    table = (ctypes.c_int64 * len(rows))(*rows)
    c_args = _CArgs(
        args.lr, args.beta1, args.beta2, args.eps, args.weight_decay, args.step,
        1 if args.decoupled else 0,
    )  # fmt: skip
    threads = torch.get_num_threads()  # the kernel uses one below 32K elements
    _lib.partita_adam_step(ctypes.addressof(c_args), _isa, threads, table, len(rows) // 8)


def torch_tail(
    tensors: Sequence[Sequence[torch.Tensor]],
    args: AdamArgs,
    steps: Sequence[torch.Tensor],
) -> None:
    """torch's fused kernel on (params, grads, exp_avgs, exp_avg_sqs) lists, each at its step
    (a float32 0-dim tensor): the scalar tails `Rows` leaves to torch, and the reference of
    the self-check."""
    kernel = torch._fused_adamw_ if args.decoupled else torch._fused_adam_
    p, g, m, v = (list(t) for t in tensors)
    kernel(
        p, g, m, v, [], list(steps), lr=args.lr, beta1=args.beta1, beta2=args.beta2,
        weight_decay=args.weight_decay, eps=args.eps, amsgrad=False, maximize=False,
    )  # fmt: skip


def _self_check() -> str | None:
    """Compares `adam_step` with torch's kernel on random data; returns the first difference."""
    gen = torch.Generator().manual_seed(0)
    n = (1 << 18) + 37  # split over threads (when there are several), and a tail
    for decoupled in (True, False):
        for weight_decay in (0.0, 0.1):
            for beta1 in (0.9, 0.3):  # torch's lerp takes two branches at weight 0.5
                ours = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
                theirs = [t.clone() for t in ours]
                for step in range(1, 4):
                    grad = torch.randn(n, generator=gen) * 10.0 ** (8 * step - 16)
                    grad[::97] = 0.0
                    grad[5] = 1e30  # its square overflows: an infinite second moment
                    args = AdamArgs(step, 1e-2, beta1, 0.999, 1e-8, weight_decay, decoupled)
                    # The counter path (torch.optim's state) in half of the cases.
                    counter = [torch.tensor(float(step - 1))] if beta1 == 0.3 else None
                    adam_step([ours[0]], [grad], [ours[1]], [ours[2]], args, counter)
                    reference = ([theirs[0]], [grad.clone()], [theirs[1]], [theirs[2]])
                    torch_tail(reference, args, [torch.tensor(float(step))])
                    for name, a, b in zip(
                        ("param", "exp_avg", "exp_avg_sq"), ours, theirs, strict=True
                    ):
                        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                            return (
                                f"{name} after step {step} (decoupled={decoupled}, "
                                f"weight_decay={weight_decay}, beta1={beta1})"
                            )
    return _check_outs(gen)


def _check_outs(gen: torch.Generator) -> str | None:
    """Steps one tensor in slices of odd lengths with converted copies (``outs``) and compares
    parameters and copies with torch's kernel followed by ``Tensor.to``."""
    n = (1 << 16) + 21
    bounds = [0, 7, 1000, 33333, n - 5, n]
    for dtype in OUT_DTYPES:
        # Magnitudes from far below float16's subnormals to beyond its range.
        scale = torch.pow(10.0, torch.empty(n).uniform_(-12, 6, generator=gen))
        ours = [torch.randn(n, generator=gen) * scale, torch.zeros(n), torch.zeros(n)]
        theirs = [t.clone() for t in ours]
        grad = torch.randn(n, generator=gen)
        out = torch.empty(n, dtype=dtype)
        args = AdamArgs(1.0, 1e-3, 0.9, 0.999, 1e-8, 0.01, True)
        rows = Rows(args)
        for a, b in itertools.pairwise(bounds):
            rows.add(ours[0], grad, ours[1], ours[2], a, b, out=out[a:b])
        rows.run()
        torch_tail(
            ([theirs[0]], [grad.clone()], [theirs[1]], [theirs[2]]), args, [torch.tensor(1.0)]
        )
        if not torch.equal(ours[0].view(torch.int32), theirs[0].view(torch.int32)):
            return f"param stepped in slices (copies to {dtype})"
        expected = theirs[0].to(dtype)
        if not torch.equal(out.view(-1).view(torch.uint8), expected.view(torch.uint8)):
            return f"parameters written as {dtype}"
    return None
