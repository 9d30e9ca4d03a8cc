"""DeepSpeed's ``PipelineEngine``: runs a `PipelineModule` stage by stage with 1F1B.

[Note: pipeline engine]
`partita.initialize` returns a `PipelineEngine` when the model is a `PipelineModule`. It is the
ordinary `partita.engine.Engine` (precision, the ZeRO strategy over the stage's data-parallel
group, the loss scaler, the learning-rate schedule, monitors and counters are all the
engine's) plus an executor of `partita.parallel.pipe_schedule` instructions:

- ``train_batch(data_iter)`` runs one `TrainSchedule`: ``gradient_accumulation_steps``
  micro-batches, the first stage reading inputs and the last stage labels from its iterator.
  Activations go forward and their gradients backward with blocking point-to-point transfers
  (`partita.comm.p2p`); the first transfer of each batch is preceded by a small header with the
  tensors' count, dtypes and shapes, so stages need not know each other's shapes.
- The last stage back-propagates ``loss / gradient_accumulation_steps`` (times the loss scale);
  the other stages back-propagate the gradients they receive. Every backward runs with the
  strategy's reduction disarmed, so gradients only accumulate; then ``ReduceTiedGrads`` sums
  the gradients of tied weights over the stages holding them, and ``ReduceGrads`` arms the
  strategy and ends an empty backward, which reduces every bucket as it stands over the
  data-parallel group (stage 0: all-reduce; stage 1: reduce-scatter into the fp32 gradient
  shards). Tied sums therefore happen before the data-parallel reduction, as in DeepSpeed, and
  ZeRO 1 sees the tied gradients whole.
- ``OptimizerStep`` averages the loss over micro-batches and data-parallel ranks on the last
  stage, broadcasts it to the pipeline (what ``train_batch`` returns on every rank), and takes
  the engine's own step. The gradient norm (clipping, the fp16 overflow check) is summed over
  the pipeline's stages too: the strategy's tensor-parallel norm hook
  (`partita.zero.shard_step.TensorParallelNorm`) is pointed at the pipe group, with the copies
  of tied weights after the first counted zero times, so every stage takes the same decision.
  With a model (tensor) axis (``PipeModelDataParallelTopology``, the user's layers split over
  the grid's slice group as Megatron's are) the norm sums over the pipe and slice ranks of one
  data-parallel index, a parameter without ``tensor_model_parallel`` counted on slice 0 only;
  the data-parallel group, over which ZeRO shards, is the ranks of one stage and slice.

The config's ``pipeline.schedule`` may hand the batch to one of torch's interleaved schedules
instead (``interleaved_1f1b``, ``zero_bubble``, with ``PipelineModule(virtual_stages=v)``; see
[Note: torch pipeline schedules] in `partita.parallel.pipe_torch`); what happens around the
schedule (tied sums, the reduction, the step, the loss report) is the same.

ZeRO stages 2 and 3 (which DeepSpeed refuses with pipelines) reduce-scatter inside every
backward, so full gradients never pile up over the micro-batches (stage 3 also gathers each
stage's parameters unit by unit); the buckets or units holding tied weights are held back
(``hold_gradients``) until ``ReduceTiedGrads`` has summed their gradients over the stages, and
``ReduceGrads`` then reduces just those. Under torch's schedules, which own the backward calls,
every bucket or unit is held and reduced once after the schedule (as torch's pipelining does
with FSDP2). Engine
checkpoints hold every stage, each stage's group writing its own files ([Note: pipeline stage
checkpoints] in `partita.checkpoint.stages`), and load at any pipeline degree; the module's
weights also save and load per layer (`PipelineModule.save_state_dict` / ``load_state_dir``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from partita import comm
from partita.comm import p2p
from partita.config import DeepSpeedConfig, config_error
from partita.engine import Engine
from partita.parallel import pipe_schedule as sched
from partita.parallel.pipe_module import PipelineError, PipelineModule
from partita.parallel.pipe_torch import TorchSchedule, check_schedule
from partita.zero.shard_step import TensorParallelNorm

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
"""Dtypes a stage may pass on, by their id in the transfer header (DeepSpeed's order)."""

Payload = torch.Tensor | tuple[torch.Tensor, ...]


class PipelineEngine(Engine):
    """Trains a `PipelineModule` with 1F1B over its pipeline stages (see [Note: pipeline
    engine]). Use `train_batch` and `eval_batch`; ``forward``, ``backward`` and ``step`` raise,
    as in DeepSpeed."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: DeepSpeedConfig,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine needs a PipelineModule, got {type(module).__name__}")
        check_pipeline_config(config, module)
        super().__init__(module, config, *args, **kwargs)
        self.grid = module.mpu()
        self.num_stages = self.grid.get_pipe_parallel_world_size()
        self.stage_id = self.grid.get_stage_id()
        self.micro_batches = self.gradient_accumulation_steps()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.prev_rank = self.grid.stage_to_global(self.stage_id - 1) if self.stage_id else -1
        self.next_rank = (
            self.grid.stage_to_global(self.stage_id + 1) if not self.is_last_stage() else -1
        )
        self.data_iterator: Iterator[Any] | None = None
        self._torch_schedule: TorchSchedule | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.dp_group_loss: torch.Tensor | None = None
        self._compute_loss = True
        self._return_logits = False
        self.outputs: Any = None
        self._pipe_buffers: dict[str, list[Any]] = {}
        self._total_loss: torch.Tensor | None = None
        self._fwd_outputs: list[Any] = []
        self._send_meta = True
        self._recv_meta: list[tuple[torch.dtype, list[int]]] | None = None
        self._recv_tuple = False
        self._dynamic_shape = bool(module.dynamic_shape)
        self._point_norm_at_pipeline(module)
        # ZeRO 2-3 reduce inside every backward; the tied weights' gradients must first be
        # summed over the stages, so they wait in held buckets ([Note: pipeline engine]).
        # Under torch's schedules every gradient waits (they own the backward calls), at any
        # pipeline degree.
        torch_schedule = module.schedule != "1f1b"
        self._held = self.zero_optimization_stage() >= 2 and (self.num_stages > 1 or torch_schedule)
        if self._held:
            held = [w for w, _ in module.get_tied_weights_and_groups()]
            if torch_schedule:
                held = [p for p in module.parameters() if p.requires_grad]
            self.strategy.hold_gradients(held)  # type: ignore[attr-defined]

    def _point_norm_at_pipeline(self, module: PipelineModule) -> None:
        """Makes the strategy's gradient norm sum over the pipeline's stages, counting each
        tied weight once (see [Note: pipeline engine])."""
        if self.num_stages == 1:
            return
        if not hasattr(self.strategy, "tensor"):
            raise NotImplementedError(
                f"the {type(self.strategy).__name__} strategy cannot run in a pipeline stage"
            )
        skipped = list(module.replicated_tied_parameters())
        group: comm.ProcessGroup | None = self.grid.get_pipe_parallel_group()
        if self.grid.get_slice_parallel_world_size() > 1:
            # Tensor slices too ([Note: pipeline engine]): the squares sum over every rank of
            # this data-parallel index, and a parameter the slices hold whole counts on slice 0.
            group = self.grid.get_model_parallel_group()
            if self.grid.get_slice_parallel_rank() != 0:
                skipped += [
                    p
                    for p in module.parameters()
                    if not getattr(p, "tensor_model_parallel", False)
                    and not getattr(p, "model_parallel", False)
                ]
        norm = TensorParallelNorm(group, False, tuple({id(p): p for p in skipped}.values()))
        self.strategy.tensor = norm.bind(self.strategy.state.layout)

    # --- DeepSpeed's queries -----------------------------------------------------------------
    def is_first_stage(self) -> bool:
        """True on the pipeline's first stage (it reads the inputs)."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """True on the pipeline's last stage (it reads the labels and computes the loss)."""
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's stage."""
        return self.stage_id

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Disabled in pipeline mode: use `train_batch` or `eval_batch`."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        """Disabled in pipeline mode: use `train_batch`."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Disabled in pipeline mode: use `train_batch`."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    # --- checkpoints ([Note: pipeline stage checkpoints] in `partita.checkpoint.stages`) ------
    def pipeline_place(self) -> tuple[int, int]:
        """``(stage, stages)``: every stage's data-parallel group writes its own shard files
        of one checkpoint, loadable at any other pipeline degree."""
        return self.stage_id, self.num_stages

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        """`Engine.save_checkpoint` (every stage's files, one manifest); refused with a model
        (tensor) axis, before any collective."""
        self._refuse_sliced_checkpoints("save_checkpoint")
        return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> tuple[str | None, Any]:
        """`Engine.load_checkpoint` at any pipeline degree; refused with a model (tensor)
        axis, before any collective."""
        self._refuse_sliced_checkpoints("load_checkpoint")
        return super().load_checkpoint(*args, **kwargs)

    def _refuse_sliced_checkpoints(self, what: str) -> None:
        slices = self.grid.get_slice_parallel_world_size()
        if slices > 1:
            raise NotImplementedError(
                f"{what}() of a pipeline whose stages are split over {slices} tensor slices "
                "(a PipeModelDataParallelTopology model axis) is not supported by partita yet; "
                "the module's weights save per layer with PipelineModule.save_state_dict"
            )

    def pipeline_tied_copies(self) -> list[torch.Tensor]:
        """Tied parameters an earlier stage saves (their values and state are this stage's
        too)."""
        module = self.module
        assert isinstance(module, PipelineModule)
        return list(module.replicated_tied_parameters())

    def consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """Every stage's weights in the module's dtype, merged on global rank 0 under the
        `PipelineModule`'s state-dict names (global layer indices; a tied module once), which
        are those of the same module built at one stage; None elsewhere. Collective: every
        rank must call. `save_16bit_model` writes it (the engine's, inherited)."""
        from partita.zero.save16 import consolidated_16bit_state_dict

        self._require_resident_states("consolidated_16bit_state_dict()")
        collector = self.dims.dp_ranks[0]  # this stage's first data-parallel rank
        mine = consolidated_16bit_state_dict(self, exclude_frozen_parameters, collector)
        if self.dims.rank != collector:
            return None
        group = self.grid.get_pipe_parallel_group()
        return _merge_stages(mine or {}, group, self.dims.rank, self.device)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True: every `train_batch` ends with an optimizer step."""
        return True

    # --- data ----------------------------------------------------------------------------------
    def set_dataiterator(self, iterator: Iterator[Any] | None) -> None:
        """The iterator micro-batches are read from (first and last stage only)."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_dataloader(self, loader: Iterable[Any]) -> None:
        """Reads micro-batches from `loader`, starting over when it ends."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = _repeat(loader)

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """A function applied to every micro-batch read."""
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """Forgets the activation shapes (they are exchanged again at the next transfer)."""
        self._send_meta, self._recv_meta = True, None

    def _next_batch(self) -> Any:
        if self.data_iterator is None and self.training_dataloader is not None:
            self.set_dataloader(self.training_dataloader)
        if self.data_iterator is None:
            raise ValueError(
                f"stage {self.stage_id}: train_batch() needs data_iter (or initialize("
                "training_data=...)): the first and last stages read micro-batches"
            )
        batch = next(self.data_iterator)
        return self.batch_fn(batch) if self.batch_fn else batch

    # --- train and eval --------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Trains on ``gradient_accumulation_steps`` micro-batches per pipeline and steps the
        optimizer; returns the loss averaged over micro-batches and data-parallel ranks, on
        every rank (DeepSpeed's ``train_batch``)."""
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "train_batch() requires gradients enabled. Use eval_batch() instead."
            )
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self._total_loss = None
        self._compute_loss = True
        if self.module.schedule != "1f1b":
            self._train_batch_torch()
        else:
            schedule = sched.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id)
            self._exec_schedule(schedule)
        assert self.agg_train_loss is not None
        return self.agg_train_loss

    def _train_batch_torch(self) -> None:
        """One batch on torch's schedule, then what follows partita's own: tied sums, the
        data-parallel reduction, the step ([Note: torch pipeline schedules])."""
        self._total_loss = self._torch().train_batch(self._next_batch)
        self._exec_reduce_tied_grads()
        self._exec_reduce_grads()
        self._exec_optimizer_step()

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward passes over ``num_micro_batches`` (default ``gradient_accumulation_steps``)
        micro-batches without gradients; returns the loss averaged over micro-batches and
        data-parallel ranks, broadcast to every stage with `bcast_loss` (else None off the
        last stage); with `return_logits`, ``(loss, last micro-batch's outputs)``."""
        if reduce_output not in (None, "avg"):
            raise NotImplementedError(f"reduction type {reduce_output} not supported.")
        if self.module.schedule != "1f1b":
            return self._eval_batch_torch(data_iter, return_logits, compute_loss,
                                          reduce_output, bcast_loss, num_micro_batches)  # fmt: skip
        self.module.eval()
        self._return_logits = return_logits
        self._compute_loss = compute_loss
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        micro = self.micro_batches if num_micro_batches is None else num_micro_batches
        with torch.no_grad():
            self._exec_schedule(sched.InferenceSchedule(micro, self.num_stages, self.stage_id))
        output: Any = None
        if self.is_last_stage():
            output = self._reduce_outputs(self._fwd_outputs, reduce_output, micro)
        if compute_loss and bcast_loss:
            output = self._bcast_from_last(output, 1)[0]
        self.data_iterator = saved
        self._return_logits = False
        if return_logits:
            outputs, self.outputs = self.outputs, None
            return output, outputs
        return output

    def _torch(self) -> TorchSchedule:
        """torch's schedule for this engine, built at its first batch (shapes come then)."""
        if self._torch_schedule is None:
            self._torch_schedule = TorchSchedule(self, self.module.schedule)  # type: ignore[arg-type]
        return self._torch_schedule

    def _eval_batch_torch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool,
        compute_loss: bool,
        reduce_output: str | None,
        bcast_loss: bool,
        num_micro_batches: int | None,
    ) -> Any:
        """`eval_batch` on torch's schedule: the loss averaged as `eval_batch` does, with
        `return_logits` and the last micro-batch's outputs (the last stage's; None
        elsewhere)."""
        asked = num_micro_batches or self.micro_batches
        if not compute_loss or reduce_output is None or asked != self.micro_batches:
            raise NotImplementedError(
                f"eval_batch() with pipeline.schedule {self.module.schedule!r} computes the "
                "averaged loss of gradient_accumulation_steps micro-batches only (no other "
                "micro-batch count, reduce_output 'avg')"
            )
        saved = self.data_iterator
        self.module.eval()
        self.set_dataiterator(data_iter)
        total, logits = self._torch().eval_batch(self._next_batch)
        self.data_iterator = saved
        output = self._dp_mean(total / asked) if total is not None else None
        if bcast_loss:
            output = self._bcast_from_last(output, 1)[0]
        return (output, logits) if return_logits else output

    def _reduce_outputs(self, outputs: list[Any], reduce: str | None, micro: int) -> Any:
        if reduce is None:
            return outputs
        if torch.is_tensor(outputs[0]):
            total = sum(outputs[1:], outputs[0].clone())
            total = total / micro if micro > 1 else total
            return self._dp_mean(total)
        totals = [sum(parts[1:], parts[0].clone()) for parts in zip(*outputs, strict=True)]
        return [self._dp_mean(t / micro if micro > 1 else t) for t in totals]

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp_world_size > 1:
            value = value.clone()
            comm.all_reduce(value, group=self.dims.dp_group, tag="loss")
            value /= self.dp_world_size
        return value

    def _bcast_from_last(self, value: torch.Tensor | None, count: int) -> torch.Tensor:
        """`count` float32 scalars from the last stage (`value` there) on every stage."""
        if self.is_last_stage():
            assert value is not None
            out = value.detach().reshape(-1).to(torch.float32, copy=True)
        else:
            out = torch.zeros(count, dtype=torch.float32, device=self.device)
        if self.num_stages > 1:
            src = self.grid.stage_to_global(self.num_stages - 1)
            comm.broadcast(out, src=src, group=self.grid.get_pipe_parallel_group(), tag="loss")
        return out

    def _aggregate_total_loss(self) -> torch.Tensor:
        """The batch's loss: mean over micro-batches (last stage), over data-parallel ranks,
        broadcast over the pipeline."""
        both = None
        if self.is_last_stage():
            assert self._total_loss is not None
            mine = self._total_loss.detach().float()
            if self.micro_batches > 1:
                mine = mine / self.micro_batches
            both = torch.stack([mine, self._dp_mean(mine)])
        out = self._bcast_from_last(both, 2)
        self.dp_group_loss = out[0].clone()
        return out[1].clone()

    # --- the executor ------------------------------------------------------------------------------
    def _exec_schedule(self, schedule: sched.PipeSchedule) -> None:
        count = schedule.num_pipe_buffers()
        self._pipe_buffers = {
            k: [None] * count for k in ("inputs", "labels", "outputs", "losses", "grads")
        }
        self._fwd_outputs = []
        self._send_meta, self._recv_meta = True, None  # shapes may change between batches
        for step in schedule:
            for cmd in step:
                handler = self._HANDLERS.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"{type(self).__name__} does not understand {cmd!r}")
                handler(self, **cmd.kwargs)
        self._pipe_buffers = {}

    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        batch = self._next_batch()
        if self.is_first_stage():
            self._pipe_buffers["inputs"][buffer_id] = _to_device(batch[0], self.device, detach=True)
        if self.is_last_stage():
            self._pipe_buffers["labels"][buffer_id] = _to_device(
                batch[1], self.device, detach=False
            )

    def _exec_forward_pass(self, buffer_id: int) -> None:
        inputs = self._pipe_buffers["inputs"][buffer_id]
        # A clone: a layer may work in place on its input, which a leaf that requires grad
        # does not allow; the received tensor stays the leaf whose .grad goes upstream.
        inputs = tuple(t.clone() for t in inputs) if isinstance(inputs, tuple) else inputs.clone()
        outputs = self.module(inputs)
        self._pipe_buffers["outputs"][buffer_id] = outputs
        if not self.is_last_stage():
            return
        module: PipelineModule = self.module  # type: ignore[assignment]
        if self._compute_loss and module.loss_fn is not None:
            loss = module.loss_fn(outputs, self._pipe_buffers["labels"][buffer_id])
        else:
            loss = outputs
        if self._return_logits:
            self.outputs = outputs
        self._pipe_buffers["losses"][buffer_id] = loss
        if isinstance(loss, torch.Tensor):
            self._fwd_outputs.append(loss.detach())
            detached = loss.detach()
            self._total_loss = (
                detached.clone() if self._total_loss is None else self._total_loss + detached
            )
        else:
            self._fwd_outputs.append([x.detach() for x in loss])

    def _exec_backward_pass(self, buffer_id: int) -> None:
        self.strategy.begin_backward(False)  # reduced at ReduceGrads ([Note: pipeline engine])
        if self.is_last_stage():
            loss = self._pipe_buffers["losses"][buffer_id]
            share = loss / self.micro_batches if self.micro_batches > 1 else loss
            if self.loss_scaler.scale != 1.0:
                share = share.float() * self.loss_scaler.scale
            share.backward()
        else:
            outputs = self._pipe_buffers["outputs"][buffer_id]
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            grads = self._pipe_buffers["grads"][buffer_id]
            pairs = [
                (o, g) for o, g in zip(_floats(outputs), grads, strict=True) if o.requires_grad
            ]
            if pairs:  # else nothing this stage holds needs a gradient
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.strategy.end_backward()
        # Done with this micro-batch; only a received input stays, for SendGrad to read.
        done = ["outputs", "losses", "grads", "labels"]
        if self.is_first_stage():
            done.append("inputs")
        for key in done:
            self._pipe_buffers[key][buffer_id] = None

    def _exec_send_activations(self, buffer_id: int) -> None:
        outputs = self._pipe_buffers["outputs"][buffer_id]
        tensors = outputs if isinstance(outputs, tuple) else (outputs,)
        if not all(torch.is_tensor(t) for t in tensors):
            raise PipelineError(
                f"stage {self.stage_id} must output a tensor or a tuple of tensors to pass on, "
                f"got {type(outputs).__name__}"
            )
        if self._send_meta or self._dynamic_shape:
            _send_header(tensors, isinstance(outputs, tuple), self.next_rank, self.device)
            self._send_meta = False
        for t in tensors:
            p2p.send(_wire(t.detach()), self.next_rank, tag="activation")

    def _exec_recv_activations(self, buffer_id: int) -> None:
        if self._recv_meta is None or self._dynamic_shape:
            self._recv_meta, self._recv_tuple = _recv_header(self.prev_rank, self.device)
        received = []
        for dtype, shape in self._recv_meta:
            wire = torch.uint8 if dtype == torch.bool else dtype  # see `_wire`
            buf = torch.empty(shape, dtype=wire, device=self.device)
            t = p2p.recv(buf, self.prev_rank, tag="activation")
            t = t.bool() if dtype == torch.bool else t
            t.requires_grad_(t.is_floating_point())
            received.append(t)
        self._pipe_buffers["inputs"][buffer_id] = (
            tuple(received) if self._recv_tuple else received[0]
        )

    def _exec_send_grads(self, buffer_id: int) -> None:
        inputs = self._pipe_buffers["inputs"][buffer_id]
        tensors = inputs if isinstance(inputs, tuple) else (inputs,)
        for t in _floats(tensors):
            # An input this stage did not use has no gradient: zeros keep the transfers paired.
            grad = t.grad if t.grad is not None else torch.zeros_like(t)
            p2p.send(grad, self.prev_rank, tag="grad")
        self._pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id: int) -> None:
        outputs = self._pipe_buffers["outputs"][buffer_id]
        tensors = outputs if isinstance(outputs, tuple) else (outputs,)
        self._pipe_buffers["grads"][buffer_id] = [
            p2p.recv(
                torch.empty_like(t, memory_format=torch.contiguous_format),
                self.next_rank,
                tag="grad",
            )
            for t in _floats(tensors)
        ]

    def _exec_reduce_tied_grads(self) -> None:
        if not self._held:
            self.module.allreduce_tied_weight_gradients()  # type: ignore[operator]
            return
        # ZeRO 2-3: the tied weights' gradients wait, summed so far, in held buckets/units.
        for weight, group in self.module.get_tied_weights_and_groups():  # type: ignore[operator]
            grad = self.strategy.held_grad(weight)  # type: ignore[attr-defined]
            comm.all_reduce(grad, group=group, tag="tied_grad")

    def _exec_reduce_grads(self) -> None:
        if self._held:  # ZeRO 2-3 reduced the rest in every backward
            self.strategy.flush_held()  # type: ignore[attr-defined]
            return
        # An armed, empty backward: the strategy reduces every bucket as it stands.
        self.strategy.begin_backward(True)
        self.strategy.end_backward()

    def _exec_optimizer_step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        self.agg_train_loss = self._aggregate_total_loss()
        self._loss_sum = self.agg_train_loss.detach().clone().to(self._loss_sum.device)
        self._take_model_step(lr_kwargs or {})
        self.micro_steps += self.micro_batches

    _HANDLERS: ClassVar[dict[type, Callable[..., None]]] = {
        sched.LoadMicroBatch: _exec_load_micro_batch,
        sched.ForwardPass: _exec_forward_pass,
        sched.BackwardPass: _exec_backward_pass,
        sched.SendActivation: _exec_send_activations,
        sched.RecvActivation: _exec_recv_activations,
        sched.SendGrad: _exec_send_grads,
        sched.RecvGrad: _exec_recv_grads,
        sched.ReduceTiedGrads: _exec_reduce_tied_grads,
        sched.ReduceGrads: _exec_reduce_grads,
        sched.OptimizerStep: _exec_optimizer_step,
    }


def check_pipeline_config(config: DeepSpeedConfig, module: PipelineModule) -> None:
    """Raises for what the pipeline engine cannot run (the same on every rank: configs are
    checked equal first, and every rank holds the same topology)."""
    try:
        check_schedule(
            module.schedule,
            module.num_stages,
            module.virtual_stages,
            int(config.gradient_accumulation_steps),
        )
    except ValueError as error:
        raise config_error("pipeline.schedule", str(error).partition(": ")[2]) from None


_PIPELINE_KEYS = {"activation_checkpoint_interval", "use_reentrant", "schedule"}


def take_pipeline_section(source: Any, module: PipelineModule) -> Any:
    """`source` (a config dict) without its ``"pipeline"`` section, which is applied to `module`:
    ``activation_checkpoint_interval`` > 0 replaces the module's interval (0 leaves it), and
    ``use_reentrant`` is accepted either way (partita checkpoints non-reentrantly, which
    computes the same gradients). Other keys of the section are refused by name. A source that
    is not a dict is returned as it is."""
    if not isinstance(source, Mapping) or "pipeline" not in source:
        return source
    section = source["pipeline"] or {}
    if not isinstance(section, Mapping):
        raise config_error("pipeline", f"must be an object, got {section!r}")
    unknown = sorted(set(section) - _PIPELINE_KEYS)
    if unknown:
        raise config_error(
            "pipeline",
            f"{unknown} not supported by partita's pipeline engine (it reads "
            f"{sorted(_PIPELINE_KEYS)}; give stages and partitioning to PipelineModule)",
        )
    interval = section.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise config_error(
            "pipeline.activation_checkpoint_interval", f"must be an int >= 0, got {interval!r}"
        )
    if not isinstance(section.get("use_reentrant", True), bool):
        raise config_error("pipeline.use_reentrant", "must be true or false")
    if interval > 0:
        module.set_checkpoint_interval(interval)
    if "schedule" in section:  # partita's key ([Note: torch pipeline schedules])
        module.schedule = str(section["schedule"])
    return {k: v for k, v in source.items() if k != "pipeline"}


def _merge_stages(
    mine: dict[str, torch.Tensor],
    group: comm.ProcessGroup | None,
    rank: int,
    device: torch.device,
) -> dict[str, torch.Tensor] | None:
    """Each stage's `mine` (on its first data-parallel rank, the ranks of `group`) sent to
    global rank 0, merged in stage order, a name seen before (a tied module) kept once; None
    on the other stages. Names, dtypes and shapes go first as objects, then the tensors one by
    one through `device` (NCCL sends device tensors only), so no stage holds more than its
    own."""
    meta = [(n, str(t.dtype), tuple(t.shape)) for n, t in mine.items()]
    stages = comm.all_gather_object((rank, meta), group=group)
    if rank != 0:
        for tensor in mine.values():
            p2p.send(tensor.to(device), 0, tag="save16")
        return None
    merged = dict(mine)
    for source, listed in stages:
        if source == 0:
            continue
        for name, dtype, shape in listed:
            kind = getattr(torch, dtype.removeprefix("torch."))
            value = p2p.recv(torch.empty(shape, dtype=kind, device=device), source, tag="save16")
            merged.setdefault(name, value.cpu())
    return merged


def _floats(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point()]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """`t` as sent: bool as uint8 (not every backend sends bool)."""
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def _send_header(
    tensors: tuple[torch.Tensor, ...], is_tuple: bool, dst: int, device: torch.device
) -> None:
    """Count, dtypes and shapes of what follows: its length, then the header itself (on
    `device`: NCCL sends device tensors only)."""
    header = [int(is_tuple), len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise PipelineError(f"cannot pass a {t.dtype} tensor between pipeline stages")
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    body = torch.tensor(header, dtype=torch.int64, device=device)
    p2p.send(torch.tensor([body.numel()], dtype=torch.int64, device=device), dst, tag="meta")
    p2p.send(body, dst, tag="meta")


def _recv_header(
    src: int, device: torch.device
) -> tuple[list[tuple[torch.dtype, list[int]]], bool]:
    length = p2p.recv(torch.empty(1, dtype=torch.int64, device=device), src, tag="meta")
    body = p2p.recv(
        torch.empty(int(length[0]), dtype=torch.int64, device=device), src, tag="meta"
    ).tolist()
    is_tuple, count, at = bool(body[0]), body[1], 2
    meta = []
    for _ in range(count):
        dtype, ndim = _DTYPES[body[at]], body[at + 1]
        meta.append((dtype, body[at + 2 : at + 2 + ndim]))
        at += 2 + ndim
    return meta, is_tuple


def _to_device(value: Any, device: torch.device, detach: bool) -> Any:
    """A micro-batch's inputs or labels on `device` (tensors, or a tuple/list of them)."""
    if torch.is_tensor(value):
        out = value.to(device)
        return out.detach().clone() if detach else out
    if isinstance(value, tuple | list):
        return tuple(_to_device(v, device, detach) for v in value)
    return value


def _repeat(loader: Iterable[Any]) -> Iterator[Any]:
    """`loader`'s items, starting over each time it ends (DeepSpeed's ``RepeatingLoader``)."""
    return itertools.chain.from_iterable(_forever(loader))


def _forever(loader: Iterable[Any]) -> Iterator[Iterable[Any]]:
    while True:
        yield loader


class RepeatingLoader:
    """An iterator over `loader` that starts a new pass whenever one ends (DeepSpeed's
    ``deepspeed.utils.RepeatingLoader``): ``train_batch(data_iter=iter(RepeatingLoader(dl)))``."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self._it = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


__all__ = ["PipelineEngine", "RepeatingLoader", "check_pipeline_config"]
