"""CPU offload of optimizer state (stages 1-3) and parameters (stage 3): the same training,
bit for bit, as without offload.

On this CPU-only machine the host is also the compute device, so these runs exercise the
offload code paths (placement, cross-device copies, host-side norm) but not a real device-host
transfer; the GPU path is the same code with the tensors on different devices.
"""

from __future__ import annotations

import errno

import pytest
import torch

from engine_workers import assert_no_grads_at_forward, base_config, train_grid
from partita.testing import run_distributed

STEPS = 10
CPU = {"device": "cpu"}


def _zero(stage: int, **extra: object) -> dict:
    z: dict = {"stage": stage, "reduce_bucket_size": 3000, **extra}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0)
    return {"zero_optimization": z}


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_offload_is_bitwise_equal_to_no_offload(world: int) -> None:
    cases = []
    variants = [
        (1, {"offload_optimizer": CPU}),
        (2, {"offload_optimizer": CPU}),
        (3, {"offload_optimizer": CPU}),
        (3, {"offload_optimizer": CPU, "offload_param": CPU}),
        (3, {"offload_optimizer": {**CPU, "ratio": 0.4}}),  # partial offload
    ]
    for precision in ({}, {"bf16": {"enabled": True}}):
        for stage, offload in variants:
            cases.append({"config": base_config(2, 1, **precision, **_zero(stage)), "steps": STEPS})
            cases.append(
                {
                    "config": base_config(2, 1, **precision, **_zero(stage, **offload)),
                    "steps": STEPS,
                }
            )
    results = run_distributed(train_grid, world, cases, timeout=300)[0]
    for i, (plain, offloaded) in enumerate(zip(results[::2], results[1::2], strict=True)):
        assert_no_grads_at_forward(plain)  # host fp32 gradients released too
        assert_no_grads_at_forward(offloaded)
        partial = i % len(variants) == len(variants) - 1
        # int((1 - ratio) * n) of the n sub-group masters are kept on the compute device
        # (on this CPU-only machine that is the host too: the count shows the split).
        expected = int(0.6 * len(offloaded["sub_groups"])) if partial else 0
        assert offloaded.get("masters_on_device", 0) == expected and (expected > 0) == partial
        assert offloaded["losses"] == plain["losses"]
        assert all(
            torch.equal(a, b) for a, b in zip(offloaded["params"], plain["params"], strict=True)
        )


@pytest.mark.parametrize("world", [1, 2])
def test_nvme_offload_is_bitwise_equal_and_cleans_up(world: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Optimizer, parameters, and both on NVMe; also with accumulation (gradients added into
    their swap files) and clipping (the swapped step's two gradient passes)."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    variants = [
        ({"offload_optimizer": nvme}, (2, 1, 0.0)),
        ({"offload_param": nvme}, (2, 1, 0.0)),
        ({"offload_optimizer": nvme, "offload_param": nvme}, (2, 1, 0.0)),
        ({"offload_optimizer": nvme, "offload_param": nvme}, (1, 3, 0.05)),
        ({"offload_optimizer": nvme, "offload_param": nvme, "sub_group_size": 1500}, (2, 1, 0.0)),
    ]
    cases = []
    for precision in ({}, {"bf16": {"enabled": True}}):
        for offload, (micro, gas, clip) in variants:
            for z in (_zero(3), _zero(3, **offload)):
                cases.append(
                    {"config": base_config(micro, gas, clip=clip, **precision, **z), "steps": STEPS}
                )
    results = run_distributed(train_grid, world, cases, timeout=400)[0]
    for k, (plain, offloaded) in enumerate(zip(results[::2], results[1::2], strict=True)):
        offload = variants[k % len(variants)][0]
        assert offloaded["losses"] == plain["losses"]
        assert all(
            torch.equal(a, b) for a, b in zip(offloaded["params"], plain["params"], strict=True)
        )
        memory = offloaded["memory"]
        if "offload_optimizer" in offload:
            # Masters, gradients and Adam's moments are out of memory between steps; only the
            # 4-byte step counters (one per master) stay.
            assert memory["master_params"] == 0
            assert memory["grads"] == 0
            assert memory["optimizer_state"] <= 4 * 16
        if "offload_param" in offload:
            assert memory["params"] == 0  # every shard in its swap file, nothing gathered
        if "sub_group_size" in offload:  # smaller sub-groups, more of them; same arithmetic
            # (a parameter is never split: one larger than the limit is a sub-group of its own)
            assert max(offloaded["sub_groups"]) < max(plain["sub_groups"])
            assert len(offloaded["sub_groups"]) > len(plain["sub_groups"])
    assert list(tmp_path.iterdir()) == []  # swap files removed when the ranks exit


def test_nvme_offload_bad_paths_fail_before_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import partita
    from models import make_model
    from partita.config import ConfigError

    missing = tmp_path / "missing"
    for block, offload, expected in [
        (
            "offload_optimizer",
            {"device": "nvme", "nvme_path": str(missing)},
            "offload_optimizer.nvme_path",
        ),
        ("offload_optimizer", {"device": "nvme"}, "nvme_path"),
        ("offload_param", {"device": "nvme", "nvme_path": str(missing)}, "offload_param.nvme_path"),
        ("offload_param", {"device": "nvme"}, "offload_param.nvme_path"),
    ]:
        model = make_model()
        config = base_config(2, 1, **_zero(3, **{block: offload}))
        with pytest.raises(ConfigError, match=expected):
            partita.initialize(model=model, config=config, dist_init_required=False)
    stage2 = base_config(
        2, 1, **_zero(2, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    )
    with pytest.raises(ConfigError, match=r"needs zero_optimization\.stage 3"):
        partita.initialize(model=make_model(), config=stage2, dist_init_required=False)
    # Below stage 3 DeepSpeed ignores offload_param, and so does partita (with a warning): its
    # path is not checked and no swap space is set up for it.
    from partita.config import load_config
    from partita.engine.setup import check_offload_paths, offload_placement

    params_stage2 = base_config(
        2, 1, **_zero(2, offload_param={"device": "nvme", "nvme_path": str(missing)})
    )
    cfg = load_config(params_stage2, world_size=1)
    check_offload_paths(cfg, make_model(), 0, 1)  # the missing path is not an error here
    assert offload_placement(cfg).params.where == "device"


def test_disk_full_during_a_swap_stops_the_run_naming_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from offload_workers import disk_full_mid_run

    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
    (tmp_path / "swap").mkdir()
    config = base_config(2, 1, **_zero(3, offload_optimizer=nvme, offload_param=nvme))
    out = run_distributed(disk_full_mid_run, 1, config, str(tmp_path / "ckpt"), timeout=200)[0]
    assert out["errno"] == errno.ENOSPC
    assert out["filename"].startswith(out["swap_dir"]) and out["filename"] in out["error"]
    assert out["intact"]  # a fresh engine loads the step-3 checkpoint bit for bit
    assert any(f.startswith("step3") for f in out["checkpoint_files"])
    assert list((tmp_path / "swap").iterdir()) == []


def test_nvme_offload_trains_a_model_four_times_the_memory_cap(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Stage 3 with optimizer and parameters on NVMe, the model built under
    ``zero.Init(remote_device="nvme")``: the model states (16 bytes per parameter) are over 4x
    the RSS the run may add to the process (the cap), and construction, set-up and training
    stay under it. Bounded by the config: units of one block, at most ~2 blocks gathered, one
    sub-group (block) of master/moments/gradient resident in the step, up to 5 shards read
    ahead and 2 gradient writes running in backward."""
    from offload_workers import train_under_cap

    cap = 80 * 2**20
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    zero = _zero(
        3,
        offload_optimizer=nvme,
        offload_param=nvme,
        stage3_max_live_parameters=1_100_000,
        stage3_prefetch_bucket_size=600_000,
    )
    config = base_config(2, 1, **zero)
    model = {"dim": 256, "layers": 48}
    out = run_distributed(train_under_cap, 1, config, model, 3, timeout=400)[0]
    assert out["model_state_bytes"] >= 4 * cap
    assert out["peak"] <= cap, out
    print(
        f"peak {out['peak'] >> 20} MiB, cap {cap >> 20} MiB, states {out['model_state_bytes'] >> 20} MiB"
    )
    assert out["memory"]["master_params"] == 0 and out["memory"]["params"] == 0
    assert list(tmp_path.iterdir()) == []  # Init's and the engine's swap files removed


def test_zero_init_with_chunks_on_nvme_matches_an_eager_build(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """zero.Init(remote_device="nvme") keeps each chunk in a swap file; the model equals an eager
    build, trains like a stage-3 run without offload, and GatheredParameters(modifier_rank=0)
    writes reach every rank's (swapped) shard and master."""
    from engine_workers import init_probe

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    config = base_config(2, 1, **_zero(3, offload_optimizer=nvme, offload_param=nvme))
    results = run_distributed(init_probe, 2, config, "tiny", 4, "nvme", timeout=300)
    case = {
        "config": base_config(2, 1, **_zero(3)),
        "steps": 4,
        "model_kwargs": {"dim": 64, "layers": 4},
    }
    reference = run_distributed(train_grid, 2, [case], timeout=300)[0][0]
    for res in results:
        assert res["same_as_eager"] and res["losses"] == reference["losses"]
        assert res["seen"] and res["master"]
        assert res["stats"][1] == 0  # no chunk bytes held in memory after construction
    assert list(tmp_path.iterdir()) == []


def test_nvme_buffer_settings_bound_what_is_resident(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """offload_optimizer: one sub-group in memory at a time unless pipeline_read/pipeline_write
    ask for more and buffer_count (4 state tensors per sub-group) covers it. offload_param:
    buffer_count bounds the shards read ahead; max_in_cpu, when given, keeps shards of the
    first units in memory (elements per rank). The training is bitwise the same throughout."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    both = {"pipeline_read": True, "pipeline_write": True}
    unit = 8416  # elements of the first (largest) units of the test model; shards are half
    variants: list[tuple[dict, dict]] = [
        ({"offload_optimizer": nvme}, {"peak_resident_sub_groups": 1}),
        ({"offload_optimizer": {**nvme, "pipeline_read": True}}, {"peak_resident_sub_groups": 1}),
        (
            {"offload_optimizer": {**nvme, **both, "buffer_count": 8}},
            {"peak_resident_sub_groups": 2},
        ),
        (
            {"offload_optimizer": {**nvme, **both, "buffer_count": 12}},
            {"peak_resident_sub_groups": 3},
        ),
        ({"offload_param": {**nvme, "buffer_count": 1}}, {"peak_resident_shards": 2}),
        ({"offload_param": nvme}, {"peak_resident_shards": 3, "swapped_shards": 5}),
        ({"offload_param": {**nvme, "max_in_cpu": unit}}, {"swapped_shards": 3}),
        ({"offload_param": {**nvme, "max_in_cpu": 10**9}}, {"swapped_shards": 0}),
    ]
    cases = [{"config": base_config(2, 1, **_zero(3)), "steps": 4}]
    cases += [{"config": base_config(2, 1, **_zero(3, **v)), "steps": 4} for v, _ in variants]
    plain, *results = run_distributed(train_grid, 2, cases, timeout=300)[0]
    assert plain["unit_numels"][:2] == [unit, unit]
    for (offload, expected), out in zip(variants, results, strict=True):
        assert out["losses"] == plain["losses"], offload
        assert all(torch.equal(a, b) for a, b in zip(out["params"], plain["params"], strict=True))
        for key, value in expected.items():
            assert out[key] == value, (offload, key, out[key])


def test_optimizer_pipeline_follows_buffer_count(caplog: pytest.LogCaptureFixture) -> None:
    from partita.config.sections.zero import OffloadOptimizerConfig
    from partita.zero.stage3.nvme import optimizer_pipeline

    def window(**kwargs: object) -> tuple[bool, bool]:
        return optimizer_pipeline(OffloadOptimizerConfig(device="nvme", nvme_path="/x", **kwargs))

    assert window() == (False, False)
    assert window(pipeline_read=True, pipeline_write=True, buffer_count=12) == (True, True)
    assert not caplog.records
    assert window(pipeline_read=True, pipeline_write=True, buffer_count=8) == (True, False)
    assert "buffer_count=8" in caplog.text and "raise buffer_count to 12" in caplog.text
    assert window(pipeline_write=True) == (False, False)


def test_pin_memory_follows_the_offload_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``pin_memory`` (DeepSpeed's default: true) page-locks the host masters with their
    gradients (stages 1-2) or the masters and CPU shards (stage 3); false pins nothing; swapped
    (NVMe) state lives in the swap buffers, not in pinned masters."""
    from offload_workers import pinned_by_config

    def config(stage: int, **blocks: object) -> dict:
        # bf16: an fp32 master in host memory would be its shard itself (nothing to pin twice)
        return base_config(2, 1, bf16={"enabled": True}, **_zero(stage, **blocks))

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    configs = [
        config(2, offload_optimizer=CPU),
        config(2, offload_optimizer={**CPU, "pin_memory": False}),
        config(3, offload_optimizer=CPU),
        config(3, offload_optimizer=CPU, offload_param=CPU),
        config(3, offload_optimizer={**CPU, "pin_memory": False}, offload_param=CPU),
        config(3, offload_optimizer=nvme),
        config(2),
    ]
    (got,) = run_distributed(pinned_by_config, 1, configs, timeout=120)
    s2, s2_off, s3, s3_both, s3_params, s3_nvme, plain = got
    assert s2["pinned"] == 2 * s2["masters"] and s2["pinned_masters"] == s2["masters"]
    assert s2_off["pinned"] == 0 and plain["pinned"] == 0
    assert s3["pinned"] == s3["pinned_masters"] == s3["masters"] > 1
    assert s3_both["pinned"] == s3_both["masters"] + s3_both["shards"]
    assert s3_params["pinned"] == s3_params["shards"] and s3_params["pinned_masters"] == 0
    assert s3_nvme["pinned"] == 0
