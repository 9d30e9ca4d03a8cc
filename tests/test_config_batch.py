"""Batch-size triple: DeepSpeed's resolution rules for every combination of given keys."""

from __future__ import annotations

import pytest

from partita.config import ConfigError, load_config, resolve_batch_sizes

# (train_batch_size, micro, gas, world_size) -> expected (train, micro, gas), as DeepSpeed's
# _set_batch_related_parameters + _batch_assertion compute them (hand-evaluated).
RESOLVED = [
    # all three given: taken as is when consistent
    ((32, 4, 2, 4), (32, 4, 2)),
    ((16, 4, 2, 2), (16, 4, 2)),
    ((8, 8, 1, 1), (8, 8, 1)),
    # train + micro: gas = train // micro // world
    ((32, 4, None, 1), (32, 4, 8)),
    ((32, 4, None, 2), (32, 4, 4)),
    ((32, 4, None, 4), (32, 4, 2)),
    # train + gas: micro = train // world // gas
    ((32, None, 4, 1), (32, 8, 4)),
    ((32, None, 4, 2), (32, 4, 4)),
    ((32, None, 2, 4), (32, 4, 2)),
    # micro + gas: train = micro * gas * world
    ((None, 4, 2, 1), (8, 4, 2)),
    ((None, 4, 2, 2), (16, 4, 2)),
    ((None, 4, 2, 4), (32, 4, 2)),
    # train only: gas = 1, micro = train // world
    ((32, None, None, 1), (32, 32, 1)),
    ((32, None, None, 2), (32, 16, 1)),
    ((32, None, None, 4), (32, 8, 1)),
    # micro only: gas = 1, train = micro * world
    ((None, 8, None, 1), (8, 8, 1)),
    ((None, 8, None, 2), (16, 8, 1)),
    ((None, 8, None, 4), (32, 8, 1)),
]

# DeepSpeed rejects these (assertion or, for a zero divisor, a crash); partita raises ConfigError.
REJECTED = [
    # neither train nor micro
    ((None, None, None, 1), "set train_batch_size or train_micro_batch_size_per_gpu"),
    ((None, None, 4, 2), "set train_batch_size or train_micro_batch_size_per_gpu"),
    # all three given, identity broken
    ((32, 4, 2, 2), "32 != 4 * 2 * 2"),
    ((32, 4, 2, 1), "32 != 4 * 2 * 1"),
    ((8, 4, 1, 4), "8 != 4 * 1 * 4"),
    # train + micro: floor division loses samples, or gas becomes 0
    ((30, 4, None, 1), "30 != 4 * 7 * 1"),
    ((32, 4, None, 3), "32 != 4 * 2 * 3"),
    ((8, 16, None, 1), "derived gradient_accumulation_steps=0"),
    ((8, 4, None, 4), "derived gradient_accumulation_steps=0"),
    # train + gas
    ((32, None, 3, 2), "32 != 5 * 3 * 2"),
    ((4, None, 8, 1), "derived train_micro_batch_size_per_gpu=0"),
    ((6, None, 1, 4), "6 != 1 * 1 * 4"),
    # train only
    ((30, None, None, 4), "30 != 7 * 1 * 4"),
    ((2, None, None, 4), "derived train_micro_batch_size_per_gpu=0"),
    ((3, None, None, 2), "3 != 1 * 1 * 2"),
    # non-positive values given
    ((0, 4, None, 1), "train_batch_size=0"),
    ((None, -1, None, 2), "train_micro_batch_size_per_gpu=-1"),
    ((32, 4, 0, 4), "gradient_accumulation_steps=0"),
    ((None, 0, 2, 1), "train_micro_batch_size_per_gpu=0"),
]


@pytest.mark.parametrize(("given", "expected"), RESOLVED)
def test_resolved_like_deepspeed(given: tuple, expected: tuple) -> None:
    *triple, world = given
    sizes = resolve_batch_sizes(*triple, world_size=world)
    got = (
        sizes.train_batch_size,
        sizes.train_micro_batch_size_per_gpu,
        sizes.gradient_accumulation_steps,
    )
    assert got == expected


@pytest.mark.parametrize(("given", "fragment"), REJECTED)
def test_rejected_like_deepspeed(given: tuple, fragment: str) -> None:
    *triple, world = given
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(*triple, world_size=world)
    message = str(info.value)
    assert fragment in message
    # The message names the three values as given and the world size.
    train, micro, gas = triple
    assert f"train_batch_size={train}" in message
    assert f"train_micro_batch_size_per_gpu={micro}" in message
    assert f"gradient_accumulation_steps={gas}" in message
    assert f"world_size={world}" in message


def test_all_eight_key_combinations_are_covered() -> None:
    shapes = {tuple(v is not None for v in g[:3]) for g, _ in RESOLVED + REJECTED}
    assert len(shapes) == 8
    for world in (1, 2, 4):
        assert any(g[3] == world for g, _ in REJECTED)


@pytest.mark.parametrize(("given", "expected"), RESOLVED)
def test_load_config_resolves_absent_keys(given: tuple, expected: tuple) -> None:
    *triple, world = given
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    raw = {k: v for k, v in zip(keys, triple, strict=True) if v is not None}
    cfg = load_config(raw, world_size=world)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected


def test_load_config_reports_batch_error_with_other_problems() -> None:
    raw = {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "fp16": {"enabeld": True}}
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=2)
    paths = [p.path for p in info.value.problems]
    assert paths == ["train_batch_size", "fp16.enabeld"]
    assert "world_size=2" in str(info.value)


def test_batch_values_written_as_floats() -> None:
    cfg = load_config({"train_batch_size": 3.2e1, "gradient_accumulation_steps": 2.0}, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (32, 8)
    assert isinstance(cfg.train_batch_size, int)
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 32.5}, world_size=1)
    assert info.value.problems[0].path == "train_batch_size"
    assert "whole number" in str(info.value)


@pytest.mark.parametrize("world", [0, -1, 1.0, True])
def test_world_size_must_be_positive_int(world: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        load_config({"train_batch_size": 8}, world_size=world)  # type: ignore[arg-type]
