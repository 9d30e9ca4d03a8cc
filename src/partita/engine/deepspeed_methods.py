"""The rest of ``DeepSpeedEngine``'s public methods that scripts call: the compatibility surface
`Engine` inherits.

Partita's own code reads its config sections directly; DeepSpeed users' scripts, tutorials and
RLHF frameworks call the engine's accessors instead (``engine.bfloat16_enabled()``,
``engine.zero_optimization_stage()``, ``engine.offload_states()``), so they live here, with
DeepSpeed's names, arguments and return types. A method partita has no meaning for is refused
by name (`REFUSED`): reading it raises `NotOfferedError`, an ``AttributeError``, so that
``hasattr(engine, name)`` is False for code that probes before calling, and a direct call says
what partita offers instead.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING, Any

import torch

from partita.data import DistributedDataLoader
from partita.engine import offload_states as engine_offload
from partita.engine.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum
from partita.engine.setup import NoOptimizer
from partita.zero.gather import GatheredParameters

if TYPE_CHECKING:
    from partita.config import DeepSpeedConfig
    from partita.precision import LossScaler, PrecisionPolicy
    from partita.zero.state_access import ParamStates

__all__ = [
    "REFUSED",
    "DeepSpeedEngineMethods",
    "NotOfferedError",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]

_OPTIMIZERS_LOWERCASED = frozenset(
    {"adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon"}
)
"""The config optimizer types DeepSpeed's ``optimizer_name()`` reports in lower case."""

_INTERNAL = "a DeepSpeed internal; partita's engine reduces gradients inside engine.backward()"
_NO_DATA_EFFICIENCY = "partita has no data-efficiency library (curriculum, random-LTD)"
_NO_AUTOTUNING = "partita has no autotuner; use `partita plan` to choose a configuration"
_NO_DEEPCOMPILE = "partita has no DeepCompile; engine.compile() runs torch.compile on the module"

REFUSED: Mapping[str, str] = {
    "allreduce_gradients": _INTERNAL,
    "allreduce_bucket": _INTERNAL,
    "allreduce_and_copy": _INTERNAL,
    "allreduce_no_retain": _INTERNAL,
    "buffered_allreduce_fallback": _INTERNAL,
    "sparse_allreduce": _INTERNAL,
    "sparse_allreduce_bucket": _INTERNAL,
    "sparse_allreduce_no_retain": _INTERNAL,
    "sparse_all_gather": _INTERNAL,
    "all_gather_scalar": _INTERNAL,
    "coalesce_grad_reduction": _INTERNAL,
    "clip_fp32_gradients": "engine.step() clips to gradient_clipping itself",
    "scale": "partita scales and reduces inside engine.backward(loss); call it instead of "
    "loss.backward()",
    "get_optimizer_configuration": "a DeepSpeed internal; partita builds the config's optimizer",
    "print_forward_breakdown": "set wall_clock_breakdown; engine steps log the breakdown",
    "get_wall_clock_timers": "set wall_clock_breakdown; engine steps log the breakdown",
    "load_moe_state_dict": "DeepSpeed's per-expert checkpoint files; partita's checkpoints "
    "hold experts by global index and load_checkpoint re-splits them",
    "set_data_post_process_func": _NO_DATA_EFFICIENCY,
    "set_custom_curriculum_learning_schedule": _NO_DATA_EFFICIENCY,
    "data_efficiency_config": _NO_DATA_EFFICIENCY,
    "data_sampling_config": _NO_DATA_EFFICIENCY,
    "curriculum_learning_config": _NO_DATA_EFFICIENCY,
    "random_ltd_config": _NO_DATA_EFFICIENCY,
    "random_ltd_initialize": _NO_DATA_EFFICIENCY,
    "autotuning_start_profile_step": _NO_AUTOTUNING,
    "autotuning_end_profile_step": _NO_AUTOTUNING,
    "autotuning_metric_path": _NO_AUTOTUNING,
    "autotuning_model_info_path": _NO_AUTOTUNING,
    "autotuning_metric": _NO_AUTOTUNING,
    "get_compile_time": _NO_DEEPCOMPILE,
    "register_compile_pass": _NO_DEEPCOMPILE,
    "get_autosp_backend": _NO_DEEPCOMPILE,
    "get_autotp_backend": _NO_DEEPCOMPILE,
    "get_deepcompile_backend": _NO_DEEPCOMPILE,
    "get_deepspeed_compile_backend": _NO_DEEPCOMPILE,
    "zenflow_config": "partita has no ZenFlow",
    "swap_tensor_config": "NVMe swapping is configured by zero_optimization.offload_* and aio",
    "checkpoint_serialization_enabled": "partita writes its own sharded format (safetensors "
    "and a manifest), not torch.save files",
    "optimizer_legacy_fusion": "partita has no legacy fused optimizers",
    "zero_parameter_alignment": "partita aligns flat buffers itself; the key is not in its schema",
    "torch_autocast_dtype": "partita has no torch_autocast section; use bf16 or fp16",
    "torch_autocast_lower_precision_safe_modules": "partita has no torch_autocast section",
    "log_level": "set the 'partita' logger's level with the logging module",
    "managed_gradient_accumulation": "engine.backward() and engine.step() count micro steps; "
    "set_gradient_accumulation_boundary() overrides the boundary",
}
"""DeepSpeedEngine methods partita does not offer, with what it offers instead."""


def _zero_key(key: str) -> Callable[[Any], Any]:
    """An accessor of ``zero_optimization.<key>`` (DeepSpeed's ``zero_*`` methods)."""

    def accessor(self: Any) -> Any:
        return getattr(self._config.zero_optimization, key)

    accessor.__doc__ = f"``zero_optimization.{key}``."
    return accessor


class NotOfferedError(AttributeError):
    """A DeepSpeedEngine method partita does not offer (an AttributeError, so that
    ``hasattr`` probes see it missing)."""


class DeepSpeedEngineMethods:
    """DeepSpeedEngine's accessors and helpers, on top of `partita.engine.Engine`'s state."""

    if TYPE_CHECKING:
        _config: DeepSpeedConfig
        config: dict[str, Any]
        module: torch.nn.Module
        optimizer: torch.optim.Optimizer
        policy: PrecisionPolicy
        loss_scaler: LossScaler
        dims: Any
        dp_world_size: int
        device: torch.device
        accelerator: Any

        @property
        def param_states(self) -> ParamStates: ...
        def zero_optimization_stage(self) -> int: ...
        def fp16_enabled(self) -> bool: ...
        def bf16_enabled(self) -> bool: ...
        def gradient_accumulation_steps(self) -> int: ...
        def train_batch_size(self) -> int: ...
        def train_micro_batch_size_per_gpu(self) -> int: ...
        def save_16bit_model(self, save_dir: str, save_filename: str = ...) -> bool: ...

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's lookup
        except AttributeError:
            if name in REFUSED:
                raise NotOfferedError(
                    f"DeepSpeedEngine.{name}() is not offered by partita: {REFUSED[name]}"
                ) from None
            # DeepSpeed's engine passes through what the wrapped model defines and the engine
            # does not (its own MoE tests read ``engine.moe_1``).
            module = self._modules.get("module") if name != "module" else None
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise

    # --- batch arithmetic and ranks ----------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps).
        DeepSpeed's docstring promises these numbers (its code returns the bound methods)."""
        cfg = self._config
        return (
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
        )

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Changes the global batch by changing the accumulation steps (the micro-batch stays);
        a ValueError unless it divides by micro batch x data-parallel size."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size <= 0 or train_batch_size % per_step:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): must be a positive multiple of "
                f"train_micro_batch_size_per_gpu x data-parallel size = {per_step}"
            )
        self._update_batch(train_batch_size, gas=train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Changes the micro-batch, keeping the accumulation steps (the global batch follows)."""
        if micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): must be positive")
        gas = self.gradient_accumulation_steps()
        self._update_batch(micro_batch_size * gas * self.dp_world_size, micro=micro_batch_size)

    def _update_batch(self, train: int, gas: int | None = None, micro: int | None = None) -> None:
        update: dict[str, int] = {"train_batch_size": train}
        if gas is not None:
            update["gradient_accumulation_steps"] = gas
        if micro is not None:
            update["train_micro_batch_size_per_gpu"] = micro
        self._config = self._config.model_copy(update=update)  # sections are frozen
        self.config.update(update)

    def get_data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return int(self.dims.dp_rank)

    def get_tensor_parallel_rank(self) -> int:
        """This rank's index in its tensor-parallel group (0 without one)."""
        return int(self.dims.tp_rank)

    def get_model_parallel_rank(self) -> int:
        """This rank's model-parallel index: its tensor-parallel rank (no pipeline stages)."""
        return int(self.dims.tp_rank)

    def get_tensor_parallel_world_size(self) -> int:
        """Ranks each tensor-parallel layer is split across (1 without tensor parallelism)."""
        return int(self.dims.tp_world_size)

    def get_tensor_parallel_group(self) -> Any:
        """The tensor-parallel group (None: the default group, or no tensor parallelism:
        `get_tensor_parallel_world_size` says which)."""
        return self.dims.tp_group

    def autotp_size(self) -> int:
        """DeepSpeed's ``autotp_size()``: ``tensor_parallel.autotp_size`` (0: off), with
        `tp_model_init`'s size merged in as DeepSpeed does; a model split by the user under an
        mpu reports 0 here and its size in `get_tensor_parallel_world_size`."""
        return int(self._config.tensor_parallel.autotp_size)

    def tensor_parallel_config(self) -> Any:
        """The config's ``tensor_parallel`` section."""
        return self._config.tensor_parallel

    def get_sequence_parallel_group(self) -> Any:
        """The sequence-parallel group (``sequence_parallel_size`` > 1); an AttributeError
        without sequence parallelism, as DeepSpeed's engine has no such group then."""
        if self.dims.sp_world_size == 1:
            raise AttributeError(
                "get_sequence_parallel_group(): no sequence parallelism (sequence_parallel_size "
                "is 1)"
            )
        return self.dims.sp_group

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> DistributedDataLoader:
        """A loader of this data-parallel rank's share of `dataset` in micro-batches (what
        ``initialize(training_data=...)`` builds); shuffled each epoch for the ``train`` route."""
        from partita.platform import env

        if data_sampler is not None:
            raise ValueError(
                "deepspeed_io(data_sampler=...): partita's loader splits by data-parallel rank "
                "itself; pass a torch DataLoader of your own to use a custom sampler"
            )
        return DistributedDataLoader(
            dataset,
            batch_size=batch_size or self._config.train_micro_batch_size_per_gpu,
            rank=self.dims.dp_rank,
            world_size=self.dp_world_size,
            collate_fn=collate_fn,
            shuffle=route == "train",
            seed=env.data_seed(),
            drop_last=bool(self._config.dataloader_drop_last),
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and bool(self.accelerator.is_cuda),
        )

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        """True for a dataset indexed by position (``__getitem__`` and ``__len__``)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        """True for a ``torch.utils.data.IterableDataset``."""
        return isinstance(obj, torch.utils.data.IterableDataset)

    # --- precision ----------------------------------------------------------------------------
    def bfloat16_enabled(self) -> bool:
        """The ``bf16.enabled`` flag (DeepSpeed's name; `bf16_enabled` is the same)."""
        return bool(self._config.bf16.enabled)

    def fp16_auto_cast(self) -> bool:
        """``fp16.auto_cast``."""
        return bool(self._config.fp16.auto_cast)

    def loss_scale(self) -> float:
        """``fp16.loss_scale``: the static scale, 0 for dynamic scaling (`cur_scale` is the
        scale in force)."""
        return float(self._config.fp16.loss_scale)

    def dynamic_loss_scale(self) -> bool:
        """True when ``fp16.loss_scale`` is 0 (dynamic scaling)."""
        return self._config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        """``2 ** fp16.initial_scale_power``."""
        return int(2**self._config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic scaler's settings under DeepSpeed's keys."""
        fp16 = self._config.fp16
        return {
            "init_scale": 2**fp16.initial_scale_power,
            "scale_window": fp16.loss_scale_window,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": fp16.min_loss_scale,
        }

    def fp16_master_weights_and_gradients(self) -> bool:
        """``fp16.fp16_master_weights_and_grads`` (always false: partita refuses true)."""
        return bool(self._config.fp16.fp16_master_weights_and_grads)

    def bf16_master_weights_and_gradients(self) -> bool:
        """``bf16.bf16_master_weights_and_grads`` (always false: partita refuses true)."""
        return bool(self._config.bf16.bf16_master_weights_and_grads)

    def bf16_optimizer_states(self) -> bool:
        """``bf16.bf16_optimizer_states`` (always false: partita refuses true)."""
        return bool(self._config.bf16.bf16_optimizer_states)

    def torch_autocast_enabled(self) -> bool:
        """False: partita has no ``torch_autocast`` section."""
        return False

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in (``communication_data_type``, else the training
        precision's choice)."""
        return self.policy.reduce_dtype

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(module dtype, gradient-accumulation dtype): the same dtype, as partita accumulates
        in the training dtype (``data_types.grad_accum_dtype`` is refused)."""
        dtype = self.policy.param_dtype
        return dtype, dtype

    def postscale_gradients(self) -> bool:
        """True unless ``prescale_gradients``."""
        return not self._config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        """``gradient_predivide_factor``."""
        return float(self._config.gradient_predivide_factor)

    @property
    def gradient_average(self) -> bool:
        """False when ``gradient_allreduce_op`` is ``"sum"`` (DeepSpeed's engine attribute)."""
        return self._config.gradient_allreduce_op == "mean"

    # --- optimizer and scheduler --------------------------------------------------------------
    def optimizer_name(self) -> str | None:
        """The config optimizer's ``type`` (DeepSpeed's own optimizers in lower case), else the
        class name of the client's optimizer; None without one."""
        opt = self._config.optimizer
        if opt is not None:
            return opt.type.lower() if opt.type.lower() in _OPTIMIZERS_LOWERCASED else opt.type
        if isinstance(self.optimizer, NoOptimizer):
            return None
        return type(self.optimizer).__name__

    def optimizer_params(self) -> dict[str, Any] | None:
        """The config optimizer's ``params`` (None without an ``optimizer`` block)."""
        opt = self._config.optimizer
        return None if opt is None else dict(opt.params)

    def scheduler_name(self) -> str | None:
        """The config scheduler's ``type`` (None without a ``scheduler`` block)."""
        sched = self._config.scheduler
        return None if sched is None else sched.type

    def scheduler_params(self) -> dict[str, Any] | None:
        """The config scheduler's ``params`` (None without a ``scheduler`` block)."""
        sched = self._config.scheduler
        return None if sched is None else dict(sched.params)

    def _group_values(self, key: str) -> list[Any]:
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each group's momentum (SGD, RMSprop) or betas (others)."""
        key = "momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas"
        return self._group_values(key)

    def get_type(self) -> list[Any]:
        """Each group's ``type`` entry (0.0 where absent, as DeepSpeed)."""
        return self._group_values("type")

    # --- ZeRO settings --------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        """True at ZeRO stages 1-3."""
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """True at stages 2-3."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """True at stage 3."""
        return self.zero_optimization_stage() >= 3

    def is_first_weights_partition_group(self) -> bool:
        """DeepSpeed's alias of `zero_optimization_partition_weights`."""
        return self.zero_optimization_partition_weights()

    def zero_allow_untested_optimizer(self) -> bool:
        """``zero_allow_untested_optimizer``."""
        return bool(self._config.zero_allow_untested_optimizer)

    def zero_force_ds_cpu_optimizer(self) -> bool:
        """``zero_force_ds_cpu_optimizer``."""
        return bool(self._config.zero_force_ds_cpu_optimizer)

    def zero_offload_optimizer(self) -> Any:
        """The ``zero_optimization.offload_optimizer`` section (None when absent)."""
        return self._config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        """The ``zero_optimization.offload_param`` section (None when absent)."""
        return self._config.zero_optimization.offload_param

    def zero_use_cpu_optimizer(self) -> bool:
        """True when the optimizer steps on the host (optimizer offload to cpu or nvme)."""
        opt = self._config.zero_optimization.offload_optimizer
        return opt is not None and opt.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        """True for optimizer offload to cpu."""
        opt = self._config.zero_optimization.offload_optimizer
        return opt is not None and opt.device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        """True when optimizer state is swapped to NVMe (stage 3 with nvme optimizer offload)."""
        opt = self._config.zero_optimization.offload_optimizer
        return opt is not None and opt.device == "nvme" and self.zero_optimization_stage() == 3

    def zero_partial_offload(self) -> float:
        """``offload_optimizer.ratio`` (1.0 without optimizer offload)."""
        return float(getattr(self.zero_offload_optimizer(), "ratio", 1.0))

    def super_offload(self) -> bool:
        """``offload_optimizer.super_offload`` (False without optimizer offload)."""
        return bool(getattr(self.zero_offload_optimizer(), "super_offload", False))

    def cpuadam_cores_perc(self) -> float:
        """``offload_optimizer.cpuadam_cores_perc`` (0.9 without optimizer offload)."""
        return float(getattr(self.zero_offload_optimizer(), "cpuadam_cores_perc", 0.9))

    def zero_compute_grad_norm(self) -> bool:
        """True: every partita stage computes the global gradient norm."""
        return True

    zero_reduce_scatter = _zero_key("reduce_scatter")
    zero_overlap_comm = _zero_key("overlap_comm")
    zero_sub_group_size = _zero_key("sub_group_size")
    zero_reduce_bucket_size = _zero_key("reduce_bucket_size")
    zero_multi_rank_bucket_allreduce = _zero_key("use_multi_rank_bucket_allreduce")
    zero_allgather_bucket_size = _zero_key("allgather_bucket_size")
    zero_allgather_partitions = _zero_key("allgather_partitions")
    zero_contiguous_gradients = _zero_key("contiguous_gradients")
    zero_load_from_fp32_weights = _zero_key("load_from_fp32_weights")
    zero_elastic_checkpoint = _zero_key("elastic_checkpoint")
    zero_max_live_parameters = _zero_key("stage3_max_live_parameters")
    zero_max_reuse_distance = _zero_key("stage3_max_reuse_distance")
    zero_prefetch_bucket_size = _zero_key("stage3_prefetch_bucket_size")
    zero_module_granularity_threshold = _zero_key("stage3_module_granularity_threshold")
    zero_param_persistence_threshold = _zero_key("stage3_param_persistence_threshold")
    zero_model_persistence_threshold = _zero_key("stage3_model_persistence_threshold")
    zero_allgather_sequential = _zero_key("stage3_allgather_sequential")
    zero_legacy_stage1 = _zero_key("legacy_stage1")
    zero_ignore_unused_parameters = _zero_key("ignore_unused_parameters")
    zero_round_robin_gradients = _zero_key("round_robin_gradients")
    zero_hpz_partition_size = _zero_key("zero_hpz_partition_size")
    zero_quantized_weights = _zero_key("zero_quantized_weights")
    zero_quantized_nontrainable_weights = _zero_key("zero_quantized_nontrainable_weights")
    zero_quantized_gradients = _zero_key("zero_quantized_gradients")
    zero_log_trace_cache_warnings = _zero_key("log_trace_cache_warnings")
    zero_save_muon_momentum_buffer_in_memory = _zero_key("save_muon_momentum_buffer_in_memory")
    is_sanity_checks_enabled = _zero_key("enable_sanity_checks")

    def aio_config(self) -> dict[str, Any]:
        """The ``aio`` section as a dict (DeepSpeed returns a dict)."""
        return self._config.aio.model_dump()

    # --- checkpoints, logging, data -------------------------------------------------------------
    def checkpoint_tag_validation_enabled(self) -> bool:
        """True unless ``checkpoint.tag_validation`` is IGNORE."""
        return self._config.checkpoint.tag_validation != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        """True when ``checkpoint.tag_validation`` is FAIL."""
        return self._config.checkpoint.tag_validation == "FAIL"

    def checkpoint_writer_enabled(self) -> bool:
        """False: partita has no pluggable checkpoint writer."""
        return False

    def use_node_local_storage(self) -> bool:
        """``checkpoint.use_node_local_storage``."""
        return bool(self._config.checkpoint.use_node_local_storage)

    def load_universal_checkpoint(self) -> bool:
        """``checkpoint.load_universal``."""
        return bool(self._config.checkpoint.load_universal)

    def wall_clock_breakdown(self) -> bool:
        """``wall_clock_breakdown``."""
        return bool(self._config.wall_clock_breakdown)

    def steps_per_print(self) -> int | None:
        """``steps_per_print`` (None: never)."""
        return self._config.steps_per_print

    def dump_state(self) -> bool:
        """``dump_state``."""
        return bool(self._config.dump_state)

    def dataloader_drop_last(self) -> bool:
        """``dataloader_drop_last``."""
        return bool(self._config.dataloader_drop_last)

    def _flops(self) -> Any:
        section = getattr(self._config, "flops_profiler", None)
        if section is None:
            raise NotOfferedError("the flops_profiler section is not in this partita's config")
        return section

    def flops_profiler_enabled(self) -> bool:
        """``flops_profiler.enabled`` (False where the section does not exist)."""
        section = getattr(self._config, "flops_profiler", None)
        return bool(section is not None and section.enabled)

    def flops_profiler_recompute_fwd_factor(self) -> float:
        """``flops_profiler.recompute_fwd_factor``."""
        return float(self._flops().recompute_fwd_factor)

    def flops_profiler_profile_step(self) -> int:
        """``flops_profiler.profile_step``."""
        return int(self._flops().profile_step)

    def flops_profiler_module_depth(self) -> int:
        """``flops_profiler.module_depth``."""
        return int(self._flops().module_depth)

    def flops_profiler_top_modules(self) -> int:
        """``flops_profiler.top_modules``."""
        return int(self._flops().top_modules)

    def flops_profiler_detailed(self) -> bool:
        """``flops_profiler.detailed``."""
        return bool(self._flops().detailed)

    def flops_profiler_output_file(self) -> str | None:
        """``flops_profiler.output_file``."""
        return self._flops().output_file

    # Features partita does not have: "is it on?" has a true answer, False.
    def data_efficiency_enabled(self) -> bool:
        """False: partita has no data-efficiency library."""
        return False

    def data_sampling_enabled(self) -> bool:
        """False: partita has no data-efficiency library."""
        return False

    def curriculum_learning_enabled(self) -> bool:
        """False: partita has no curriculum learning."""
        return False

    def random_ltd_enabled(self) -> bool:
        """False: partita has no random layer-token drop."""
        return False

    def autotuning_enabled(self) -> bool:
        """False: partita has no autotuner."""
        return False

    def autotuning_profile_model_info(self) -> bool:
        """False: partita has no autotuner."""
        return False

    def compile_zero_optimization_stage(self) -> bool:
        """False: partita has no DeepCompile ZeRO passes."""
        return False

    def compile_autosp(self) -> bool:
        """False: partita has no DeepCompile passes."""
        return False

    def compile_autotp(self) -> bool:
        """False: partita has no DeepCompile passes."""
        return False

    def uses_parallelization_pass_only(self) -> bool:
        """False: partita has no DeepCompile passes."""
        return False

    def is_deepcompile_enabled(self) -> bool:
        """False: partita has no DeepCompile."""
        return False

    def is_deepcompile_active(self) -> bool:
        """False: partita has no DeepCompile."""
        return False

    @property
    def is_compiled(self) -> bool:
        """True once `compile()` has compiled the module."""
        return getattr(self.module, "_compiled_call_impl", None) is not None

    def collect_python_gc(self) -> int:
        """Runs Python's cyclic garbage collector now; returns what it found unreachable."""
        return gc.collect()

    # --- module weights -----------------------------------------------------------------------
    def module_state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The module's state dict. At stage 3 every rank gets the full values, gathered one
        unit at a time (DeepSpeed returns each rank's empty partitions), so every rank must
        call it; `keep_vars` then gives detached copies, as the parameters hold none."""
        engine_offload.require_resident(self, "module_state_dict()")  # type: ignore[arg-type]
        sd: dict[str, Any] = self.module.state_dict(prefix=prefix, keep_vars=True)
        if destination is not None:  # torch's contract: fill the caller's dict and return it
            destination.update(sd)
            sd = destination
        frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
        if exclude_frozen_parameters:
            for name in frozen & set(sd):
                del sd[name]
        sharded = self.zero_optimization_partition_weights()
        units = engine_offload.stage3_units(self) if sharded else []  # type: ignore[arg-type]
        for unit in units:
            names = [k for k, v in sd.items() if any(v is p for p in unit.params)]
            with GatheredParameters([sd[k] for k in names]):
                for k in names:
                    sd[k] = sd[k].detach().clone()
        if not keep_vars and not sharded:
            for k, v in sd.items():
                sd[k] = v.detach()
        return sd

    def load_module_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        strict: bool = True,
        custom_load_fn: Any = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: Any = None,
        allowed_missing_keys: Container[str] | None = None,
    ) -> None:
        """Loads ``checkpoint['module']`` (full tensors) into the module and into the engine's
        masters and shards, at any stage; every rank must call it with the same values. With
        `custom_load_fn(src=..., dst=module)` the function writes the module itself (at stage 3
        inside a gather of every parameter, rank 0's result kept)."""
        del fetch_z3_params, z3_params_to_fetch  # partita always gathers what it writes
        engine_offload.require_resident(self, "load_module_state_dict()")  # type: ignore[arg-type]
        source = checkpoint["module"]
        if custom_load_fn is not None:
            params = list(self.module.parameters())
            with GatheredParameters(params, modifier_rank=0):
                custom_load_fn(src=source, dst=self.module)
            if not self.zero_optimization_partition_weights():
                self._masters_from_module()
            return
        _load_full_values(self, source, strict, allowed_missing_keys or ())

    def _masters_from_module(self) -> None:
        """Makes the masters (and shards) hold the module's current weights (stages 0-2)."""
        states = self.param_states
        with torch.no_grad():
            for p in self.module.parameters():
                if states.owns(p):
                    states.set_full_state(p, "param", p.detach())

    def save_fp16_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """DeepSpeed's old name for `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    # --- memory between phases ------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """Releases the gathered full weights of stage-3 units nothing uses now (persistent
        units stay gathered), then collects garbage and returns cached device memory."""
        from partita.zero.stage3.unit import UnitState

        if self.zero_optimization_partition_weights():
            for unit in engine_offload.stage3_units(self):  # type: ignore[arg-type]
                if unit.state is UnitState.UNSHARDED and unit.in_use == 0:
                    unit.reshard()
        self._return_cached_memory()

    def _return_cached_memory(self) -> None:
        gc.collect()
        empty_cache = getattr(self.accelerator, "empty_cache", None)
        if empty_cache is not None:  # CUDA's caching allocator keeps freed blocks otherwise
            empty_cache()

    def offload_states(
        self,
        include: Container[OffloadStateTypeEnum | str] | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Moves the engine's state off the accelerator into host memory (page-locked with
        `pin_memory`), e.g. while an RLHF actor generates: optimizer states, fp32 masters,
        gradients held now and the module's parameters (stage 3: this rank's shards), or the
        kinds in `include`. State that ``offload_optimizer`` already keeps on the host stays.
        Until `reload_states`, forward, backward, step and state reads raise; leave
        ``lp_params`` out of `include` to keep generating with the module. See
        [Note: offloaded storages] in `partita.engine.offload_states`."""
        if not engine_offload.check_offload_request(self, device):  # type: ignore[arg-type]
            return
        self.empty_partition_cache()
        engine_offload.offload(self, include, pin_memory, non_blocking)  # type: ignore[arg-type]
        self._return_cached_memory()

    def reload_states(self, non_blocking: bool = False) -> None:
        """Brings back what `offload_states` moved; training continues bitwise as if it had
        never left."""
        engine_offload.reload(self, non_blocking)  # type: ignore[arg-type]

    def _require_resident_states(self, what: str) -> None:
        """Raises when `what` would read state `offload_states` moved (engine entry points)."""
        engine_offload.require_resident(self, what)  # type: ignore[arg-type]


def _load_full_values(
    engine: DeepSpeedEngineMethods,
    source: Mapping[str, torch.Tensor],
    strict: bool,
    allowed_missing: Container[str],
) -> None:
    """Writes full tensors by state-dict key: managed parameters through the state-access
    interface (master, shard and module weight together), everything else in place."""
    expected: dict[str, torch.Tensor] = engine.module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in source and k not in allowed_missing]
    unexpected = [k for k in source if k not in expected]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_module_state_dict: missing keys {missing[:10]}, unexpected keys "
            f"{unexpected[:10]} (pass strict=False to load the keys that match)"
        )
    states = engine.param_states
    with torch.no_grad():
        for name, target in expected.items():
            if name not in source:
                continue
            value = source[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_module_state_dict: {name!r} has shape {tuple(value.shape)} in the "
                    f"checkpoint, {tuple(target.shape)} in the model"
                )
            if isinstance(target, torch.nn.Parameter) and states.holds(target):
                # Rounded to the module's dtype first: the masters start from what the module
                # can hold, as they do in an engine built from a module with these weights.
                value = value.to(device=engine.device, dtype=target.dtype)
                states.set_full_state(target, "param", value)
            else:
                target.copy_(value)
    states.refresh_params()
