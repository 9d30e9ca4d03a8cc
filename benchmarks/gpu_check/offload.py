"""Section 2: offload for real. CPU and NVMe offload bitwise equal to none, host buffers
page-locked, and the copy-back's side stream hidden behind the next slice's CPU Adam step."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch

from .core import Case, Context, verdict
from .trainers import (
    Run,
    bitwise,
    compare,
    engine_config,
    first_step_close,
    train_partita,
)

S2 = "2 offload"
CPU = {"device": "cpu", "pin_memory": True}


def run_section2(ctx: Context) -> None:
    """Every offload variant against the same stage without offload, then the overlap."""
    mode = ctx.mode
    from .model import batches

    data = batches(mode.small, mode.steps, mode.small.micro, mode.device)
    plain: dict[int, Run] = {}
    for stage in (2, 3):
        config = engine_config(stage, "bf16", mode.small.micro)
        plain[stage] = train_partita(mode.small, config, data, mode.device)
    variants = [
        ("stage 2 offload_optimizer cpu", 2, {"offload_optimizer": CPU}),
        ("stage 3 offload_optimizer cpu", 3, {"offload_optimizer": CPU}),
        ("stage 3 offload_optimizer + offload_param cpu", 3, {"offload_optimizer": CPU, "offload_param": CPU}),
    ]  # fmt: skip
    for name, stage, zero in variants:
        ctx.run(S2, name, lambda n=name, s=stage, z=zero: _versus(ctx, n, s, z, data, plain[s]))
    ctx.run(S2, "stage 3 NVMe (optimizer and parameters)", lambda: _nvme(ctx, data, plain[3]))
    ctx.run(S2, "copy-back overlap", lambda: overlap_case(ctx), min_s=10)


def judge(ctx: Context, got: Run, plain: Run) -> tuple[bool, str, dict[str, Any]]:
    """An offloaded run against the same stage without offload. On CPU both step with the
    same kernels and must agree bitwise. On a GPU the reference steps with torch's fused CUDA
    AdamW and the offloaded run with partita's CPU Adam, which round differently: the masters
    after the first step must agree within `first_step_close`'s bound (stale or wrong
    gradients, a copy racing the step, miss it by ~1000x), later steps are reported."""
    figures = compare(got, plain)
    same = bitwise(figures)
    if not ctx.mode.is_cuda:
        return same, f"bitwise equal to no offload: {same}", figures
    close, worst = first_step_close(got, plain)
    figures["first_step_worst_ratio"] = worst
    text = (
        f"first-step masters within 2^-20 x (|w| + lr) of no offload: {close} (worst "
        f"{worst:.2g} of the bound); later steps: max loss diff {figures['max_loss_diff']:.2g}, "
        f"bitwise: {same} (CPU Adam vs fused CUDA AdamW)"
    )
    return close, text, figures


def _versus(ctx: Context, name: str, stage: int, zero: dict, data: list, plain: Run) -> Case:
    config = engine_config(stage, "bf16", ctx.mode.small.micro, **zero)
    got = train_partita(ctx.mode.small, config, data, ctx.mode.device, probe=host_buffers)
    ok, text, figures = judge(ctx, got, plain)
    figures["pinned"] = got.probe
    want_pinned = ctx.mode.is_cuda  # page-locking is skipped on CPU-only machines
    pinned_ok = all(n > 0 and (p == n) == want_pinned for n, p in got.probe.values())
    pins = ", ".join(f"{k} {p}/{n} pinned" for k, (n, p) in got.probe.items())
    return Case(S2, name, verdict(ok and pinned_ok), f"{text}; {pins}", figures)


def host_buffers(engine: Any) -> dict[str, tuple[int, int]]:
    """(count, page-locked count) of the strategy's host tensors: fp32 masters, stage-3 CPU
    shards and the copy-back staging buffers. Reads private attributes on purpose: what is
    checked is the memory the strategy really steps and copies from."""
    strategy = engine.strategy
    found: dict[str, list[torch.Tensor]] = {}
    if hasattr(strategy, "groups"):  # stages 1-2
        found["masters"] = [g.master for g in strategy.groups]
    if hasattr(strategy, "all_units"):  # stage 3
        found["masters"] = list(strategy._masters())
        shards = [u.flat_shard for u in strategy.all_units if u.flat_shard.device.type == "cpu"]
        if shards:
            found["cpu shards"] = shards
    found["masters"] = [m for m in found.get("masters", []) if m.device.type == "cpu"]
    host_step = getattr(strategy, "_host_step", None)
    if host_step is not None and host_step.sink.staged:
        found["staging buffers"] = [b for bs in host_step.sink._buffers.values() for b in bs]
    return {k: (len(v), sum(t.is_pinned() for t in v)) for k, v in found.items() if v}


def _nvme(ctx: Context, data: list, plain: Run) -> Case:
    """Swap files on the local disk (the output folder's filesystem)."""
    with tempfile.TemporaryDirectory(prefix="nvme-", dir=ctx.out_dir) as path:
        nvme = {"device": "nvme", "nvme_path": path}
        config = engine_config(
            3, "bf16", ctx.mode.small.micro, offload_optimizer=nvme, offload_param=nvme
        )
        got = train_partita(ctx.mode.small, config, data, ctx.mode.device)
        left = os.listdir(path)
    ok, text, figures = judge(ctx, got, plain)
    figures["swap_dir"] = path
    figures["files_left"] = left
    ok = ok and not left
    detail = f"swap files in {path}; {text}; files left: {len(left)}"
    return Case(S2, "stage 3 NVMe (optimizer and parameters)", verdict(ok), detail, figures)


class OverlapTimer:
    """Wraps a `CopyBack`'s calls to time each slice's CPU Adam step (between ``outs(k)``
    returning and ``done(k)``) and each slice's copy on the side stream (CUDA events around
    the copies, mapped onto the host clock through an event recorded at ``begin``)."""

    def __init__(self, sink: Any) -> None:
        self.sink, self.cuda = sink, sink._stream is not None
        self.steps: list[tuple[float, float]] = []
        self.copies: list[Any] = []
        self._ref: tuple[Any, float] | None = None
        begin, outs, done = sink.begin, sink.outs, sink.done
        sink.begin = lambda: self._begin(begin)
        sink.outs = lambda k: self._outs(outs, k)
        sink.done = lambda k: self._done(done, k)

    def _begin(self, begin: Any) -> None:
        self.steps, self.copies = [], []
        if self.cuda:
            torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # the device is idle: it takes this timestamp at once
            self._ref = (event, time.perf_counter())
        begin()

    def _outs(self, outs: Any, k: int) -> Any:
        got = outs(k)
        self.steps.append((time.perf_counter(), 0.0))
        return got

    def _done(self, done: Any, k: int) -> None:
        self.steps[-1] = (self.steps[-1][0], time.perf_counter())
        if not self.cuda:
            start = time.perf_counter()
            done(k)
            self.copies.append((start, time.perf_counter()))
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.sink._stream)
        done(k)
        end.record(self.sink._stream)
        self.copies.append((start, end))

    def intervals(self) -> list[tuple[float, float]]:
        """The copies as host-clock intervals (call after the step has finished)."""
        if not self.cuda:
            return list(self.copies)
        torch.cuda.synchronize()
        assert self._ref is not None
        event, t0 = self._ref
        return [
            (t0 + event.elapsed_time(s) / 1e3, t0 + event.elapsed_time(e) / 1e3)
            for s, e in self.copies
        ]


def hidden_fraction(copies: list[tuple[float, float]], steps: list[tuple[float, float]]) -> float:
    """Share of the total copy time that falls inside some slice's CPU step."""
    total = sum(e - s for s, e in copies)
    inside = sum(max(0.0, min(ce, se) - max(cs, ss)) for cs, ce in copies for ss, se in steps)
    return inside / total if total > 0 else 0.0


def overlap_case(ctx: Context) -> Case:
    """partita's host step (`step_with_copy_back`: CPU Adam slice by slice into two pinned
    staging buffers, copies on a side stream) on fp32 masters with bf16 device weights."""
    from partita.offload.copy_back import CopyBack
    from partita.optim import CPUAdamW
    from partita.platform.accelerator import pin_if
    from partita.zero.shard_step import slice_plan, step_with_copy_back

    mode, parts = ctx.mode, 4
    gen = torch.Generator().manual_seed(0)
    numel = mode.overlap_numel // parts
    masters = [
        torch.nn.Parameter(pin_if(True, torch.randn(numel, generator=gen))) for _ in range(parts)
    ]
    for m in masters:
        m.grad = pin_if(True, torch.randn(numel, generator=gen))
    weights = [torch.empty(numel, dtype=torch.bfloat16, device=mode.device) for _ in range(parts)]
    opt = CPUAdamW(masters, lr=1e-3)
    plan, dsts = slice_plan(masters, [[(0, w)] for w in weights], mode.overlap_slice)
    sink = CopyBack(dsts, staged=True)
    timer = OverlapTimer(sink)
    fractions, step_ms, copy_ms = [], [], []
    for i in range(4):  # the first step allocates Adam state: not counted
        start = time.perf_counter()
        step_with_copy_back(opt, plan, sink)
        copies = timer.intervals()
        if i > 0:
            fractions.append(hidden_fraction(copies, timer.steps))
            step_ms.append((time.perf_counter() - start) * 1e3)
            copy_ms.append(sum(e - s for s, e in copies) * 1e3)
    landed = all(
        torch.equal(w.cpu(), m.detach().to(torch.bfloat16))
        for w, m in zip(weights, masters, strict=True)
    )
    frac = statistics.median(fractions)
    busy = ctx.busy_note()
    figures = {
        "hidden_fraction": frac, "fractions": fractions, "slices": len(plan),
        "step_ms": statistics.median(step_ms), "copy_ms": statistics.median(copy_ms),
        "elements": mode.overlap_numel, "staging_pinned": all(b.is_pinned() for bs in sink._buffers.values() for b in bs),
        "weights_equal_masters": landed,
    }  # fmt: skip
    ctx.notes["overlap_hidden_fraction"] = frac
    where = "side stream" if timer.cuda else "CPU: no side stream, copies run in turn"
    detail = (
        f"{frac:.0%} of {figures['copy_ms']:.1f} ms copy time hidden behind CPU Adam "
        f"({len(plan)} slices, step {figures['step_ms']:.1f} ms, {where}); weights == masters: {landed}"
        + (f"; {busy}" if busy else "")
    )
    return Case(S2, "copy-back overlap", verdict(landed), detail, figures)
