"""partita's CPU Adam/AdamW kernel (``csrc/cpu_adam.cpp``): torch's fused update, bitwise.

`adam_step` updates fp32 CPU tensors exactly as ``torch._fused_adamw_`` / ``torch._fused_adam_``
(the kernels behind ``torch.optim.AdamW(fused=True)``) would, bit for bit, with one division per
element instead of two (see the C++ file's header for why that is exact). Measured on this
project's 2-core CPU host with ``benchmarks/bench_offload.py`` (README, offload section).

The kernel is built on first use by `partita.native` and checked against torch's kernel on
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
import os
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from partita import native

__all__ = [
    "OUT_DTYPES",
    "AdamArgs",
    "adam_step",
    "available",
    "out_kind",
    "plain_fp32",
    "run_rows",
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
    if os.environ.get("PARTITA_CPU_ADAM", "1") == "0":
        return "disabled by PARTITA_CPU_ADAM=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _WIDTHS:
        return f"torch's CPU kernels use {capability!r}, not AVX512 or AVX2"
    if (cxx := native.compiler()) is None:
        return "no C++ compiler found (set CXX)"
    try:
        # No contraction beyond the fused multiply-adds the source writes: they are torch's.
        # -fopenmp: libgomp.so.1 resolves to the copy torch has loaded, so the kernel runs on
        # torch's own OpenMP threads.
        path = native.build_library(_SOURCE, cxx, flags=["-ffp-contract=off", "-fopenmp"])
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"build or load failed: {exc}"
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
"""Types `adam_step` can also write the updated parameters in (``outs``)."""


def vector_body(numel: int) -> int:
    """How many leading elements of a ``numel``-element tensor torch's fused kernel computes in
    vectors; the rest (its scalar tail) round differently and go to torch's kernel. Slices of
    one tensor stepped separately (``tails``) must keep this boundary."""
    return numel - numel % _vector_width


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    args: AdamArgs,
    steps: Sequence[torch.Tensor] | None = None,
    outs: Sequence[torch.Tensor | None] | None = None,
    tails: Sequence[int] | None = None,
) -> None:
    """One Adam/AdamW update of ``params`` and their moments, in place; bitwise what torch's
    ``_fused_adamw_``/``_fused_adam_`` computes. Needs `available` and `supports` (every
    tensor); grads, moments and params match one to one in size. With ``steps`` (one float32
    0-dim CPU counter per parameter, as torch.optim's fused Adam keeps them) each counter is
    incremented and its new value is that parameter's step, as in ``torch.optim.AdamW.step``;
    without, every parameter takes ``args.step``.

    ``outs`` (optional, per parameter: None or a contiguous tensor of its size in one of
    `OUT_DTYPES`) also receives the updated parameter, converted as ``out.copy_(param)`` would,
    in the same pass over memory. ``tails`` (optional, per parameter) says where torch's
    scalar tail starts in it, for a slice of a larger tensor (`vector_body` of the whole, minus
    the slice's start, clipped to the slice); by default each tensor is whole."""
    assert _lib is not None, "adam_step needs available()"
    rows: list[int] = []  # per tensor: 4 addresses, its counter's (or 0), body length, out, kind
    tail_rows: list[tuple[int, int]] = []  # (tensor index, tail start)
    for i, group in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        n = group[0].numel()
        if any(t.numel() != n for t in group):
            raise ValueError(f"adam_step: sizes differ: {[t.numel() for t in group]}")
        out = None if outs is None else outs[i]
        if out is not None and (out.numel() != n or out.dtype not in _OUT_KINDS):
            raise ValueError(f"adam_step: out {i} is {out.dtype}[{out.numel()}] for {n} floats")
        cut = vector_body(n) if tails is None else max(0, min(n, tails[i]))
        rows += [t.data_ptr() for t in group]
        rows += [0 if steps is None else steps[i].data_ptr(), cut]
        rows += [0, 0] if out is None else [out.data_ptr(), out_kind(out)]
        if cut < n:
            tail_rows.append((i, cut))
    run_rows(rows, args)
    if tail_rows:  # after the kernel: the counters hold this update's step now
        _torch_tails(params, grads, exp_avgs, exp_avg_sqs, args, steps, outs, tail_rows)


def out_kind(out: torch.Tensor) -> int:
    """The kernel's code for writing updated parameters into ``out`` (its dtype must be one of
    `OUT_DTYPES`): the last two fields of a `run_rows` row are ``out.data_ptr()`` and this."""
    return _OUT_KINDS[out.dtype]


def run_rows(rows: Sequence[int], args: AdamArgs) -> None:
    """The kernel itself on rows of 8 integers each: the addresses of a parameter, its
    gradient, exp_avg and exp_avg_sq (contiguous fp32), of its step counter (or 0: the row
    uses ``args.step``), the number of elements, and the address (or 0) and `out_kind` of where
    the updated values are also written. The caller keeps torch's scalar tails out of the rows
    (`vector_body`) and the tensors alive; `adam_step` is the checked interface."""
    assert _lib is not None, "run_rows needs available()"
    if not rows:
        return
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
    """torch's fused kernel on (params, grads, exp_avgs, exp_avg_sqs) slices: the scalar
    tails `run_rows` leaves out, each at its step (a float32 0-dim tensor)."""
    kernel = torch._fused_adamw_ if args.decoupled else torch._fused_adam_
    p, g, m, v = (list(t) for t in tensors)
    kernel(
        p, g, m, v, [], list(steps), lr=args.lr, beta1=args.beta1, beta2=args.beta2,
        weight_decay=args.weight_decay, eps=args.eps, amsgrad=False, maximize=False,
    )  # fmt: skip


def _torch_tails(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    args: AdamArgs,
    steps: Sequence[torch.Tensor] | None,
    outs: Sequence[torch.Tensor | None] | None,
    tail_rows: list[tuple[int, int]],
) -> None:
    """Torch's kernel on the elements ``[cut:]`` of each listed tensor (its scalar tail)."""
    p, g, m, v = (
        [t[i].view(-1)[cut:] for i, cut in tail_rows]
        for t in (params, grads, exp_avgs, exp_avg_sqs)
    )
    one_step = torch.tensor(float(args.step))
    torch_tail((p, g, m, v), args, [one_step if steps is None else steps[i] for i, _ in tail_rows])
    for (i, cut), tail in zip(tail_rows, p, strict=True):
        out = None if outs is None else outs[i]
        if out is not None:
            out.view(-1)[cut:].copy_(tail)


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
                    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
                    kernel(
                        [theirs[0]], [grad.clone()], [theirs[1]], [theirs[2]], [],
                        [torch.tensor(float(step))], lr=1e-2, beta1=beta1, beta2=0.999,
                        weight_decay=weight_decay, eps=1e-8, amsgrad=False, maximize=False,
                    )  # fmt: skip
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
        pieces = list(itertools.pairwise(bounds))
        p, g, m, v = ([t[a:b] for a, b in pieces] for t in (ours[0], grad, ours[1], ours[2]))
        tails = [vector_body(n) - a for a, _ in pieces]
        adam_step(p, g, m, v, args, outs=[out[a:b] for a, b in pieces], tails=tails)
        torch._fused_adamw_(
            [theirs[0]], [grad.clone()], [theirs[1]], [theirs[2]], [], [torch.tensor(1.0)],
            lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
            maximize=False,
        )  # fmt: skip
        if not torch.equal(ours[0].view(torch.int32), theirs[0].view(torch.int32)):
            return f"param stepped in slices (copies to {dtype})"
        expected = theirs[0].to(dtype)
        if not torch.equal(out.view(-1).view(torch.uint8), expected.view(torch.uint8)):
            return f"parameters written as {dtype}"
    return None
