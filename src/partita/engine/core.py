"""The training engine: forward, backward, step, with DeepSpeed's API and bookkeeping.

The engine composes; it holds no algorithm of its own. A `Strategy` (the ZeRO stage) owns
gradients, master weights, optimizer state and their communication; the engine decides *when*
to call it (accumulation boundary, `no_sync`), scales the loss, applies the loss-scaler's
verdict, steps the scheduler and reports to monitors.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from partita import comm
from partita.checkpoint import background as checkpoint_background
from partita.config import DeepSpeedConfig
from partita.config.sections.runtime import CheckpointConfig
from partita.engine import experts as engine_experts
from partita.engine import setup as engine_setup
from partita.engine.deepspeed_methods import DeepSpeedEngineMethods
from partita.moe import load_stats
from partita.moe.layer import expert_parameters
from partita.monitor import build_monitor
from partita.platform.accelerator import (
    configure_host_allocator,
    get_accelerator,
    host_peak_rss,
    host_rss,
)
from partita.precision import LossScaler, PrecisionPolicy
from partita.zero import init as zero_init
from partita.zero import registry
from partita.zero.state_access import ParamStates
from partita.zero.strategy import Strategy

logger = logging.getLogger("partita")


class Engine(DeepSpeedEngineMethods, torch.nn.Module):
    """Wraps a module for distributed training (see `partita.initialize`)."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: DeepSpeedConfig,
        optimizer: engine_setup.ClientOptimizer = None,
        model_parameters: Any = None,
        lr_scheduler: engine_setup.ClientScheduler = None,
        dims: comm.ParallelDims | None = None,
    ) -> None:
        super().__init__()
        self._config = config
        self.config = config.model_dump()
        self.accelerator = get_accelerator()
        configure_host_allocator()
        self.dims = dims or comm.ParallelDims.world()
        """The job's parallel dimensions: ZeRO shards and reduces over ``dims.dp_group``."""
        self.global_rank = self.dims.rank
        self.world_size = self.dims.world_size
        self.dp_world_size = self.dims.dp_world_size
        self.local_rank = comm.get_local_rank()
        self.device = self.accelerator.current_device()
        self.policy: PrecisionPolicy = engine_setup.precision_policy(config).for_module(module)
        pre_sharded = zero_init.prepare_pre_sharded(module, self.device, self.policy.param_dtype)
        if pre_sharded and config.zero_optimization.stage < 3:
            zero_init.materialize_all(module)  # only stage 3 keeps parameters sharded
        self.module = module.to(device=self.device, dtype=self.policy.param_dtype)
        self._broadcast_module()
        groups = engine_setup.param_groups(self.module, model_parameters, optimizer)
        groups = engine_experts.split_expert_groups(groups, self.module, config)
        make_optimizer = engine_setup.optimizer_factory(config, optimizer, groups)
        param_lists = [list(g["params"]) for g in groups]
        self.strategy: Strategy = engine_setup.strategy(
            config, self.module, param_lists, self.policy, make_optimizer, self.dims
        )
        self.optimizer = self.strategy.optimizer
        registry.register(self.strategy.state)
        self.lr_scheduler = engine_setup.lr_scheduler(config, lr_scheduler, self.optimizer)
        self.loss_scaler: LossScaler = engine_setup.loss_scaler(config, self.policy)
        self.monitor = build_monitor(
            config.tensorboard, config.csv_monitor, config.wandb, rank=self.global_rank
        )
        self.training_dataloader: Any = None
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._inside_no_sync = False
        self._step_applied = False
        self._global_grad_norm: float | None = None
        self._loss_sum = torch.zeros((), device=self.device)
        self._moe_figures: dict[str, dict[str, float]] = {}
        self._last_step_comm: dict[tuple[str, str], int] = {}
        self._timer = _WallClock(self.accelerator, enabled=config.wall_clock_breakdown)
        self._window_start = time.perf_counter()
        _ensure_log_handler(self.global_rank)
        engine_setup.attach_tools(self, config)  # flops_profiler, comms_logger, activations

    # --- DeepSpeed-style accessors -------------------------------------------------------
    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward on one rank."""
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro steps per optimizer step."""
        return self._config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        """Max global gradient norm (0: no clipping)."""
        return float(self._config.gradient_clipping)

    def zero_optimization_stage(self) -> int:
        """The configured ZeRO stage."""
        return int(self._config.zero_optimization.stage)

    def fp16_enabled(self) -> bool:
        """True when the module runs in fp16."""
        return self.policy.param_dtype == torch.float16

    def bf16_enabled(self) -> bool:
        """True when the module runs in bf16."""
        return self.policy.param_dtype == torch.bfloat16

    def get_lr(self) -> list[float]:
        """Current learning rate of every parameter group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm (unscaled, before clipping) of the last boundary step."""
        return self._global_grad_norm

    @property
    def param_states(self) -> ParamStates:
        """Per-parameter master weights, gradients and optimizer state, whatever the stage
        (what checkpoints and DeepSpeed's ``safe_get_*`` accessors read and write)."""
        return self.strategy.state

    @property
    def mesh_device(self) -> Any:
        """The job's parallel dimensions as a torch `DeviceMesh` with named dimensions (None
        without a process group): see [Note: the job's mesh] in `partita.comm.mesh`."""
        return self.dims.mesh

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        """The ``checkpoint`` section of the config."""
        return self._config.checkpoint

    def config_dict(self) -> dict[str, Any]:
        """The resolved config as a JSON-ready dict."""
        return self._config.to_dict()

    def was_step_applied(self) -> bool:
        """False if the last boundary step was skipped because of non-finite gradients."""
        return self._step_applied

    @property
    def cur_scale(self) -> float:
        """Current loss scale (1.0 without fp16)."""
        return self.loss_scaler.scale

    @property
    def last_step_comm_bytes(self) -> dict[tuple[str, str], int]:
        """Collective payload bytes of the last optimizer step, by (op, tag)."""
        return dict(self._last_step_comm)

    # --- accumulation boundary -------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the coming `step()` will update the weights."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides the boundary decision (for callers that count micro steps themselves)."""
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block accumulate gradients without reducing them."""
        if self.zero_optimization_stage() >= 2:
            raise RuntimeError(
                f"no_sync() is not compatible with zero_optimization.stage="
                f"{self.zero_optimization_stage()}: gradients are partitioned during backward"
            )
        previous, self._inside_no_sync = self._inside_no_sync, True
        try:
            yield
        finally:
            self._inside_no_sync = previous

    # --- the training step -----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module."""
        with self._timer("forward"):
            return self.module(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of `loss`, scaled for accumulation and fp16; reduces gradients at the
        boundary. Returns the loss divided by the accumulation steps (with `scale_wrt_gas`),
        as DeepSpeed does: the share of this micro-batch in the step's loss."""
        self._require_resident_states("engine.backward()")
        if loss.numel() != 1:
            raise ValueError(
                f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}"
            )
        sync = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        gas = self.gradient_accumulation_steps()
        share = loss / gas if scale_wrt_gas and gas > 1 else loss
        self._loss_sum += loss.detach().float() / gas
        scaled = share
        if self.loss_scaler.scale != 1.0:
            scaled = scaled.float() * self.loss_scaler.scale
        with self._timer("backward"):
            self.strategy.begin_backward(sync)
            scaled.backward(retain_graph=retain_graph)
            self.strategy.end_backward()
        return share

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Updates the weights at the accumulation boundary; counts the micro step always."""
        if self._inside_no_sync:
            raise RuntimeError(
                "engine.step() was called inside engine.no_sync(); leave the block first"
            )
        self._require_resident_states("engine.step()")
        if self.is_gradient_accumulation_boundary():
            with self._timer("step"):
                self._take_model_step(lr_kwargs or {})
        self.micro_steps += 1
        self._boundary_override = None
        if checkpoint_background.pending(self):  # an asynchronous save's failure, agreed step
            checkpoint_background.at_step(self)

    def _take_model_step(self, lr_kwargs: dict[str, Any]) -> None:
        scale_before = self.loss_scaler.scale
        outcome = self.strategy.step(self.gradient_clipping(), scale_before)
        self.loss_scaler.update(not outcome.applied, self.global_steps)
        self._step_applied = outcome.applied
        self._global_grad_norm = outcome.grad_norm
        # DeepSpeed's optimizers say whether the last step overflowed; Accelerate reads it to
        # hold back the schedulers it steps itself.
        self.optimizer.overflow = not outcome.applied  # type: ignore[attr-defined]
        if outcome.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
        else:
            self.skipped_steps += 1
            if self.global_rank == 0:
                logger.warning(
                    "step %d: non-finite gradients (norm %s); step skipped on every rank, "
                    "loss scale %g -> %g (skipped so far: %d)",
                    self.global_steps,
                    outcome.grad_norm,
                    scale_before,
                    self.loss_scaler.scale,
                    self.skipped_steps,
                )
        self.strategy.zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._last_step_comm = dict(comm.COUNTERS.step_bytes)
        comm.COUNTERS.begin_step()
        self._report()

    def _report(self) -> None:
        loss = float(self._loss_sum)
        self._loss_sum.zero_()
        # A collective while the monitor is on (the same on every rank): [Note: expert load
        # statistics] in `partita.moe.load_stats`.
        self._moe_figures = engine_experts.load_figures(self.module, self.dims, self.monitor)
        if self.monitor.is_writer:
            moe = load_stats.events(self._moe_figures, self.global_samples)
            self.monitor.write_events(self._events(loss) + moe)
        spp = self._config.steps_per_print
        if spp and self.global_steps % spp == 0 and self.global_rank == 0:
            elapsed = time.perf_counter() - self._window_start
            self._window_start = time.perf_counter()
            logger.info(
                "step=%d skipped=%d loss=%.6g lr=%s samples/s=%.1f%s",
                self.global_steps,
                self.skipped_steps,
                loss,
                self.get_lr(),
                spp * self.train_batch_size() / max(elapsed, 1e-9),
                self._timer.summary(),
            )

    def _events(self, loss: float) -> list[tuple[str, float, int]]:
        from partita.monitor import events as ev

        step = self.global_samples
        out = [(ev.EVENT_TRAIN_LOSS, loss, step), (ev.EVENT_LR, self.get_lr()[0], step)]
        if self.fp16_enabled():
            out.append((ev.EVENT_LOSS_SCALE, self.loss_scaler.scale, step))
        out.append(
            (ev.EVENT_SAMPLES_PER_SEC, self._timer.samples_per_sec(self.train_batch_size()), step)
        )
        return out

    def moe_load_stats(self) -> dict[str, dict[str, float]]:
        """The last step's load figures of each MoE layer, by module name (``imbalance``,
        ``dropped``, ``l_aux``: [Note: expert load statistics] in `partita.moe.load_stats`);
        empty without MoE layers or while no monitor backend is enabled."""
        return {layer: dict(values) for layer, values in self._moe_figures.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Releases accumulated gradients, as ``set_to_none=True`` does (the engine always does:
        the argument is accepted for nn.Module compatibility; [Note: released gradients])."""
        del set_to_none
        self.strategy.zero_grad()

    # --- memory and teardown -----------------------------------------------------------------
    def memory_breakdown(self) -> bool:
        """DeepSpeed's accessor of the ``memory_breakdown`` config flag (see `memory_report`
        for the figures)."""
        return bool(self._config.memory_breakdown)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds per category (params, grads, master_params, optimizer_state,
        comm_buffers), the device's peak allocation, and the process's RSS and peak RSS.
        ``grads`` is what gradients take while they exist, from the first backward of a step
        to its optimizer step; ``grads_held`` what they hold now (0 between steps: [Note:
        released gradients]), and likewise ``comm_buffers_held`` for the reduce buffers of
        stages 2-3. With activation checkpointing, ``ckpt_inputs`` and ``ckpt_inputs_host`` are
        the peak bytes of checkpointed layer inputs kept on the device and in host memory
        (``cpu_checkpointing``) since the process started ([Note: saved-input accounting]): what
        checkpointing keeps of the activations."""
        from partita.activations import STATS as saved_inputs

        report = self.strategy.memory_breakdown()
        if (
            not self.strategy.state.shards_params
        ):  # frozen weights are the module's, not the strategy's
            report["params"] += sum(
                p.numel() * p.element_size()
                for p in self.module.parameters()
                if not p.requires_grad
            )
        report["device_peak"] = self.accelerator.max_memory_allocated()
        report["rss"] = host_rss()
        report["peak_rss"] = host_peak_rss()
        if saved_inputs.peak_device_bytes or saved_inputs.peak_host_bytes:
            report["ckpt_inputs"] = saved_inputs.peak_device_bytes
            report["ckpt_inputs_host"] = saved_inputs.peak_host_bytes
        return report

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Writes the full weights in the module's dtype as safetensors, gathering stage-3
        units one at a time; every rank must call it."""
        from partita.zero.save16 import save_16bit_model

        self._require_resident_states("save_16bit_model()")
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """The full weights in the module's dtype (CPU) and persistent buffers on rank 0, None
        elsewhere; every rank must call it. Stage 3 gathers one unit at a time."""
        from partita.zero.save16 import consolidated_16bit_state_dict

        self._require_resident_states("consolidated_16bit_state_dict()")
        return consolidated_16bit_state_dict(self, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's name for `consolidated_16bit_state_dict` at stage 3 (Hugging Face's
        Trainer and Accelerate call it); like DeepSpeed, a ValueError at other stages."""
        if self.zero_optimization_stage() != 3:
            raise ValueError(
                "_zero3_consolidated_16bit_state_dict() needs zero_optimization.stage 3, this "
                f"engine runs stage {self.zero_optimization_stage()}"
            )
        return self.consolidated_16bit_state_dict(exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: partita always gathers full weights when a model is saved (one stage-3 unit at a
        time), so a Hugging Face ``save_model()`` never writes an empty file. DeepSpeed returns
        ``stage3_gather_16bit_weights_on_model_save``, false by default, and then saves none."""
        return True

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Compiles the wrapped module in place with ``torch.compile`` (DeepSpeed's
        ``engine.compile``; Accelerate calls it when a dynamo backend is configured)."""
        options = dict(compile_kwargs or {})
        options.update(kwargs)
        if backend is not None:
            options["backend"] = backend
        self.module.compile(**options)

    # --- checkpoints (partita.checkpoint) -------------------------------------------------------
    def pipeline_place(self) -> tuple[int, int] | None:
        """None: not a pipeline stage (`partita.parallel.pipe_engine.PipelineEngine` is)."""
        return None

    def pipeline_tied_copies(self) -> list[torch.Tensor]:
        """No tied copies outside a pipeline."""
        return []

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        async_save: bool | None = None,
    ) -> bool:
        """Saves a sharded, atomic checkpoint; every rank must call it. With `async_save`
        (default: ``checkpoint.async_save``) training goes on while it is written (see
        `partita.checkpoint.save_checkpoint`)."""
        from partita.checkpoint import save_checkpoint

        self._require_resident_states("save_checkpoint()")
        return save_checkpoint(
            self,
            save_dir,
            tag=tag,
            client_state=client_state or {},
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
            async_save=async_save,
        )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        trust_pickle: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Loads a checkpoint saved at any world size and stage; returns ``(load_path,
        client_state)`` (see `partita.checkpoint.load_checkpoint`). ``trust_pickle=True`` is
        the explicit opt-in needed to read a DeepSpeed checkpoint (pickle files can run code)."""
        from partita.checkpoint import load_checkpoint

        self._require_resident_states("load_checkpoint()")
        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            trust_pickle=trust_pickle,
        )

    def destroy(self) -> None:
        """Waits for a background save (raising its failure), releases hooks and closes
        monitors (the process group stays up)."""
        self.reload_states()  # stage 3 hands the weights back to the module: they must be here
        try:
            checkpoint_background.wait_for(self)
        finally:
            registry.unregister(self.strategy.state)  # its parameters may join another engine
            self.strategy.close()
            self.monitor.close()

    def _broadcast_module(self) -> None:
        """Makes every rank of a data-parallel group start from the weights and buffers of its
        data-parallel rank 0, as DeepSpeed does (replicas keep their own: under model
        parallelism they hold different slices)."""
        dims = self.dims
        # Under sequence parallelism every rank of the sequence-data-parallel group holds the
        # same parameters ([Note: sequence parallelism] in `partita.comm.dims`).
        # Experts start from their first expert-data-parallel rank's copy ([Note: expert
        # parallelism] in `partita.comm.dims`): expert-parallel ranks hold different experts.
        experts = set(expert_parameters(self.module)) if dims.ep_ranks else set()
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                ranks, group = engine_experts.broadcast_group(t, experts, dims)
                if len(ranks) > 1 and t not in zero_init.PRE_SHARDED:  # zero.Init did those
                    comm.broadcast(t.data, src=ranks[0], group=group, tag="init")


class _WallClock:
    """Optional forward/backward/step timers (``wall_clock_breakdown``) and throughput."""

    def __init__(self, accelerator: Any, enabled: bool) -> None:
        self.accelerator = accelerator
        self.enabled = enabled
        self.totals: dict[str, float] = {}
        self._last_step_end = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self.accelerator.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.accelerator.synchronize()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def samples_per_sec(self, batch: int) -> float:
        now = time.perf_counter()
        elapsed, self._last_step_end = now - self._last_step_end, now
        return batch / max(elapsed, 1e-9)

    def summary(self) -> str:
        if not self.enabled:
            return ""
        text = " ".join(f"{k}_ms={v * 1e3:.1f}" for k, v in self.totals.items())
        self.totals.clear()
        return " " + text


def _ensure_log_handler(rank: int) -> None:
    """Shows partita's INFO messages on rank 0 (warnings on every rank) unless the
    application configured logging itself."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[partita rank{rank}] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
