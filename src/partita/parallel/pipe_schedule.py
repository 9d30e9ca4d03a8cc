"""DeepSpeed's pipeline instruction generator: which instructions each stage runs, step by step.

[Note: pipeline schedules]
A schedule is a plan, not an executor. For one batch of `micro_batches` on a pipeline of
`stages`, the schedule of stage `stage_id` yields a list of instructions per step (load a
micro-batch, run a forward or backward pass, send or receive activations or gradients, reduce
gradients, step the optimizer); each instruction that touches data names the *buffer* holding
it. Steps line up across stages: what stage s sends at step t, stage s+1 receives at step t, so
a barrier between steps could never deadlock. Whatever runs a schedule (DeepSpeed's
``PipelineEngine``; in partita, a later executor on ``torch.distributed.pipelining``) maps each
instruction type to an action.

This module reproduces, instruction for instruction, the sequences of DeepSpeed's
``deepspeed/runtime/pipe/schedule.py`` (0.19.8), which DeepSpeed's tests and engine rely on:

- `TrainSchedule`: synchronous 1F1B. ``2 * (micro_batches + stages - 1)`` steps; at step t,
  stage s runs a forward pass when ``t - s`` is even (micro-batch ``(t - s) / 2``) and a
  backward pass otherwise (micro-batch ``(t + s + 1) / 2 - stages``); steps whose micro-batch
  is out of range are bubbles. Each step first passes on what the previous step produced
  (forward steps send the previous backward's input gradient upstream; backward steps send the
  previous forward's activation downstream), then receives its own input. The last step adds
  ``ReduceTiedGrads, ReduceGrads, OptimizerStep``. Buffers are reused cyclically:
  ``max(2, min(stages - stage_id, micro_batches))`` of them, the most forward passes in flight.
- `InferenceSchedule`: forward only, ``micro_batches + stages - 1`` steps, stage s runs
  micro-batch ``t - s`` at step t, with two buffers that alternate between receiving and
  sending; even stages send before they receive and odd stages receive before they send, so
  neighbouring stages pair their blocking calls.
- `DataParallelSchedule`: no pipeline; load, forward and backward every micro-batch in buffer
  0, then reduce and step.

The first and the last stage both load micro-batches (the first reads inputs, the last labels).

Instructions print as calls (``ForwardPass(buffer_id=2)``) and, unlike DeepSpeed's, compare by
value (same type and arguments), so schedules can be checked against hand-written sequences.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


class PipeInstruction:
    """One thing a pipeline stage does in a step. Keyword arguments become attributes (and
    ``kwargs``); ``name`` is the class name."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PipeInstruction):
            return NotImplemented
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after `ReduceGrads` and `ReduceTiedGrads`;
    may synchronise the data-parallel ranks)."""


class ReduceGrads(PipeInstruction):
    """Reduce this stage's gradients across its data-parallel ranks."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied (shared) modules across the stages that hold them; which
    stages take part is known only once the model is partitioned, so it may involve every
    stage."""


class CommitP2P(PipeInstruction):
    """Launch the queued sends and receives as one batch and wait for them (for schedules
    whose communication instructions only queue work, DeepSpeed's DualPipeV)."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on pipeline buffer `buffer_id`."""

    buffer_id: int

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch into the buffer's inputs (first stage) or labels (last)."""


class ForwardPass(BufferOpInstruction):
    """Run the stage's forward on the buffer's inputs, keeping its outputs."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the buffer's outputs with the gradients received for them (or from the
    loss on the last stage), accumulating parameter gradients."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (blocking; pairs with its
    `RecvActivation`)."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs as the buffer's inputs (blocking; pairs with its
    `SendActivation`)."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the buffer's inputs to the previous stage (blocking; pairs with
    its `RecvGrad`). Inputs that do not require grad send none."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the buffer's outputs from the next stage (blocking; pairs with
    its `SendGrad`)."""


class PipeSchedule(ABC):
    """The instructions stage `stage_id` of `stages` runs for one batch of `micro_batches`
    (see [Note: pipeline schedules]). Iterating yields one list of instructions per step;
    iterating again starts over. Subclasses implement `steps` and, to save memory, narrow
    `num_pipe_buffers`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__()
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1
        self.it: Iterator[list[PipeInstruction]] | None = None

    @abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yields each step's instructions, in order."""

    def num_pipe_buffers(self) -> int:
        """How many buffers the stage must allocate (by default one per micro-batch)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """The buffer holding `micro_batch_id` (buffers are reused round-robin)."""
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} not in [0, {self.micro_batches})")
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        """The stage this schedule is for."""
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    """Forward passes only, micro-batches streaming through the stages with two alternating
    buffers (see [Note: pipeline schedules])."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        even = self.stage_id % 2 == 0
        has_prev = self._valid_stage(self.prev_stage)
        has_next = self._valid_stage(self.next_stage)
        loads = self.is_first_stage or self.is_last_stage
        for step in range(self.micro_batches + self.stages - 1):
            micro_batch = step - self.stage_id
            current = self._valid_micro_batch(micro_batch)
            # This step receives into one buffer while the other holds the previous step's
            # output, still to be sent; even and odd stages flip which is which.
            recv_buf = step % 2 if even else (step + 1) % 2
            send_buf = 1 - recv_buf
            cmds: list[PipeInstruction] = []
            if loads and current:
                cmds.append(LoadMicroBatch(recv_buf))
            send: list[PipeInstruction] = []
            if has_next and self._valid_micro_batch(micro_batch - 1):
                send.append(SendActivation(send_buf))
            recv: list[PipeInstruction] = [RecvActivation(recv_buf)] if has_prev and current else []
            cmds += send + recv if even else recv + send
            if current:
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Two: one receiving, one sending."""
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B training (one forward, one backward, alternating once the pipeline is
    full); gradients accumulate over the micro-batches, so convergence is that of data
    parallelism at the same batch size (see [Note: pipeline schedules])."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        has_prev = self._valid_stage(self.prev_stage)
        has_next = self._valid_stage(self.next_stage)
        loads = self.is_first_stage or self.is_last_stage
        total = 2 * (self.micro_batches + self.stages - 1)
        previous = -1  # the micro-batch of the step before (possibly a bubble)
        for step in range(total):
            micro_batch, forward = self._step_to_micro_batch(step)
            current = self._valid_micro_batch(micro_batch)
            had_previous = self._valid_micro_batch(previous)
            cmds: list[PipeInstruction] = []
            if forward:
                if had_previous and has_prev:  # the previous step was a backward
                    cmds.append(SendGrad(self._buffer_idx(previous)))
                if current and has_prev:
                    cmds.append(RecvActivation(self._buffer_idx(micro_batch)))
                if current and loads:
                    cmds.append(LoadMicroBatch(self._buffer_idx(micro_batch)))
                if current:
                    cmds.append(ForwardPass(self._buffer_idx(micro_batch)))
            else:
                if current and has_next:
                    cmds.append(RecvGrad(self._buffer_idx(micro_batch)))
                if had_previous and has_next:  # the previous step was a forward
                    cmds.append(SendActivation(self._buffer_idx(previous)))
                if current:
                    cmds.append(BackwardPass(self._buffer_idx(micro_batch)))
            if step == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            previous = micro_batch
            yield cmds

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """(micro-batch, is_forward) of `step_id` on this stage; the micro-batch may be out of
        range (a bubble)."""
        if (step_id - self.stage_id) % 2 == 0:
            return (step_id - self.stage_id) // 2, True
        return (step_id + self.stage_id + 1) // 2 - self.stages, False

    def num_pipe_buffers(self) -> int:
        """The most forward passes in flight on this stage, whose activations wait for their
        backward: ``stages - stage_id`` (capped by the micro-batches), and at least 2."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """No pipeline: gradient accumulation over the micro-batches in one buffer, then reduce
    and step."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step in range(self.micro_batches):
            cmds: list[PipeInstruction] = [
                LoadMicroBatch(buffer_id=0),
                ForwardPass(buffer_id=0),
                BackwardPass(buffer_id=0),
            ]
            if step == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        """One."""
        return 1


__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "CommitP2P",
    "DataParallelSchedule",
    "ForwardPass",
    "InferenceSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
]
