"""ZeRO stage 3: parity with single-process torch.optim and stage 0, hard cases (tied weights,
activation checkpointing, frozen parameters, Hugging Face models and generate), memory per
rank, communication volume and gather bounds."""

from __future__ import annotations

import pytest
import torch

from engine_workers import (
    assert_no_grads_at_forward,
    base_config,
    generate_after_training,
    train_grid,
)
from models import STEPS as PARITY_STEPS
from models import Reference, assert_parity, pairs, reference_run, with_float64
from partita.testing import run_distributed

STEPS = 20
RTOL = 1e-6


def _z3(**extra: object) -> dict:
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 3000,
        **extra,
    }
    return {"zero_optimization": zero}


@pytest.mark.parity
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_parity_hard_cases_and_determinism(world: int) -> None:
    z = _z3()
    cases = [
        {"config": base_config(2, 1, **z), "steps": PARITY_STEPS},
        {"config": base_config(2, 4, **z), "steps": PARITY_STEPS},
        {"config": base_config(2, 1, clip=0.05, **z), "steps": PARITY_STEPS},
        {
            "config": base_config(2, 1, **z),
            "steps": PARITY_STEPS,
            "groups": True,
            "model_kwargs": {"frozen": True},
        },
        {"config": base_config(2, 1, **z), "steps": PARITY_STEPS, "model_kwargs": {"tie": True}},
        {
            "config": base_config(2, 1, **z),
            "steps": PARITY_STEPS,
            "model_kwargs": {"checkpoint": True},
        },
        {"config": base_config(2, 1, **z), "steps": PARITY_STEPS},  # again: bitwise
        {"config": base_config(2, 1), "steps": PARITY_STEPS},  # stage 0
        # DeepSpeed's default knobs: every parameter of this small model is "persistent".
        {"config": base_config(2, 1, zero_optimization={"stage": 3}), "steps": PARITY_STEPS},
    ]
    results = run_distributed(train_grid, world, with_float64(cases), timeout=300)
    plain, accum, clipped, grouped, tied, ckpt, again, stage0, defaults = pairs(results[0])
    batch = 2 * world
    ref = reference_run(PARITY_STEPS, batch=batch)
    assert_parity(plain, ref)
    assert_parity(defaults, ref)
    assert_parity(plain, Reference.of_pair(stage0))
    assert_parity(accum, reference_run(PARITY_STEPS, batch=8 * world))
    assert_parity(clipped, reference_run(PARITY_STEPS, batch=batch, clip=0.05))
    assert_parity(
        grouped,
        reference_run(PARITY_STEPS, batch=batch, groups=True, model_kwargs={"frozen": True}),
    )
    assert_parity(tied, reference_run(PARITY_STEPS, batch=batch, model_kwargs={"tie": True}))
    assert_parity(ckpt, reference_run(PARITY_STEPS, batch=batch, model_kwargs={"checkpoint": True}))
    for twin in (0, 1):  # fp32 and float64: the same run twice is bitwise the same
        assert again[twin]["losses"] == plain[twin]["losses"]
        assert all(
            torch.equal(a, b)
            for a, b in zip(again[twin]["params"], plain[twin]["params"], strict=True)
        )
        assert plain[twin]["persistent_numel"] == 0 and defaults[twin]["unit_numels"] == []
    for rank_results in results[1:]:
        for rank_case, case in zip(rank_results, results[0], strict=True):
            assert all(
                torch.equal(a, b) for a, b in zip(rank_case["params"], case["params"], strict=True)
            )


@pytest.mark.parity
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_and_generate(kind: str) -> None:
    world = 2
    cases = [
        {"config": base_config(2, 1, **z), "steps": PARITY_STEPS, "model_kwargs": {"kind": kind}}
        for z in (_z3(), {})
    ]
    results = run_distributed(train_grid, world, with_float64(cases), timeout=300)
    stage3, stage0 = pairs(results[0])
    assert_parity(stage3, reference_run(PARITY_STEPS, batch=2 * world, model_kwargs={"kind": kind}))
    # Two ranks: one summation order, so stage 3 reproduces stage 0 bit for bit.
    for twin in (0, 1):
        assert stage3[twin]["losses"] == stage0[twin]["losses"]
        assert all(
            torch.equal(a, b)
            for a, b in zip(stage3[twin]["params"], stage0[twin]["params"], strict=True)
        )
    gen3 = run_distributed(
        generate_after_training, world, base_config(2, 1, **_z3()), kind, timeout=300
    )
    gen0 = run_distributed(generate_after_training, world, base_config(2, 1), kind, timeout=300)
    assert gen3[0] == gen0[0] == gen3[1]
    assert len(gen3[0][0]) == 3 + 4


@pytest.mark.parametrize("world", [2, 4])
def test_memory_communication_and_gather_bounds(world: int) -> None:
    bound = 13000  # the root unit (4160 elements) plus one block (8416), with padding
    cases = [
        {"config": base_config(2, 1, **_z3()), "steps": 3},
        {"config": base_config(2, 1, **_z3(stage3_max_live_parameters=bound)), "steps": 3},
        {"config": base_config(2, 1, bf16={"enabled": True}, **_z3()), "steps": 3},
    ]
    native = {"PARTITA_COLLECTIVES": "native"}  # gloo's own collectives: the algorithm's volume
    for fp32, bounded, bf16 in run_distributed(train_grid, world, cases, timeout=300, env=native):
        for res in (fp32, bounded, bf16):  # [Note: released gradients]
            assert_no_grads_at_forward(res)
        psi = fp32["numel"]
        padded = fp32["padded_numel"]
        assert padded - psi <= 16 * (world + 1) * 12  # padding: per segment and per tensor
        # Between steps, fp32 model: the parameter shard (which is also the master), its
        # gradient and Adam's two moments: 16 bytes per parameter over N ranks.
        mem = fp32["memory"]
        assert mem["master_params"] == 0
        held = mem["params"] + mem["grads"] + mem["master_params"] + mem["optimizer_state"]
        assert 16 * psi / world <= held <= 16 * padded / world + 64, (held, 16 * psi / world)
        # bf16 model: 2-byte shard, fp32 master, fp32 gradient shard, Adam: 18 bytes.
        mem = bf16["memory"]
        held = mem["params"] + mem["grads"] + mem["master_params"] + mem["optimizer_state"]
        assert 18 * psi / world <= held <= 18 * padded / world + 64, (held, 18 * psi / world)
        # Per step: all-gather in forward and again in backward, one reduce-scatter: 3 psi.
        for step in fp32["comm"]:
            moved = (step[("all_gather", "param")] + step[("reduce_scatter", "grad")]) // 4
            assert moved == 3 * padded, (moved, 3 * padded)
        # The bound must have been active: the unbounded run goes past it, the bounded one not.
        assert bounded["peak_live"] <= bound < fp32["peak_live"], (bound, fp32["peak_live"])
        assert bounded["losses"] == fp32["losses"]


@pytest.mark.parametrize("kind", ["tiny", "gpt2"])
def test_zero_init_builds_sharded_and_gathered_parameters_modify(kind: str) -> None:
    from engine_workers import init_probe

    world = 2
    config = base_config(2, 1, **_z3())
    model_kwargs = {"kind": kind, **({"dim": 64, "layers": 4} if kind == "tiny" else {})}
    results = run_distributed(init_probe, world, config, kind, 5, timeout=300)
    case = {"config": config, "steps": 5, "model_kwargs": model_kwargs}
    reference = run_distributed(train_grid, world, [case], timeout=300)[0][0]
    for res in results:
        assert res["same_as_eager"]  # Init changes where weights live, not their values
        peak, sharded = res["stats"]
        # Never more than this rank's shards plus one module's full parameters.
        assert sharded <= 4 * res["numel"] / world + 4 * 64
        assert peak <= res["largest_module_bytes" if kind == "tiny" else "largest_family_bytes"]
        assert res["losses"] == reference["losses"]
        assert res["seen"] and res["master"]


def test_peft_lora_trains_and_matches_single_process() -> None:
    world = 2
    kwargs = {"kind": "gpt2-lora"}
    cases = [
        {"config": base_config(2, 1, **z), "steps": PARITY_STEPS, "model_kwargs": kwargs}
        for z in (_z3(), {})
    ]
    stage3, stage0 = pairs(run_distributed(train_grid, world, with_float64(cases), timeout=300)[0])
    ref = reference_run(PARITY_STEPS, batch=2 * world, model_kwargs=kwargs)
    assert_parity(stage3, ref)
    assert stage3[0]["numel"] < 0.2 * sum(p.numel() for p in ref.params)  # only LoRA weights train
    for twin in (0, 1):
        assert stage3[twin]["losses"] == stage0[twin]["losses"]
        for got, dp in zip(stage3[twin]["params"], stage0[twin]["params"], strict=True):
            assert torch.equal(got, dp)


def test_save_16bit_model_writes_gathered_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from safetensors.torch import load_file

    from engine_workers import save16_probe
    from models import make_model

    world = 2
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    config = base_config(2, 1, bf16={"enabled": True}, **_z3())
    params = run_distributed(save16_probe, world, config, str(single), 1 << 40, timeout=300)[0]
    run_distributed(save16_probe, world, config, str(sharded), 20000, timeout=300)
    names = [n for n, _ in make_model().named_parameters()]
    loaded = load_file(single / "model.safetensors")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = {f: load_file(sharded / f) for f in set(index["weight_map"].values())}
    assert len(shards) > 1
    for name, want in zip(names, params, strict=True):
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name].float(), want)
        assert torch.equal(shards[index["weight_map"][name]][name].float(), want)
    model = make_model().to(torch.bfloat16)
    model.load_state_dict(loaded)  # loads into the unsharded model


def test_touching_a_sharded_parameter_raises_naming_its_unit() -> None:
    import partita
    from models import make_model
    from partita.zero.placeholder import ShardedParameterError

    model = make_model()
    engine, _, _, _ = partita.initialize(
        model=model, config=base_config(2, 1, **_z3()), dist_init_required=False
    )
    weight = engine.module.blocks[0].fc1.weight
    # Metadata stays readable: shapes, dtypes and flags are what code inspects.
    assert weight.shape == (128, 32) and weight.dtype == torch.float32 and weight.requires_grad
    assert weight.numel() == 128 * 32 and weight.device.type == "cpu"
    for use in (lambda: weight.sum(), lambda: weight + 1, lambda: weight.cpu().numpy()):
        with pytest.raises(ShardedParameterError, match=r"unit 'blocks\.0'.*GatheredParameters"):
            use()
    with partita.zero.GatheredParameters([weight]):
        assert torch.isfinite(weight.sum())  # gathered: an ordinary parameter again
    with pytest.raises(ShardedParameterError):
        weight.sum()  # released again on exit
    engine.destroy()
