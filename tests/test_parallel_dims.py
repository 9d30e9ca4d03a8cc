"""ZeRO over a data-parallel sub-group: `partita.comm.ParallelDims` and DeepSpeed's ``mpu``.

Four ranks run as two independent data-parallel groups of two ({0, 1} and {2, 3}), each
replica on its own data; each must be bitwise its own plain two-rank run, and move the same
bytes per step (the collectives run over the replica's group, not the world).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import partita
from engine_workers import _full_params, base_config
from models import global_batches, make_model, rank_micro_batch
from partita import comm
from partita.testing import run_distributed

STEPS = 4
MICRO = 2
STAGES = (0, 1, 2, 3, "3+Init")
"""ZeRO stages; "3+Init" builds the model under zero.Init over the data-parallel group."""
REPLICAS = [[0, 1], [2, 3]]


class _Mpu:
    """A DeepSpeed/Megatron-style model-parallel unit: only the data-parallel getters."""

    def __init__(self, group: Any, ranks: list[int]) -> None:
        self.group, self.ranks = group, ranks

    def get_data_parallel_group(self) -> Any:
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return len(self.ranks)

    def get_data_parallel_rank(self) -> int:
        return self.ranks.index(comm.get_rank())


def _config(stage: int | str) -> dict:
    zero: dict[str, Any] = {"stage": 3 if stage == "3+Init" else stage, "reduce_bucket_size": 3000}
    if zero["stage"] == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    return base_config(MICRO, 1, zero_optimization=zero)


def _engine(stage: int | str, mpu: Any) -> Any:
    config = _config(stage)
    if stage == "3+Init":
        group = None if mpu is None else mpu.get_data_parallel_group()
        with partita.zero.Init(data_parallel_group=group, config_dict_or_path=config):
            model = make_model()
    else:
        model = make_model()
    return partita.initialize(model=model, config=config, mpu=mpu)[0]


def _train(
    stage: int | str, seed: int, dp_rank: int, dp_world: int, mpu: Any, ckpt: str
) -> dict[str, Any]:
    """Trains on data `seed`; with the split world saves a checkpoint into `ckpt` and loads it
    into a fresh engine, with the plain world (afterwards) loads the split world's."""
    comm.COUNTERS.begin_step()  # the previous run's last gathers are not this run's traffic
    engine = _engine(stage, mpu)
    losses, comm_bytes = [], []
    for batch in global_batches(STEPS, MICRO * dp_world, seed=seed):
        loss = engine(*rank_micro_batch(batch, dp_rank, dp_world, MICRO, 0))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        comm_bytes.append(engine.last_step_comm_bytes)
    out = {
        "losses": losses,
        "params": _full_params(engine),
        "comm": comm_bytes,
        "dims": (engine.dp_world_size, engine.dims.dp_rank, engine.dims.dp_world_size),
    }
    tag = f"stage{stage}".replace("+", "_")
    if mpu is not None:
        engine.save_checkpoint(ckpt, tag=tag)
    engine.destroy()
    engine = _engine(stage, mpu)
    engine.load_checkpoint(ckpt, tag=tag)
    out["loaded"] = _full_params(engine)
    engine.destroy()
    return out


def replicas_worker(ckpt: str) -> list[dict[str, Any]]:
    """Every rank makes both groups (new_group is collective), trains in its own replica on
    that replica's data (seed 1 + replica index)."""
    rank = comm.get_rank()
    groups = [comm.new_group(ranks) for ranks in REPLICAS]
    replica = next(i for i, ranks in enumerate(REPLICAS) if rank in ranks)
    ranks = REPLICAS[replica]
    mpu = _Mpu(groups[replica], ranks)
    return [_train(s, 1 + replica, ranks.index(rank), len(ranks), mpu, ckpt) for s in STAGES]


def plain_worker(ckpt: str) -> list[list[dict[str, Any]]]:
    """The two replicas' runs, one after the other, on a plain two-rank world."""
    rank, world = comm.get_rank(), comm.get_world_size()
    return [[_train(s, 1 + replica, rank, world, None, ckpt) for s in STAGES] for replica in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    """The split four-rank run (saving its checkpoints), then the plain two-rank runs (loading
    them): one spawn each, shared by the tests below."""
    ckpt = str(tmp_path_factory.mktemp("replica-checkpoints"))
    split = run_distributed(replicas_worker, 4, ckpt, timeout=400)
    plain = run_distributed(plain_worker, 2, ckpt, timeout=400)
    return split, plain


@pytest.mark.parity
def test_two_replicas_match_their_own_two_rank_runs(runs: tuple[list, list]) -> None:
    split, plain = runs
    for replica, ranks in enumerate(REPLICAS):
        for dp_rank, rank in enumerate(ranks):
            for si, stage in enumerate(STAGES):
                got, want = split[rank][si], plain[dp_rank][replica][si]
                where = f"stage {stage}, replica {replica}, rank {rank}"
                assert got["dims"] == (2, dp_rank, 2), where
                assert got["losses"] == want["losses"], where
                for a, b in zip(got["params"], want["params"], strict=True):
                    assert torch.equal(a, b), where
                assert got["comm"] == want["comm"], where
                assert any(got["comm"]), where  # something was moved and counted
    # Different data per replica: the replicas really trained apart.
    assert split[0][0]["losses"] != split[2][0]["losses"]


@pytest.mark.parity
def test_checkpoint_of_replicas_is_the_first_replicas(runs: tuple[list, list]) -> None:
    """Only the replica holding rank 0 writes; every replica, and a plain two-rank world,
    loads exactly its weights (see [Note: checkpoints of replicas])."""
    split, plain = runs
    for si, stage in enumerate(STAGES):
        first = split[0][si]["params"]
        assert not all(
            torch.equal(a, b) for a, b in zip(first, split[2][si]["params"], strict=True)
        ), stage
        loaded = [split[r][si]["loaded"] for r in range(4)]
        loaded += [plain[r][replica][si]["loaded"] for r in (0, 1) for replica in (0, 1)]
        for got in loaded:
            for a, b in zip(got, first, strict=True):
                assert torch.equal(a, b), f"stage {stage}"


def test_mpu_without_data_parallel_getters_is_refused() -> None:
    with pytest.raises(TypeError, match="get_data_parallel_rank"):
        comm.ParallelDims.from_mpu(type("Mpu", (), {"get_data_parallel_group": None})())


def bad_groups_worker() -> list[str]:
    """Two mistakes, each caught on every rank before ZeRO's first collective."""
    rank = comm.get_rank()
    errors = []
    world_group = comm.new_group([0, 1])
    liar = _Mpu(world_group, [0, 1])
    liar.get_data_parallel_rank = lambda: 1 - rank  # type: ignore[method-assign]
    try:
        partita.initialize(model=make_model(), config=_config(1), mpu=liar)
    except ValueError as e:
        errors.append(str(e))
    # Rank 0 says its group is both ranks, rank 1 that it is alone: not a split into replicas.
    alone = [comm.new_group([0]), comm.new_group([1])][rank]
    mixed = _Mpu(world_group, [0, 1]) if rank == 0 else _Mpu(alone, [1])
    try:
        partita.initialize(model=make_model(), config=_config(1), mpu=mixed)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_inconsistent_mpu_fails_every_rank_naming_it() -> None:
    for rank, errors in enumerate(run_distributed(bad_groups_worker, 2, timeout=120)):
        assert len(errors) == 2, errors
        assert f"rank {rank}: mpu.get_data_parallel_world_size()=2 and " in errors[0]
        assert f"get_data_parallel_rank()={1 - rank}" in errors[0]
        assert "rank 0 says its group is [0, 1]" in errors[1]
