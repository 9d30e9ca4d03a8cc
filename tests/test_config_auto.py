"""resolve_auto and realistic Hugging Face style configs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from partita.config import ConfigError, load_config, resolve_auto

HF_ZERO2: dict[str, Any] = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

HF_ZERO3: dict[str, Any] = {
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 2e-5,
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
    "flops_profiler": {"enabled": False},
}


def test_hf_zero2_config_fills_and_loads() -> None:
    before = copy.deepcopy(HF_ZERO2)
    filled = resolve_auto(
        HF_ZERO2,
        train_micro_batch_size_per_gpu=4,
        gradient_accumulation_steps=2,
        train_batch_size=32,
        gradient_clipping=1.0,
        lr=3e-4,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.01,
        warmup_min_lr=0,
        warmup_max_lr=3e-4,
        warmup_num_steps=100,
        fp16=False,
        bf16=True,
    )
    assert before == HF_ZERO2  # input untouched
    assert filled["optimizer"]["params"] == {
        "lr": 3e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.01,
    }
    cfg = load_config(filled, world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (32, 4)
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    zero = cfg.zero_optimization
    assert zero.stage == 2 and zero.reduce_bucket_size == 200_000_000
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_num_steps"] == 100


def test_hf_zero3_offload_config_with_dotted_keys() -> None:
    hidden = 1024
    filled = resolve_auto(
        HF_ZERO3,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=4,
        **{
            "scheduler.params.warmup_num_steps": 50,
            "scheduler.params.total_num_steps": 1000,
            "zero_optimization.reduce_bucket_size": hidden * hidden,
            "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
        },
    )
    cfg = load_config(filled, world_size=2)
    assert cfg.train_batch_size == 16
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.overlap_comm
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"
    assert zero.stage3_prefetch_bucket_size == 943_718
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.scheduler is not None and cfg.scheduler.params["total_num_steps"] == 1000


def test_mismatches_and_unfilled_autos_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_auto(
            HF_ZERO3,
            gradient_accumulation_steps=8,  # config says 4
            lr=1e-3,  # config says 2e-5
            betas=[0.9, 0.999],  # agrees
            bf16=False,  # config says true
            train_micro_batch_size_per_gpu=2,
        )
    problems = info.value.problems
    assert [p.path for p in problems] == [
        "gradient_accumulation_steps",
        "optimizer.params.lr",
        "bf16.enabled",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    ]
    assert "config has 4 but 8 was supplied" in problems[0].message
    assert "no value was supplied" in problems[-1].message


def test_equal_values_in_other_spellings_are_not_mismatches() -> None:
    raw = {
        "train_batch_size": 8,
        "zero_optimization": {"reduce_bucket_size": 5e8},
        "fp16": {"enabled": False},
    }
    out = resolve_auto(raw, train_batch_size=8.0, reduce_bucket_size=500_000_000, fp16=False)
    assert out == raw and out is not raw
    with pytest.raises(ConfigError, match="config has False but 0 was supplied"):
        resolve_auto(raw, fp16=0)


def test_unknown_names_get_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_auto(
            {"train_batch_size": "auto"},
            train_bach_size=8,
            **{"zero_optimization.reduce_bucket_sz": 1},
        )
    messages = [str(p) for p in info.value.problems]
    assert "did you mean 'train_batch_size'?" in messages[0]
    assert "did you mean 'reduce_bucket_size'?" in messages[1]
    assert messages[2].startswith("train_batch_size: ")  # still "auto", nothing supplied


def test_absent_keys_are_not_added() -> None:
    out = resolve_auto(
        {"train_batch_size": "auto"}, train_batch_size=16, lr=1e-3, gradient_clipping=0.5
    )
    assert out == {"train_batch_size": 16}
