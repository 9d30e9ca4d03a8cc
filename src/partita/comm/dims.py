"""The parallel dimensions of a job: which ranks ZeRO shards and reduces over.

[Note: parallel dimensions]
ZeRO runs over a data-parallel group, not over "the world". `ParallelDims`, built once when the
engine is created, holds that group with this rank's place in it; whatever communicates gets
it (or its group) and names the group in every collective, and shards by data-parallel rank.
Without a model-parallel unit the data-parallel group is the world (``dp_group`` None). With
one (DeepSpeed's ``mpu``), the world is cut into replicas: data-parallel groups of equal size
that train side by side and never exchange data with each other. When the mpu also splits the
model over tensor-parallel ranks (Megatron's ``get_tensor_model_parallel_*``), its tensor
group is kept too: each replica is then one tensor group's worth of ranks, holding different
slices of one model, and whatever sums over the whole model (the gradient norm, the overflow
check) sums over the data-parallel group and then over the tensor group. Sequence groups are
further fields of the same object ([Note: sequence parallelism]).

[Note: hybrid sharding]
Hybrid sharding (FSDP2's HSDP, DeepSpeed's MiCS, ``zero_optimization.mics_shard_size``) cuts
the data-parallel world into a 2-D mesh of named dimensions ("dp_replicate", "dp_shard"),
torch's `DeviceMesh` of shape (world // shard, shard): consecutive ranks form a shard group
(ranks 0,1 | 2,3 for 4 ranks and shard 2, so a shard group can sit inside one node), and the
ranks at the same place of every shard group form a replicate group (0,2 | 1,3). ZeRO cuts its
shards over the shard group and all-gathers parameters there (`zero_group`); each gradient
shard is then all-reduced over the replicate group, whose ranks hold the same shard. Data is
still split over the whole data-parallel group (``dp_group``: every rank reads its own
micro-batch, losses and gradients average over all of them), so the numbers trained are those
of plain ZeRO over the world; only which ranks hold which state, and which links carry how
many bytes, change.

[Note: sequence parallelism]
Ulysses sequence parallelism (``sequence_parallel_size`` = sp, DeepSpeed's mesh
("data_parallel", "sequence_parallel")) cuts the world into sequence groups of sp consecutive
ranks (0,1 | 2,3 for 4 ranks and sp 2) and data-parallel groups of the ranks at the same place
of every sequence group (0,2 | 1,3). The ranks of one sequence group read the same batch, each
its slice of the sequence, and exchange activations (all-to-all, `partita.parallel.ulysses`);
the parameters are the same on every rank. So, as in DeepSpeed, ZeRO shards and reduces over
the sequence-data-parallel group (``seq_dp_group``: every rank holding the same parameters,
the world without tensor parallelism). The batch arithmetic and the data loader count
data-parallel ranks (world / sp).

The average: the gradients are summed over that group and divided by its size (dp x sp),
unlike DeepSpeed, which divides by dp only. Both loss conventions in use then train as one
process on the whole batch: a rank's loss is the mean over its slice (Megatron-DeepSpeed's
scripts; the group's mean of the slices' means is the sequence's mean when the slices count
alike), or it is the whole sequence's loss, gathered with a differentiable all-gather
(Transformers' Trainer), whose backward hands each rank sp times its slice's share. Dividing
by dp only would leave both sp times too large, which DeepSpeed does (its issue 5248: SGD and
gradient clipping see it; Adam mostly hides it). `partita.parallel.ulysses.sequence_loss` is
the second convention.
[Note: expert parallelism]
Mixture-of-experts layers (``deepspeed.moe.layer.MoE(ep_size=E)``, `partita.moe`) cut the
data-parallel world into expert-parallel groups of E consecutive ranks (0,1 | 2,3 for 4 ranks
and E 2), whose ranks hold different experts and exchange tokens by all-to-all, and
expert-data-parallel groups of the ranks at the same place of every expert group (0,2 | 1,3),
which hold the same experts. DeepSpeed lays its groups out the same way. Dense parameters are
reduced and sharded over the data-parallel group as ever; expert parameters are summed and
sharded over the expert-data-parallel group, and divided by the data-parallel size (as
DeepSpeed does): each expert's gradient then is that of the mean of every rank's loss, the
number one process computes on the whole batch. Each element of the model lives on exactly one
expert-parallel rank of each expert-data-parallel place, so a sum of squares over the whole
data-parallel group counts every expert element once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from partita.comm.collectives import all_gather_object
from partita.comm.counters import name_group
from partita.comm.process_group import (
    ProcessGroup,
    get_rank,
    get_world_size,
    is_initialized,
    new_group,
)


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the job's parallel dimensions (see [Note: parallel dimensions])."""

    rank: int
    """Global rank (in the default group)."""
    world_size: int
    """Ranks in the job."""
    dp_group: ProcessGroup | None
    """The data-parallel group; None means the default group (every rank)."""
    dp_ranks: tuple[int, ...]
    """Global ranks of the data-parallel group, in data-parallel rank order."""
    tp_group: ProcessGroup | None = None
    """The tensor-parallel group (inference, or training with an mpu that splits the model);
    None with `tp_ranks` empty: no tensor parallelism, None with `tp_ranks` the world: the
    default group."""
    tp_ranks: tuple[int, ...] = ()
    """Global ranks of the tensor-parallel group, in tensor-parallel rank order."""
    shard_group: ProcessGroup | None = None
    """Hybrid sharding: the ranks ZeRO cuts its shards over ([Note: hybrid sharding]); None
    with `shard_ranks` empty: not hybrid (ZeRO shards over the data-parallel group)."""
    shard_ranks: tuple[int, ...] = ()
    """Global ranks of the shard group, in shard-rank order (empty: not hybrid)."""
    replicate_group: ProcessGroup | None = None
    """Hybrid sharding: the ranks holding the same shard as this one."""
    replicate_ranks: tuple[int, ...] = ()
    """Global ranks of the replicate group, in replica order (empty: not hybrid)."""
    sp_group: ProcessGroup | None = None
    """The sequence-parallel group ([Note: sequence parallelism]); None with `sp_ranks` empty:
    no sequence parallelism, None with `sp_ranks` the world: the default group."""
    sp_ranks: tuple[int, ...] = ()
    """Global ranks of the sequence-parallel group, in sequence-rank order."""
    seq_dp_group: ProcessGroup | None = None
    """Sequence parallelism: the ranks holding the same parameters (data-parallel x sequence
    groups), which ZeRO shards and reduces over; None: the default group."""
    seq_dp_ranks: tuple[int, ...] = ()
    """Global ranks of the sequence-data-parallel group (empty: no sequence parallelism)."""
    ep_group: ProcessGroup | None = None
    """Expert parallelism ([Note: expert parallelism]): the ranks holding different experts,
    which exchange tokens; meaningful only when `ep_ranks` is not empty."""
    ep_ranks: tuple[int, ...] = ()
    """Global ranks of the expert-parallel group (empty: the job has no expert layers)."""
    edp_group: ProcessGroup | None = None
    """The ranks holding the same experts (expert-data-parallel group)."""
    edp_ranks: tuple[int, ...] = ()
    """Global ranks of the expert-data-parallel group (empty: no expert layers)."""
    pp_group: ProcessGroup | None = None
    """The pipeline's stages holding this rank's data-parallel index (a pipeline's mpu); None
    with `pp_ranks` empty: no pipeline."""
    pp_ranks: tuple[int, ...] = ()
    """Global ranks of the pipeline group, in stage order (empty: no pipeline)."""
    mesh: Any = dataclasses.field(default=None, compare=False)
    """The dimensions above as one torch `DeviceMesh` ([Note: the job's mesh] in
    `partita.comm.mesh`), set by `initialize` once the groups exist; None before, or without
    a process group."""

    @property
    def hybrid(self) -> bool:
        """True when ZeRO shards inside a shard group and replicates across groups."""
        return bool(self.shard_ranks)

    @property
    def zero_group(self) -> ProcessGroup | None:
        """The group ZeRO shards over and gathers parameters in: the shard group when hybrid,
        the sequence-data-parallel group under sequence parallelism, else the data-parallel
        group."""
        return self.shard_group if self.hybrid else self.grad_group

    @property
    def zero_world_size(self) -> int:
        """Ranks one shard is cut over (the shard size when hybrid)."""
        return len(self.shard_ranks) if self.hybrid else len(self.grad_ranks)

    @property
    def grad_group(self) -> ProcessGroup | None:
        """The ranks holding the same parameters, whose gradients are summed: the
        sequence-data-parallel group under sequence parallelism, else the data-parallel
        group."""
        return self.seq_dp_group if self.seq_dp_ranks else self.dp_group

    @property
    def grad_ranks(self) -> tuple[int, ...]:
        """Global ranks of `grad_group`, in its rank order."""
        return self.seq_dp_ranks or self.dp_ranks

    @property
    def ep_world_size(self) -> int:
        """Ranks the experts of a layer are split across (1 without expert parallelism)."""
        return len(self.ep_ranks) or 1

    @property
    def ep_rank(self) -> int:
        """Rank within the expert-parallel group (0 without one)."""
        return self.ep_ranks.index(self.rank) if self.ep_ranks else 0

    @property
    def edp_world_size(self) -> int:
        """Ranks holding the same experts (the data-parallel size without expert layers)."""
        return len(self.edp_ranks) or len(self.grad_ranks)

    def with_experts(self, ep_size: int) -> ParallelDims:
        """These dims with expert-parallel groups of `ep_size` consecutive data-parallel ranks
        and the expert-data-parallel groups across them ([Note: expert parallelism]).
        `check_expert_parallel_size` first, so a bad size raises before any collective;
        collective over the world (every rank makes every group, in the same order)."""
        # Under sequence parallelism every rank holds the dense parameters (the
        # sequence-data-parallel group is the world), and the experts split over it as over
        # plain data parallelism: a token goes to its expert wherever its sequence slice is.
        sequence = bool(self.seq_dp_ranks)
        check_expert_parallel_size(ep_size, len(self.grad_ranks))
        if (self.dp_group is not None and not sequence) or self.hybrid:
            raise ValueError(
                f"expert parallelism (ep_size {ep_size}) is supported by partita over plain "
                "data parallelism or sequence parallelism only, not yet with tensor "
                "parallelism, an mpu or zero_optimization.mics_shard_size"
            )
        world, rank = self.world_size, self.rank
        ep = edp = None
        for start in range(0, world, ep_size):
            made = new_group(list(range(start, start + ep_size)))
            ep = made if start <= rank < start + ep_size else ep
        for place in range(ep_size):
            made = new_group(list(range(place, world, ep_size)))
            edp = made if place == rank % ep_size else edp
        name_group(ep, "ep")
        name_group(edp, "edp")
        first = rank - rank % ep_size
        return dataclasses.replace(
            self,
            ep_group=ep,
            ep_ranks=tuple(range(first, first + ep_size)),
            edp_group=edp,
            edp_ranks=tuple(range(rank % ep_size, world, ep_size)),
        )

    @property
    def sp_rank(self) -> int:
        """Rank within the sequence-parallel group (0 without sequence parallelism)."""
        return self.sp_ranks.index(self.rank) if self.sp_ranks else 0

    @property
    def sp_world_size(self) -> int:
        """Ranks one sequence is split across (1 without sequence parallelism)."""
        return len(self.sp_ranks) or 1

    @property
    def replicate_world_size(self) -> int:
        """Ranks holding each shard (1 unless hybrid)."""
        return len(self.replicate_ranks) or 1

    @property
    def tp_rank(self) -> int:
        """Rank within the tensor-parallel group (0 without tensor parallelism)."""
        return self.tp_ranks.index(self.rank) if self.tp_ranks else 0

    @property
    def tp_world_size(self) -> int:
        """Ranks one model is split across (1 without tensor parallelism)."""
        return len(self.tp_ranks) or 1

    @property
    def dp_rank(self) -> int:
        """Rank within the data-parallel group (what ZeRO shards by)."""
        return self.dp_ranks.index(self.rank)

    @property
    def dp_world_size(self) -> int:
        """Ranks in the data-parallel group (what ZeRO shards over, and averages by)."""
        return len(self.dp_ranks)

    @property
    def replicas(self) -> int:
        """Data-parallel groups side by side (1 when the group is the world)."""
        return self.world_size // self.dp_world_size

    @property
    def first_replica(self) -> bool:
        """True on the ranks of the data-parallel group holding global rank 0 (the replica
        whose ranks write checkpoints)."""
        return 0 in self.dp_ranks

    def dp_global_rank(self, dp_rank: int) -> int:
        """Global rank of data-parallel rank `dp_rank` (collectives name sources globally)."""
        return self.dp_ranks[dp_rank]

    def check_replicas(self) -> None:
        """Raises on every rank unless the ranks' data-parallel groups cut the world into
        disjoint replicas of equal size (collective over the world: every rank calls it)."""
        if self.replicas == 1 and self.dp_group is None:
            return
        seen = all_gather_object(self.dp_ranks, group=None)  # every rank of the job
        problems = [
            f"rank {r} says its group is {list(ranks)}"
            for r, ranks in enumerate(seen)
            if any(seen[m] != ranks for m in ranks) or len(ranks) != self.dp_world_size
        ]
        if problems:
            raise ValueError(
                "the data-parallel groups must split the world into disjoint replicas of "
                f"equal size: {'; '.join(problems[:4])}"
            )

    @classmethod
    def world(cls) -> ParallelDims:
        """Data parallelism over every rank (also a single process without a process group)."""
        world = get_world_size()
        return cls(get_rank(), world, None, tuple(range(world)))

    @classmethod
    def from_group(cls, group: ProcessGroup | None) -> ParallelDims:
        """Data parallelism over `group` (None: the world). Every rank must be in its group."""
        if group is None or not is_initialized():
            return cls.world()
        rank, world = get_rank(), get_world_size()
        ranks = tuple(dist.get_process_group_ranks(group))
        if rank not in ranks:
            raise ValueError(
                f"rank {rank}: the data-parallel group {list(ranks)} does not contain this rank"
            )
        if world % len(ranks):
            raise ValueError(
                f"rank {rank}: the data-parallel group has {len(ranks)} ranks, which does not "
                f"divide the world size {world} into equal replicas"
            )
        # Group ranks in group order: dp rank i is global rank ranks[i].
        ordered = tuple(dist.get_global_rank(group, i) for i in range(len(ranks)))
        return cls(rank, world, group, ordered)

    @classmethod
    def hybrid_shard(cls, shard_size: int) -> ParallelDims:
        """Data parallelism over every rank with ZeRO's shards cut over groups of `shard_size`
        consecutive ranks and replicated across them ([Note: hybrid sharding]). Collective
        over the world (every rank calls it); `check_shard_size` first, so a bad size raises
        before any collective."""
        rank, world = get_rank(), get_world_size()
        check_shard_size(shard_size, world)
        from torch.distributed.device_mesh import init_device_mesh

        backend = dist.get_backend()
        device = "cpu" if backend == "gloo" else "cuda"
        names = ("dp_replicate", "dp_shard")
        mesh = init_device_mesh(device, (world // shard_size, shard_size), mesh_dim_names=names)
        shard_group, replicate_group = mesh.get_group("dp_shard"), mesh.get_group("dp_replicate")
        name_group(shard_group, "dp_shard")
        name_group(replicate_group, "dp_replicate")
        first = rank - rank % shard_size
        return cls(
            rank,
            world,
            None,
            tuple(range(world)),
            shard_group=shard_group,
            shard_ranks=tuple(range(first, first + shard_size)),
            replicate_group=replicate_group,
            replicate_ranks=tuple(range(rank % shard_size, world, shard_size)),
        )

    @classmethod
    def tensor_parallel(cls, tp_size: int) -> ParallelDims:
        """Tensor parallelism over blocks of `tp_size` consecutive ranks; the ranks holding
        the same slice in each block form the data-parallel groups (replicas of the model).
        Collective over the world when groups must be made (every rank calls it)."""
        rank, world = get_rank(), get_world_size()
        if tp_size < 1 or world % tp_size:
            raise ValueError(
                f"rank {rank}: tensor-parallel size {tp_size} does not divide the world size "
                f"{world}"
            )
        if tp_size == 1:
            return cls.world()
        (tp_group, tp_ranks), (dp_group, dp_ranks) = _blocks_and_lanes(tp_size)
        return cls(rank, world, dp_group, dp_ranks, tp_group, tp_ranks)

    @classmethod
    def sequence_parallel(cls, sp_size: int) -> ParallelDims:
        """Sequence parallelism over blocks of `sp_size` consecutive ranks; the ranks at the
        same place of each block form the data-parallel groups, and ZeRO runs over the world
        ([Note: sequence parallelism]). `check_sequence_parallel_size` first, so a bad size
        raises on every rank before any collective; collective over the world when groups
        must be made (every rank calls it)."""
        rank, world = get_rank(), get_world_size()
        check_sequence_parallel_size(sp_size, world)
        if sp_size == 1:
            return cls.world()
        (sp_group, sp_ranks), (dp_group, dp_ranks) = _blocks_and_lanes(sp_size)
        if sp_group is None:  # the world: a group of its own, for what asks for the group
            sp_group = new_group(list(range(world)))
        name_group(sp_group, "sp")
        return cls(
            rank,
            world,
            dp_group,
            dp_ranks,
            sp_group=sp_group,
            sp_ranks=sp_ranks,
            seq_dp_group=None,
            seq_dp_ranks=tuple(range(world)),
        )

    @classmethod
    def from_mpu(cls, mpu: Any) -> ParallelDims:
        """From DeepSpeed's model-parallel unit: an object with ``get_data_parallel_group()``,
        ``get_data_parallel_world_size()`` and ``get_data_parallel_rank()`` (Megatron's
        ``parallel_state`` module is one), and optionally the tensor-parallel getters (see
        `_tensor_getters`). Raises, naming the getter, when they disagree."""
        if _sequence_size(mpu) > 1:
            if callable(getattr(mpu, "get_data_parallel_group", None)):
                raise ValueError(
                    "initialize(mpu=...): an mpu with both a data-parallel group and "
                    f"{_sequence_size(mpu)} sequence-parallel ranks (Megatron-DeepSpeed's) is "
                    "not supported by partita yet; pass DeepSpeed's parallel_state_sp or set "
                    "sequence_parallel_size in the config"
                )
            return cls._from_sequence_mpu(mpu)
        missing = [
            name
            for name in (
                "get_data_parallel_group",
                "get_data_parallel_world_size",
                "get_data_parallel_rank",
            )
            if not callable(getattr(mpu, name, None))
        ]
        if missing:
            raise TypeError(f"initialize(mpu=...): the object has no {', '.join(missing)}()")
        if not is_initialized():
            raise RuntimeError(
                "initialize(mpu=...) needs the process group that the mpu's groups belong to: "
                "call partita.init_distributed() and build the groups first"
            )
        dims = cls.from_group(mpu.get_data_parallel_group())
        size, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        if (size, rank) != (dims.dp_world_size, dims.dp_rank):
            raise ValueError(
                f"rank {dims.rank}: mpu.get_data_parallel_world_size()={size} and "
                f"get_data_parallel_rank()={rank}, but its group {list(dims.dp_ranks)} gives "
                f"{dims.dp_world_size} and {dims.dp_rank}"
            )
        return dims._with_tensor_group(mpu)._with_pipe_group(mpu)

    @classmethod
    def _from_sequence_mpu(cls, mpu: Any) -> ParallelDims:
        """From a Ulysses mpu (DeepSpeed's ``parallel_state_sp``, which ALST's
        ``register_with_transformers`` returns): its sequence group, its
        sequence-data-parallel group (which must be the world: partita has no model
        parallelism to combine with it) and, built here, the data-parallel groups of the ranks
        at the same place of every sequence group. Collective over the world."""
        if not is_initialized():
            raise RuntimeError(
                "initialize(mpu=...) needs the process group that the mpu's groups belong to"
            )
        rank, world = get_rank(), get_world_size()
        group = mpu.get_sequence_parallel_group()
        sp_ranks = _group_ranks(group, world)
        size = int(mpu.get_sequence_parallel_world_size())
        if size != len(sp_ranks) or rank not in sp_ranks:
            raise ValueError(
                f"rank {rank}: mpu.get_sequence_parallel_world_size()={size}, but its group is "
                f"{list(sp_ranks)}"
            )
        check_sequence_parallel_size(size, world)
        seq_dp = getattr(mpu, "get_sequence_data_parallel_group", None)
        if callable(seq_dp) and _group_ranks(seq_dp(), world) != tuple(range(world)):
            raise ValueError(
                f"rank {rank}: mpu.get_sequence_data_parallel_group() must span the "
                f"{world} ranks (partita combines sequence parallelism with data parallelism "
                "only)"
            )
        every = all_gather_object(sp_ranks, group=None)  # every rank's sequence group
        if sorted(r for g in set(every) for r in g) != list(range(world)):
            raise ValueError(
                f"rank {rank}: the mpu's sequence groups {sorted(set(every))} must split the "
                f"{world} ranks into disjoint groups of {size}"
            )
        place = sp_ranks.index(rank)
        dp_group = None
        for lane in range(size):  # new_group is collective: same groups, same order everywhere
            ranks = sorted({g[lane] for g in every})
            made = new_group(ranks)
            dp_group = made if lane == place else dp_group
        dp_ranks = tuple(sorted({g[place] for g in every}))
        name_group(group, "sp")
        return cls(
            rank,
            world,
            dp_group,
            dp_ranks,
            sp_group=group,
            sp_ranks=sp_ranks,
            seq_dp_group=None,
            seq_dp_ranks=tuple(range(world)),
        )

    def _with_pipe_group(self, mpu: Any) -> ParallelDims:
        """These dims with the mpu's pipeline group (a pipeline's grid: DeepSpeed's
        ``get_pipe_parallel_*``), when it has more than one stage; otherwise unchanged."""
        size = getattr(mpu, "get_pipe_parallel_world_size", None)
        if not callable(size) or int(size()) == 1:
            return self
        group = mpu.get_pipe_parallel_group()
        n = len(dist.get_process_group_ranks(group))
        ranks = tuple(dist.get_global_rank(group, i) for i in range(n))
        return dataclasses.replace(self, pp_group=group, pp_ranks=ranks)

    def _with_tensor_group(self, mpu: Any) -> ParallelDims:
        """These dims with the mpu's tensor-parallel group, if it splits the model (more than
        one tensor rank); otherwise unchanged."""
        prefix = _tensor_getters(mpu)
        if prefix is None or int(getattr(mpu, f"{prefix}_world_size")()) == 1:
            return self
        size, rank = getattr(mpu, f"{prefix}_world_size")(), getattr(mpu, f"{prefix}_rank")()
        group = getattr(mpu, f"{prefix}_group")()
        if group is None:  # DeepSpeed's convention: None is the default group
            ranks = tuple(range(self.world_size))
        else:
            n = len(dist.get_process_group_ranks(group))
            ranks = tuple(dist.get_global_rank(group, i) for i in range(n))
        where = f"rank {self.rank}: mpu.{prefix}"
        if (size, rank) != (len(ranks), ranks.index(self.rank) if self.rank in ranks else None):
            raise ValueError(
                f"{where}_world_size()={size} and {prefix}_rank()={rank}, but its group "
                f"{list(ranks)} does not agree"
            )
        # The tensor, data-parallel and (a pipeline grid's) pipe groups must cover the job,
        # or the norm would miss pieces of the model.
        stages = getattr(mpu, "get_pipe_parallel_world_size", None)
        pipes = int(stages()) if callable(stages) else 1
        if (
            set(ranks) & set(self.dp_ranks) != {self.rank}
            or size * self.dp_world_size * (pipes) != self.world_size
        ):
            raise ValueError(
                f"{where}_group() {list(ranks)} and the data-parallel group "
                f"{list(self.dp_ranks)} must cross in this rank only and, with {pipes} "
                f"pipeline stage(s), cover the {self.world_size} ranks"
            )
        return dataclasses.replace(self, tp_group=group, tp_ranks=ranks)


_JOB: list[ParallelDims] = []
"""The dimensions `initialize` built last (what DeepSpeed's ``groups`` getters read)."""


def set_job_dims(dims: ParallelDims) -> None:
    """Records `dims` as the job's (called once per `partita.initialize`)."""
    _JOB[:] = [dims]


def job_dims() -> ParallelDims | None:
    """The dimensions the last `partita.initialize` built (None before any)."""
    return _JOB[0] if _JOB else None


def _blocks_and_lanes(
    size: int,
) -> tuple[
    tuple[ProcessGroup | None, tuple[int, ...]], tuple[ProcessGroup | None, tuple[int, ...]]
]:
    """This rank's block of `size` consecutive ranks and its lane (the ranks at the same place
    of every block), each as ``(group, global ranks)``; a group that spans the world is None
    (the default group). A lane of one rank (size == world) is a group of that rank alone.
    Collective over the world when groups must be made: every rank makes every group, in the
    same order (new_group is collective)."""
    rank, world = get_rank(), get_world_size()
    first = rank - rank % size
    block_ranks = tuple(range(first, first + size))
    lane_ranks = tuple(range(rank % size, world, size))
    block = lane = None
    if 1 < size < world:
        for start in range(0, world, size):
            made = new_group(list(range(start, start + size)))
            block = made if start == first else block
        for place in range(size):
            made = new_group(list(range(place, world, size)))
            lane = made if place == rank % size else lane
    elif size == world > 1:
        # Each lane is one rank: no traffic exists along it, so its group is the rank itself.
        for r in range(world):
            made = new_group([r])
            lane = made if r == rank else lane
    return (block, block_ranks), (lane, lane_ranks)


def node_block_group(size: int, name: str) -> tuple[ProcessGroup | None, tuple[int, ...]]:
    """This rank's block of `size` consecutive ranks of the world (a node's ranks when `size`
    is the ranks per node) as ``(group, global ranks)``, its collectives counted under `name`
    (ZeRO++ hpZ's secondary partition group, ``"hpz"``). Collective over the world: every
    rank makes every block's group, in the same order. `size` must divide the world (checked
    by the caller before any collective, naming its key)."""
    rank, world = get_rank(), get_world_size()
    first = rank - rank % size
    mine: ProcessGroup | None = None
    if is_initialized():
        for start in range(0, world, size):
            made = new_group(list(range(start, start + size)))
            mine = made if start == first else mine
        name_group(mine, name)
    return mine, tuple(range(first, first + size))


def node_lane_group(size: int, name: str) -> tuple[ProcessGroup | None, tuple[int, ...]]:
    """The ranks at this rank's place in every block of `size` consecutive ranks (one rank per
    node when `size` is the ranks per node: the inter-node hop of ZeRO++'s quantized gradient
    reduction) as ``(group, global ranks)``, counted under `name`. Collective over the world,
    like `node_block_group`; `size` must divide the world."""
    rank, world = get_rank(), get_world_size()
    mine: ProcessGroup | None = None
    if is_initialized():
        for place in range(size):
            made = new_group(list(range(place, world, size)))
            mine = made if place == rank % size else mine
        name_group(mine, name)
    return mine, tuple(range(rank % size, world, size))


def check_sequence_parallel_size(sp_size: int, world: int) -> None:
    """Raises ValueError naming ``sequence_parallel_size`` unless `sp_size` is a positive
    divisor of the `world` (no collective: every rank raises alike)."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int):
        raise ValueError(f"sequence_parallel_size: {sp_size!r} must be an integer")
    if sp_size < 1 or sp_size > world or world % sp_size:
        raise ValueError(
            f"sequence_parallel_size: {sp_size} must be a positive divisor of the world size "
            f"{world} (sequence groups of equal size)"
        )


def check_expert_parallel_size(ep_size: int, world: int) -> None:
    """Raises ValueError naming ``ep_size`` unless `ep_size` is a positive divisor of the
    data-parallel `world` (no collective: every rank raises alike)."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size: {ep_size!r} must be a positive integer")
    if ep_size > world or world % ep_size:
        raise ValueError(
            f"ep_size: {ep_size} must divide the data-parallel world size {world} "
            "(expert-parallel groups of equal size)"
        )


def check_shard_size(shard_size: int, world: int) -> None:
    """Raises ValueError naming ``zero_optimization.mics_shard_size`` unless `shard_size`
    divides the data-parallel `world` (no collective: every rank raises alike)."""
    if shard_size < 1 or shard_size > world or world % shard_size:
        raise ValueError(
            f"zero_optimization.mics_shard_size: {shard_size} must be a positive divisor of "
            f"the data-parallel world size {world} (shard groups of equal size)"
        )


def _sequence_size(mpu: Any) -> int:
    """The sequence-parallel size an mpu reports (1 without the getters): DeepSpeed's
    ``parallel_state_sp`` has them (and aliases its ``get_model_parallel_*`` to them)."""
    getters = ("get_sequence_parallel_group", "get_sequence_parallel_world_size")
    if not all(callable(getattr(mpu, g, None)) for g in getters):
        return 1
    return int(mpu.get_sequence_parallel_world_size())


def _group_ranks(group: ProcessGroup | None, world: int) -> tuple[int, ...]:
    """Global ranks of `group` in its rank order (None: the world)."""
    if group is None:
        return tuple(range(world))
    n = len(dist.get_process_group_ranks(group))
    return tuple(dist.get_global_rank(group, i) for i in range(n))


_TENSOR_GETTERS = ("get_tensor_model_parallel", "get_slice_parallel", "get_model_parallel")
"""Where an mpu says how the model is split over ranks, most specific first: Megatron's
``parallel_state``, DeepSpeed's ``PipelineParallelGrid`` (its tensor slices), and the older
mpu interface DeepSpeed itself reads (``get_model_parallel_*``)."""


def _tensor_getters(mpu: Any) -> str | None:
    """The first prefix of `_TENSOR_GETTERS` for which the mpu has ``_group``,
    ``_world_size`` and ``_rank``; None when it has none (data parallelism only)."""
    for prefix in _TENSOR_GETTERS:
        if all(
            callable(getattr(mpu, f"{prefix}_{s}", None)) for s in ("group", "world_size", "rank")
        ):
            return prefix
    return None


__all__ = [
    "ParallelDims",
    "check_expert_parallel_size",
    "check_sequence_parallel_size",
    "check_shard_size",
    "job_dims",
    "node_block_group",
    "node_lane_group",
    "set_job_dims",
]
