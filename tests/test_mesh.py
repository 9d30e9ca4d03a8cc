"""The job's parallel dimensions as one torch `DeviceMesh` (``engine.mesh_device``), and
``initialize(mesh_param=...)``: DeepSpeed's ``(dp, sp)`` tuple or a `DeviceMesh` with named
dimensions sets the sizes the config would, and a mesh partita cannot train on fails on every
rank, naming its dimensions and sizes ([Note: the job's mesh] in `partita.comm.mesh`). One
spawn of 4 CPU ranks runs every case."""

from __future__ import annotations

import pytest

from mesh_workers import base_config, mesh_grid
from models import STEPS
from partita.comm.mesh import LAYOUTS, mesh_sizes
from partita.testing import run_distributed

WORLD = 4
SQUARE = [[0, 1], [2, 3]]


def _config(stage: int = 2, **extra: object) -> dict:
    return base_config(2, 1, zero_optimization={"stage": stage}, **extra)


def _hybrid(stage: int) -> dict:
    return base_config(2, 1, zero_optimization={"stage": stage, "mics_shard_size": 2})


HYBRID_MESH = {"names": ("dp_replicate", "dp_shard"), "shape": (2, 2)}
PROBES = {
    "plain": (_config(), None),
    "hybrid": (_hybrid(3), None),
    "sp": (_config(sequence_parallel_size=2), None),
    "tuple": (_config(), (2, 2)),  # DeepSpeed's (dp, sp)
    "long_names": (_config(), {"names": ("data_parallel", "sequence_parallel"), "shape": (2, 2)}),
    "hybrid_mesh": (_config(3), HYBRID_MESH),
    "one_dim": (_config(), {"names": ("dp",), "shape": (4,)}),
}
BAD = {
    "too_many_ranks": (_config(), (4, 2)),
    "transposed": (_config(), {"names": ("dp", "sp"), "layout": [[0, 2], [1, 3]]}),
    "unknown_dims": (_config(), {"names": ("pp", "dp"), "shape": (2, 2)}),
    "disagrees": (_config(sequence_parallel_size=4), (2, 2)),
    "with_hybrid_key": (_hybrid(2), {"names": ("dp_replicate", "dp_shard"), "shape": (1, 4)}),
}


@pytest.fixture(scope="module")
def results() -> dict:
    cases: list[dict] = [{"probe": p} for p in PROBES.values()]
    cases += [{"probe": b} for b in BAD.values()]
    cases += [
        {"train": {"config": _hybrid(2), "steps": STEPS}},
        {"mesh_train": (_config(2), HYBRID_MESH)},
    ]
    per_rank = run_distributed(mesh_grid, WORLD, cases, timeout=240)
    n, b = len(PROBES), len(BAD)
    return {
        "probe": [dict(zip(PROBES, r[:n], strict=True)) for r in per_rank],
        "bad": [dict(zip(BAD, r[n : n + b], strict=True)) for r in per_rank],
        "train": [r[n + b :] for r in per_rank],
    }


def test_each_layout_is_one_named_mesh_over_its_groups(results: dict) -> None:
    for rank, probes in enumerate(results["probe"]):
        plain = probes["plain"]
        assert plain["names"] == ("dp",) and plain["layout"] == [0, 1, 2, 3]
        hybrid = probes["hybrid"]
        assert hybrid["names"] == ("dp_replicate", "dp_shard") and hybrid["layout"] == SQUARE
        first = rank - rank % 2
        assert hybrid["groups"]["dp_shard"] == [first, first + 1]
        assert hybrid["groups"]["dp_replicate"] == [rank % 2, rank % 2 + 2]
        sp = probes["sp"]
        assert sp["names"] == ("dp", "sp") and sp["layout"] == SQUARE
        assert sp["groups"]["sp"] == [first, first + 1]
        assert sp["groups"]["dp"] == [rank % 2, rank % 2 + 2]


def test_mesh_param_sets_the_sizes_the_config_would(results: dict) -> None:
    for probes in results["probe"]:
        for name in ("tuple", "long_names"):
            assert probes[name]["names"] == ("dp", "sp") and probes[name]["sp"] == 2
            assert probes[name]["groups"] == probes["sp"]["groups"]
        assert probes["hybrid_mesh"]["names"] == ("dp_replicate", "dp_shard")
        assert probes["hybrid_mesh"]["zero_world"] == 2
        assert probes["hybrid_mesh"]["groups"] == probes["hybrid"]["groups"]
        assert probes["one_dim"]["names"] == ("dp",) and probes["one_dim"]["zero_world"] == 4


def test_a_hybrid_mesh_trains_as_the_hybrid_config(results: dict) -> None:
    for from_config, from_mesh in results["train"]:
        assert from_mesh == from_config  # bitwise: the same job, described twice


def test_bad_meshes_fail_on_every_rank_naming_dimensions_and_sizes(results: dict) -> None:
    for bad in results["bad"]:
        assert "dp=4, sp=2" in bad["too_many_ranks"] and "8 ranks" in bad["too_many_ranks"]
        assert "consecutive" in bad["transposed"] and "dp=2, sp=2" in bad["transposed"]
        assert "pp=2, dp=2" in bad["unknown_dims"]
        assert "sequence_parallel_size" in bad["disagrees"] and "4" in bad["disagrees"]
        assert "zero_optimization.mics_shard_size" in bad["with_hybrid_key"]
    assert len({tuple(sorted(b.items())) for b in results["bad"]}) == 1  # same on every rank


def test_mesh_sizes_reads_deepspeeds_tuple_without_a_process_group() -> None:
    sizes = mesh_sizes((2, 4), 8)
    assert (sizes.names, sizes.shape, sizes.key, sizes.value) == (
        ("dp", "sp"), (2, 4), "sequence_parallel_size", 4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="two positive sizes"):
        mesh_sizes((2, 0), 8)
    assert ("dp",) in LAYOUTS
