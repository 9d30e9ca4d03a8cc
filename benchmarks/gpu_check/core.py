"""What every case shares: the run's mode (GPU or dry), its time budget and the case record.

A case is a function returning a `Case`; `Context.run` times it, turns an exception into an
``error`` case and, once the budget is spent, records ``not run (time)`` instead of starting
it. ``fail`` and ``error`` make the script exit non-zero; ``skip`` (something the machine
lacks, said in the detail) and ``not run (time)`` do not.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .model import Shape

PASS, FAIL, ERROR, SKIP, NOT_RUN = "pass", "fail", "error", "skip", "not run (time)"
FAILING = (FAIL, ERROR)

# Optimizer hyper-parameters of every run (torch.optim.AdamW's defaults but the lr).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01

H200_BF16_DENSE_FLOPS = 989e12
"""NVIDIA's H200 SXM bf16 dense Tensor Core peak (989 TFLOPS; 1979 is with sparsity)."""


@dataclass
class Case:
    """One check's outcome: ``figures`` are numbers for the JSON and table."""

    section: str
    name: str
    status: str
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class Mode:
    """Sizes and device of this run: the GPU run, or the dry run on CPU at tiny sizes."""

    dry: bool
    device: torch.device
    small: Shape
    """The correctness, offload and checkpoint model."""
    big: Shape
    """The speed model (about 1B parameters on the GPU)."""
    steps: int
    """Optimizer steps of each correctness run."""
    speed_warmup: int
    speed_steps: int
    overlap_numel: int
    """Elements of the offload-overlap harness's fp32 masters."""
    overlap_slice: int
    """Elements per slice of that harness (the engine's `COPY_SLICE_NUMEL` on the GPU)."""
    micro_batches: tuple[int, ...]
    """Micro-batches the speed section tries, largest first (the first that fits wins)."""

    @property
    def is_cuda(self) -> bool:
        """True for the GPU run."""
        return self.device.type == "cuda"

    @classmethod
    def detect(cls, dry: bool) -> Mode:
        """The GPU mode when CUDA is present and ``dry`` is not asked for, else the dry mode."""
        if dry or not torch.cuda.is_available():
            small = Shape(vocab=64, dim=32, layers=2, heads=2, seq=16, micro=4)
            big = Shape(vocab=256, dim=64, layers=2, heads=2, seq=64, micro=2, sdpa=True)
            return cls(True, torch.device("cpu"), small, big, 3, 1, 2, 1 << 16, 1 << 14, (2, 1))
        small = Shape(vocab=512, dim=256, layers=4, heads=4, seq=128, micro=8)
        # 18 blocks of 2048 and GPT-2's vocabulary padded to a multiple of 128: 1.01B params.
        big = Shape(vocab=50304, dim=2048, layers=18, heads=16, seq=1024, micro=16, sdpa=True)
        return cls(
            False, torch.device("cuda", 0), small, big, 4, 2, 4, 1 << 26, 1 << 22,
            (32, 16, 8, 4, 2, 1),
        )  # fmt: skip


@dataclass
class Context:
    """The run's mode, deadline, output folder and collected cases."""

    mode: Mode
    deadline: float
    """time.monotonic() after which no further case starts."""
    out_dir: str
    perturb: str = ""
    """A case name to break on purpose (``--perturb``): shows that the check can fail."""
    cases: list[Case] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    jobs: dict[str, Any] = field(default_factory=dict)
    """Background work started early (the DeepSpeed ops build); not reported."""

    def busy_note(self) -> str:
        """A note for timings taken while background work (the DeepSpeed ops build) runs."""
        job = self.jobs.get("ds_build")
        return "DeepSpeed ops build was running alongside" if job and job.poll() is None else ""

    def left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - time.monotonic()

    def run(
        self, section: str, name: str, fn: Callable[[], Case | list[Case]], min_s: float = 0.0
    ) -> list[Case]:
        """Runs ``fn`` unless fewer than ``min_s`` seconds are left; records and returns its
        cases (an exception becomes one ``error`` case carrying the traceback's tail)."""
        if self.left() < min_s:
            cases = [Case(section, name, NOT_RUN, f"{self.left():.0f} s left, needs ~{min_s:.0f}")]
        else:
            start = time.monotonic()
            try:
                got = fn()
                cases = got if isinstance(got, list) else [got]
            except Exception as exc:  # a crashed case is reported, the others still run
                tail = traceback.format_exc().strip().splitlines()[-6:]
                cases = [Case(section, name, ERROR, f"{type(exc).__name__}: {exc}")]
                cases[0].figures["traceback"] = tail
            elapsed = time.monotonic() - start
            for c in cases:
                c.seconds = c.seconds or elapsed / len(cases)
        for c in cases:
            print(f"[gpu_check] {c.section} / {c.name}: {c.status} {c.detail}", flush=True)
        self.cases.extend(cases)
        return cases


def verdict(ok: bool) -> str:
    """``pass`` or ``fail``."""
    return PASS if ok else FAIL


def free_device_memory() -> None:
    """Returns cached blocks to the driver and resets the peak counter between cases."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_device_gb() -> float | None:
    """Peak device memory held by tensors since the last reset, GB (None on CPU)."""
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
