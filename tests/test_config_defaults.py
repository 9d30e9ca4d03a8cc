"""Defaults equal DeepSpeed's (v0.19.x: deepspeed/runtime/constants.py, zero/config.py,
zero/offload_config.py, precision_config.py, monitor/config.py, swap_tensor/constants.py)."""

from __future__ import annotations

import sys

import pytest

from partita.config import (
    DeepSpeedConfig,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    load_config,
)


@pytest.fixture(scope="module")
def cfg() -> DeepSpeedConfig:
    return load_config({"train_micro_batch_size_per_gpu": 1}, world_size=1)


def test_root_defaults(cfg: DeepSpeedConfig) -> None:
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.train_batch_size == 1
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.gradient_clipping == 1.0  # DeepSpeed >= 0.19.3 (was 0.0 before)
    assert cfg.steps_per_print is None
    assert cfg.wall_clock_breakdown is False and cfg.memory_breakdown is False
    assert cfg.communication_data_type is None
    assert cfg.prescale_gradients is False
    assert cfg.gradient_predivide_factor == 1.0
    assert cfg.zero_allow_untested_optimizer is False
    assert cfg.zero_force_ds_cpu_optimizer is True
    assert cfg.dump_state is False


def test_zero_defaults(cfg: DeepSpeedConfig) -> None:
    zero = cfg.zero_optimization
    assert zero.stage == 0
    assert zero.contiguous_gradients is True
    assert zero.reduce_scatter is True
    # Departures from DeepSpeed's documented defaults, each the default partita runs with:
    # 4M-element buckets (DeepSpeed: 5e8, see REDUCE_BUCKET_NUMEL) and no gather around
    # nn.Module.apply (DeepSpeed: true; partita refuses true).
    assert zero.reduce_bucket_size == 1 << 22
    assert zero.override_module_apply is False
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.allgather_partitions is True
    assert zero.overlap_comm is False
    assert zero.load_from_fp32_weights is True
    assert zero.offload_param is None and zero.offload_optimizer is None
    assert zero.sub_group_size == 1_000_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert zero.ignore_unused_parameters is True
    assert zero.round_robin_gradients is False
    assert zero.use_multi_rank_bucket_allreduce is True
    assert zero.zero_hpz_partition_size == 1
    assert zero.mics_shard_size == -1
    assert zero.memory_efficient_linear is True


@pytest.mark.parametrize(("stage", "overlap"), [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_follows_stage(stage: int, overlap: bool) -> None:
    assert ZeroConfig(stage=stage).overlap_comm is overlap
    assert ZeroConfig(stage=stage, overlap_comm=not overlap).overlap_comm is (not overlap)


def test_offload_defaults() -> None:
    param = OffloadParamConfig()
    assert (param.device, param.nvme_path, param.pin_memory) == ("none", None, True)
    # max_in_cpu: DeepSpeed documents 1e9 but ignores the key, so every shard goes to NVMe.
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (5, 100_000_000, 0)
    opt = OffloadOptimizerConfig()
    assert (opt.device, opt.buffer_count, opt.pin_memory, opt.ratio) == ("none", 4, True, 1.0)
    assert opt.fast_init is False and opt.pipeline_read is False and opt.pipeline_write is False


def test_precision_defaults(cfg: DeepSpeedConfig) -> None:
    assert cfg.fp16 == FP16Config()
    fp16 = cfg.fp16
    assert fp16.enabled is False and fp16.auto_cast is False
    assert fp16.loss_scale == 0.0
    assert fp16.initial_scale_power == 16
    assert fp16.loss_scale_window == 1000
    assert fp16.hysteresis == 2
    assert fp16.consecutive_hysteresis is False
    assert fp16.min_loss_scale == 1
    assert fp16.fp16_master_weights_and_grads is False
    bf16 = cfg.bf16
    assert bf16.enabled is False
    assert bf16.immediate_grad_update is False
    assert bf16.check_grad_overflow is True


def test_other_section_defaults(cfg: DeepSpeedConfig) -> None:
    aio = cfg.aio
    assert (aio.block_size, aio.queue_depth, aio.intra_op_parallelism) == (1_048_576, 8, 1)
    assert (aio.single_submit, aio.overlap_events, aio.use_gds) == (False, True, False)
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path) == (False, "")
    assert cfg.tensorboard.job_name == cfg.csv_monitor.job_name == "DeepSpeedJobName"
    assert (cfg.wandb.project, cfg.wandb.team, cfg.wandb.group) == ("deepspeed", None, None)
    assert cfg.checkpoint.tag_validation == "WARN"
    assert cfg.checkpoint.load_universal is False
    assert cfg.checkpoint.parallel_write.pipeline_stage is False
    act = cfg.activation_checkpointing
    assert act.number_checkpoints is None and act.partition_activations is False
    assert cfg.data_types.grad_accum_dtype is None


def test_case_and_spelling_normalisation() -> None:
    raw = {
        "train_batch_size": 2,
        "communication_data_type": "BF16",
        "data_types": {"grad_accum_dtype": "float32"},
        "checkpoint": {"tag_validation": "Fail"},
    }
    cfg = load_config(raw, world_size=1)
    assert cfg.communication_data_type == "bf16"
    assert cfg.data_types.grad_accum_dtype == "fp32"
    assert cfg.checkpoint.tag_validation == "FAIL"


def test_every_field_is_documented() -> None:
    import partita.config as pkg
    from partita.config.sections import Section

    models = [v for v in vars(pkg).values() if isinstance(v, type) and issubclass(v, Section)]
    assert len(models) >= 16
    for model in models:
        assert model.__doc__, model
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"
