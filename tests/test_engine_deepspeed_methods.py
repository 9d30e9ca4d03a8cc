"""DeepSpeedEngine's public methods that scripts call: the tutorial accessors with DeepSpeed's
return values, module state dicts at every stage, offload/reload of the engine's states between
an RLHF actor's phases (bitwise), and the refusal of methods partita does not offer.

The expected values are DeepSpeed 0.19's, read from its engine and config code: e.g.
``zero_optimization()`` is ``stage > 0``, ``loss_scale()`` is ``fp16.loss_scale`` (0 when
dynamic), ``get_global_grad_norm()`` is None before the first step, ``optimizer_name()``
lower-cases DeepSpeed's own optimizer types."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_deepspeed_methods_workers import (
    accessor_cases,
    config,
    offload_cases,
    offload_refusals,
    state_dict_cases,
)
from partita.engine import Engine
from partita.engine.deepspeed_methods import REFUSED
from partita.testing import run_distributed

WORLD = 2


def test_tutorial_accessors_return_what_deepspeed_returns() -> None:
    fp16 = {"enabled": True, "loss_scale": 128, "initial_scale_power": 10}
    cases = [
        {"config": config(0)},
        {"config": config(1, bf16={"enabled": True})},
        {"config": config(2, fp16=fp16)},
        {"config": config(3, zero={"offload_optimizer": {"device": "cpu"}})},
    ]
    results = run_distributed(accessor_cases, WORLD, cases, timeout=240)
    stage0, bf16, fp16_run, offloaded = results[0]
    for got, stage in zip(results[0], (0, 1, 2, 3), strict=True):
        assert got["zero_optimization_stage"] == stage
        assert got["zero_optimization"] is (stage > 0)
        assert got["zero_optimization_partition_gradients"] is (stage >= 2)
        assert got["zero_optimization_partition_weights"] is (stage == 3)
        assert got["get_batch_info"] == (2 * 2 * WORLD, 2, 2)
        assert got["optimizer_name"] == "adamw"
        assert got["get_mom"] == [(0.9, 0.999)]
        assert got["norm_before"] is None
        assert isinstance(got["norm_after"], float) and got["norm_after"] > 0
        assert got["get_data_parallel_rank"] == 0
        assert got["flops_profiler_enabled"] is False
        assert got["curriculum_learning_enabled"] is False
        assert got["scheduler_name"] is None
        # set_train_batch_size keeps the micro batch and changes the accumulation steps;
        # set_train_micro_batch_size keeps the accumulation steps.
        assert got["after_set_batch"] == (2 * WORLD * 3, 2, 3)
        assert got["gas_after_set"] == 3
        assert got["after_set_micro"] == (4 * WORLD * 3, 4, 3)
        # backward returns the loss divided by the accumulation steps (3 by now), as
        # DeepSpeed does; scale_wrt_gas=False returns it whole. fp16's loss scale is not in it.
        assert got["backward_returns_share"] is True
        assert got["backward_returns_loss"] is False
        assert got["unscaled_returns_loss"] is True
    assert results[1][0]["get_data_parallel_rank"] == 1

    assert (stage0["bfloat16_enabled"], stage0["fp16_enabled"]) == (False, False)
    assert stage0["get_data_types"] == (torch.float32, torch.float32)
    assert stage0["communication_data_type"] == torch.float32
    assert stage0["loss_scale"] == 0.0 and stage0["dynamic_loss_scale"] is True
    assert (bf16["bfloat16_enabled"], bf16["bf16_enabled"], bf16["fp16_enabled"]) == (
        True,
        True,
        False,
    )
    assert bf16["get_data_types"] == (torch.bfloat16, torch.bfloat16)
    assert bf16["communication_data_type"] == torch.bfloat16
    assert (fp16_run["fp16_enabled"], fp16_run["bfloat16_enabled"]) == (True, False)
    assert fp16_run["loss_scale"] == 128.0 and fp16_run["dynamic_loss_scale"] is False
    assert fp16_run["initial_dynamic_scale"] == 1024
    assert offloaded["zero_offload_optimizer"] is True
    assert offloaded["zero_cpu_offload"] is True and offloaded["zero_use_cpu_optimizer"] is True
    assert stage0["zero_offload_optimizer"] is False and stage0["zero_cpu_offload"] is False


def test_refused_method_names_itself_and_hides_from_hasattr() -> None:
    results = run_distributed(accessor_cases, 1, [{"config": config(1)}], timeout=120)
    got = results[0][0]
    # hasattr must be False: Hugging Face and TRL probe engines with hasattr before calling.
    assert got["hasattr_refused"] is False
    kind, message = got["refused_error"]
    assert kind == "NotOfferedError"
    assert "DeepSpeedEngine.allreduce_gradients()" in message
    assert "engine.backward()" in message
    # Names nobody knows still read as a plain missing attribute.
    assert "no_such_method_at_all" in got["unknown_error"]


def test_refused_names_are_deepspeed_methods_partita_does_not_define() -> None:
    for name in REFUSED:
        assert not hasattr(Engine, name), f"{name} is both refused and defined"
    ds_engine = pytest.importorskip("deepspeed.runtime.engine").DeepSpeedEngine
    assert set(REFUSED) <= set(dir(ds_engine))
    # Every public DeepSpeedEngine method is either defined by partita's engine (or
    # nn.Module) or refused by name: nothing falls through to a bare AttributeError.
    public = {n for n in dir(ds_engine) if not n.startswith("_")}
    missing = sorted(n for n in public if not hasattr(Engine, n) and n not in REFUSED)
    assert missing == [], missing


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_module_state_dict_round_trip_trains_like_a_fresh_engine(stage: int) -> None:
    cases = [
        {"config": config(stage)},
        {"config": config(stage, bf16={"enabled": True}), "frozen": True},
    ]
    results = run_distributed(state_dict_cases, WORLD, cases, timeout=300)
    plain, frozen = results[0]
    for got in (plain, frozen):
        # Loading another model's weights, then training, is the run of an engine built from
        # that model: the masters and shards took the loaded values, not only the module.
        assert got["loaded_equals_other"]
        assert got["after_load"] == got["fresh"]
        assert got["bad_key"] is not None and "not.a.key" in got["bad_key"]
        assert got["values"].keys() == got["fresh_values"].keys()
        for k, v in got["values"].items():
            assert torch.equal(v, got["fresh_values"][k]), k
    assert len(frozen["keys_without_frozen"]) < len(frozen["keys"])
    assert plain["keys_without_frozen"] == plain["keys"]
    # Every rank sees the same full weights (at stage 3 too: gathered, not partitions).
    for k, v in plain["values"].items():
        assert torch.equal(v, results[1][0]["values"][k]), k
        assert v.numel() > 0


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["losses"] == b["losses"] and all(
        torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_and_reload_states_continue_training_bitwise(stage: int) -> None:
    keep_params = ["optim_states", "hp_params", "lp_grads"]
    cases = [
        {"config": config(stage), "include": None},
        {"config": config(stage), "include": "all"},
        {"config": config(stage), "include": keep_params},
        {"config": config(stage), "include": "all", "at_micro": 1},  # gradients held
        {"config": config(stage, bf16={"enabled": True}), "include": None},
        {"config": config(stage, bf16={"enabled": True}), "include": "all"},
    ]
    results = run_distributed(offload_cases, WORLD, cases, timeout=400)
    for rank_results in results:
        base, everything, generation, mid_step, base16, everything16 = rank_results
        for run in (everything, generation, mid_step):
            assert _same_run(base, run)
        assert _same_run(base16, everything16)
        for run in (everything, mid_step, everything16):
            # Nothing of the engine's state is left in its device storages, and the host
            # copies hold what was there; reloading gives every byte back.
            assert all(v == 0 for k, v in run["during"].items() if k != "host_copies")
            assert run["after"] == run["before"]
            assert run["optimizer_state_during"] == 0
            assert set(run["refused"]) == {"step", "forward", "save", "state_read"}
            assert "engine.reload_states()" in run["refused"]["step"]
        assert mid_step["before"]["lp_grads"] > 0  # the mid-step case did move gradients
        # Generation phase: optimizer state and masters gone, parameters kept, the module
        # runs and gives the same output as before offloading.
        assert generation["during"]["optim_states"] == 0
        assert generation["during"]["lp_params"] == generation["before"]["lp_params"] > 0
        assert generation["generated_equal"] is True
        assert set(generation["refused"]) == {"step", "save", "state_read"}
        if stage < 3:  # separate fp32 masters; at stage 3 an fp32 shard is its master
            assert generation["during"]["hp_params"] == 0
        assert everything16["during"]["hp_params"] == 0


def test_offload_states_refuses_what_deepspeed_refuses_naming_it() -> None:
    got = run_distributed(offload_refusals, 1, None, timeout=120)[0]
    assert "zero_optimization.offload_param" in got["offload_param"]
    assert "device='nvme'" in got["nvme"]
    assert "'bogus'" in got["unknown_kind"] and "optim_states" in got["unknown_kind"]


def test_offload_leaves_state_that_optimizer_offload_keeps_on_the_host() -> None:
    # bf16: on a CPU run an fp32 shard would be its own (host) master, one storage for both
    host_masters = config(3, zero={"offload_optimizer": {"device": "cpu"}}, bf16={"enabled": True})
    cases = [
        {"config": host_masters, "include": None},
        {"config": host_masters, "include": "all"},
    ]
    base, offloaded = run_distributed(offload_cases, WORLD, cases, timeout=240)[0]
    assert _same_run(base, offloaded)
    # As in DeepSpeed: masters and optimizer state already live on the host and stay put;
    # the parameter shards move.
    assert offloaded["during"]["optim_states"] == offloaded["before"]["optim_states"] > 0
    assert offloaded["during"]["hp_params"] == offloaded["before"]["hp_params"] > 0
    assert offloaded["during"]["lp_params"] == 0 < offloaded["before"]["lp_params"]
