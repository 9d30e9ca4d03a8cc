"""Pipeline schedules from ``torch.distributed.pipelining`` for a `PipelineModule`.

[Note: torch pipeline schedules]
The config's ``pipeline.schedule`` picks who runs a batch: ``"1f1b"`` (the default) is
partita's executor of DeepSpeed's `TrainSchedule` instructions; ``"interleaved_1f1b"`` and
``"zero_bubble"`` are torch's ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``,
which run several chunks per rank (``PipelineModule(virtual_stages=v)``: rank s holds chunks
s, s + P, ...; the bubble of 1F1B, (P - 1) / (m + P - 1) of a step for P stages and m
micro-batches, shrinks about v times, and zero-bubble schedules fill it with weight-gradient
work). torch schedules, partita does the rest, as for its own executor
([Note: pipeline engine] in `partita.parallel.pipe_engine`):

- one `torch.distributed.pipelining.PipelineStage` per local chunk, over the pipeline group
  (group rank = stage), each wrapping the chunk's layers (`PipelineModule.forward_chunk`);
- the batch's ``gradient_accumulation_steps`` micro-batches are read on the first and last
  stage and concatenated; torch cuts them back into the same micro-batches;
- the loss function torch calls is the module's, divided by the micro-batch count and times
  the loss scale, as partita's executor back-propagates it (``scale_grads=False``: torch does
  not rescale the gradients afterwards);
- the strategy's reduction stays disarmed during the schedule (gradients accumulate; at ZeRO
  2-3 every bucket or unit is held, so nothing is reduced mid-schedule); the zero-bubble weight
  step assigns ``.grad`` without firing autograd's hooks, so after the schedule those gradients
  are handed to the strategy (`Strategy.absorb_grads`); then the tied gradients are summed over
  stages, the data-parallel reduction runs, and the engine steps, exactly as after partita's
  own schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from partita.parallel.pipe_module import PipelineModule

if TYPE_CHECKING:
    from partita.parallel.pipe_engine import PipelineEngine

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")
"""``pipeline.schedule`` values: partita's executor, then torch's two interleaved schedules."""


class _Chunk(nn.Module):
    """One local chunk as the module torch's stage runs: its layers registered (so the
    stage sees their parameters), its forward the pipeline module's for that chunk."""

    def __init__(self, pipe: PipelineModule, k: int) -> None:
        super().__init__()
        self._run = lambda x: pipe.forward_chunk(k, x)  # not a submodule: no parameter twice
        self.layers = nn.ModuleList(pipe.chunk_modules(k))

    def forward(self, *inputs: Any) -> Any:
        return self._run(inputs[0] if len(inputs) == 1 else inputs)


def _schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import (
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    return {"interleaved_1f1b": ScheduleInterleaved1F1B,
            "zero_bubble": ScheduleInterleavedZeroBubble}[name]  # fmt: skip


def check_schedule(name: str, stages: int, virtual: int, micro_batches: int) -> None:
    """Refuses, before any collective, a schedule this pipeline cannot run (ValueError naming
    the key and the numbers)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: {name!r} is not one of {list(SCHEDULES)}")
    if name == "1f1b" and virtual > 1:
        raise ValueError(
            f"pipeline.schedule: '1f1b' runs one chunk per stage, the module has "
            f"virtual_stages={virtual}; use 'interleaved_1f1b' or 'zero_bubble'"
        )
    if name != "1f1b" and stages < 2:
        raise ValueError(
            f"pipeline.schedule: {name!r} needs at least 2 pipeline stages (torch's schedules "
            f"fail with num_stages={stages}); use '1f1b'"
        )
    if name == "1f1b" and micro_batches < stages:
        # DeepSpeed runs it, with most stages idle most of the step: 1F1B's bubble is
        # (P - 1) / (m + P - 1), over half the step when m < P.
        raise ValueError(
            f"pipeline.schedule: '1f1b' needs gradient_accumulation_steps ({micro_batches}), "
            f"the micro-batch count, to be at least the {stages} pipeline stages"
        )
    if name != "1f1b":
        rounds = max(1, micro_batches // stages)
        if micro_batches % rounds or micro_batches < stages:
            raise ValueError(
                f"pipeline.schedule {name!r}: gradient_accumulation_steps ({micro_batches}) "
                f"must be at least the {stages} stages and a multiple of "
                f"gradient_accumulation_steps // stages ({rounds})"
            )


class TorchSchedule:
    """Runs training batches of `engine` with torch's schedule `name` (see the note)."""

    def __init__(self, engine: PipelineEngine, name: str) -> None:
        from torch.distributed.pipelining import PipelineStage

        pipe = engine.module
        assert isinstance(pipe, PipelineModule)
        self.pipe = pipe
        self.engine = engine
        self.losses: list[torch.Tensor] = []
        chunks = pipe.num_stages * pipe.virtual_stages
        group = engine.grid.get_pipe_parallel_group()
        self.stages = [
            PipelineStage(_Chunk(pipe, k), c, chunks, engine.device, group=group)
            for k, c in enumerate(pipe.local_chunks)
        ]
        self.schedule = _schedule_class(name)(
            self.stages, engine.micro_batches, loss_fn=self._loss, scale_grads=False
        )
        self._mode: str | None = None
        self._evaluating = False

    def _enter(self, mode: str) -> None:
        """torch runs every chunk once more before the first batch and at each switch between
        training and evaluation, to learn the shapes: those calls are not micro-batches for
        the per-layer seeds (`PipelineModule.expect_metadata_pass`)."""
        if self._mode != mode:
            self.pipe.expect_metadata_pass()
            self._mode = mode

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """What torch back-propagates for a micro-batch: the module's loss over the
        micro-batch count, times the loss scale; the plain loss is kept for the report."""
        engine = self.engine
        assert self.pipe.loss_fn is not None  # the last stage computes the loss
        loss = self.pipe.loss_fn(output, target)
        self.losses.append(loss.detach())  # torch's metadata pass, if any, adds one first
        if self._evaluating:
            return loss
        share = loss / engine.micro_batches if engine.micro_batches > 1 else loss
        if engine.loss_scaler.scale != 1.0:
            share = share.float() * engine.loss_scaler.scale
        return share

    def train_batch(self, read: Callable[[], Any]) -> torch.Tensor | None:
        """One batch: reads the micro-batches, runs the schedule with the reduction disarmed;
        returns the sum of the micro-batches' losses on the last stage (None elsewhere)."""
        engine = self.engine
        args, kwargs = self._inputs(read)
        self._enter("train")
        engine.strategy.begin_backward(False)  # reduced after the schedule
        self.schedule.step(*args, **kwargs, return_outputs=False)
        # The zero-bubble weight step assigns ``.grad`` itself, which fires no hook.
        engine.strategy.absorb_grads([p for p in self.pipe.parameters() if p.requires_grad])
        engine.strategy.end_backward()
        return self._loss_sum()

    def eval_batch(self, read: Callable[[], Any]) -> tuple[torch.Tensor | None, Any]:
        """Forward passes over one batch of micro-batches without gradients (torch's
        ``eval``); on the last stage the sum of their plain losses and the outputs of the last
        micro-batch (None and None elsewhere)."""
        args, kwargs = self._inputs(read)
        self._enter("eval")
        self._evaluating = True
        try:
            with torch.no_grad():
                merged = self.schedule.eval(*args, **kwargs)
        finally:
            self._evaluating = False
        if not self.engine.is_last_stage():
            return None, None
        return self._loss_sum(), _last_micro_batch(merged, self.engine.micro_batches)

    def _inputs(self, read: Callable[[], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The batch's micro-batches read (first and last stage) and joined as the schedule's
        arguments; the loss record emptied."""
        engine = self.engine
        batches = [read() for _ in range(engine.micro_batches)] if _reads(engine) else []
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if engine.is_first_stage():
            args = _cat([b[0] for b in batches], engine.device)
        if engine.is_last_stage():
            kwargs["target"] = _cat([b[1] for b in batches], engine.device)[0]
        self.losses = []
        return args, kwargs

    def _loss_sum(self) -> torch.Tensor | None:
        if not self.engine.is_last_stage():
            return None
        real = self.losses[-self.engine.micro_batches :]  # after the metadata pass's, if any
        return torch.stack(real).sum()


def _last_micro_batch(merged: Any, micro_batches: int) -> Any:
    """The last micro-batch's part of torch's merged outputs (micro-batches joined along dim
    0), a tensor or a tuple of them."""
    if torch.is_tensor(merged):
        return merged.chunk(micro_batches)[-1]
    return tuple(t.chunk(micro_batches)[-1] for t in merged)


def _reads(engine: PipelineEngine) -> bool:
    return engine.is_first_stage() or engine.is_last_stage()


def _cat(parts: list[Any], device: torch.device) -> tuple[Any, ...]:
    """Micro-batches (tensors or tuples of tensors) joined along dim 0, as a tuple of
    arguments."""
    if torch.is_tensor(parts[0]):
        return (torch.cat(parts).to(device),)
    return tuple(torch.cat(list(t)).to(device) for t in zip(*parts, strict=True))


__all__ = ["SCHEDULES", "TorchSchedule", "check_schedule"]
