"""Named process grids: where each rank sits on the pipeline, data and model axes.

[Note: process topology]
A topology lays the ranks of a job out on a grid of named axes (``pipe``, ``data``, ``model``,
or any names). The layout is row-major in the order the axes are given: the last axis varies
fastest, so with axes ``("pipe", "data")`` and dims ``(2, 3)`` ranks 0, 1, 2 are pipeline stage
0 at data indices 0, 1, 2 and ranks 3, 4, 5 are stage 1. Everything here is arithmetic on that
layout (coordinates, the ranks along one axis, the ranks matching a partial coordinate), with no
process group, so it can be tested and reasoned about without processes.

`PipelineParallelGrid` is the one part that communicates: given a topology it makes the process
groups a pipeline-parallel run needs (one per line of ranks along each axis) and answers the
model-parallel-unit questions DeepSpeed's engine and Megatron-style code ask (``mpu``:
``get_data_parallel_group()``, ``get_pipe_parallel_rank()``...). It is the object DeepSpeed
builds for a ``PipelineModule``; partita exposes it under DeepSpeed's names in
``deepspeed.runtime.pipe.topology``.

Behaviour follows DeepSpeed's ``deepspeed/runtime/pipe/topology.py`` (0.19.8): same rank layout,
same group lists and their order, same ``get_rank_repr`` strings (checkpoint file names depend on
them), same default split of a world into pipeline x data when no topology is given.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import namedtuple
from collections.abc import Iterable, Sequence
from typing import Any, cast

from partita import comm
from partita.comm import ProcessGroup

logger = logging.getLogger(__name__)

PIPE, DATA, MODEL = "pipe", "data", "model"


class ProcessTopology:
    """Maps coordinates on named axes to linear ranks, row-major in the order of `axes`
    (see [Note: process topology]).

    ``ProcessCoord`` is a namedtuple class with one field per axis; `get_coord` returns one and
    ``mapping`` holds every coordinate with its rank, in rank order.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names repeat: {axes}")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dims}")
        self.axes = axes
        self.dims = dims
        # A namedtuple class made at run time (its fields are the axes): Any to the checker.
        self.ProcessCoord: Any = cast(Any, namedtuple)("ProcessCoord", axes)
        # Row-major strides: moving one step along axis i moves the rank by _strides[i].
        self._strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
        self.mapping: dict[Any, int] = {
            self.ProcessCoord(*coord): rank
            for rank, coord in enumerate(itertools.product(*(range(d) for d in dims)))
        }

    def _axis_index(self, axis: str) -> int:
        try:
            return self.axes.index(axis)
        except ValueError:
            raise ValueError(f"axis {axis!r} is not in the topology's axes {self.axes}") from None

    def get_rank(self, **coord: int) -> int:
        """The rank at a full coordinate, every axis named: ``get_rank(pipe=1, data=0)``."""
        if set(coord) != set(self.axes):
            raise ValueError(
                f"get_rank() needs exactly the axes {self.axes}, got {sorted(coord)} "
                "(use filter_match() for a partial coordinate)"
            )
        rank = 0
        for axis, dim, stride in zip(self.axes, self.dims, self._strides, strict=True):
            value = coord[axis]
            if not 0 <= value < dim:
                raise ValueError(f"coordinate {coord} is outside the topology: {axis} < {dim}")
            rank += value * stride
        return rank

    def get_axis_names(self) -> list[str]:
        """The axis names, in layout order."""
        return self.axes

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Iterable[str] = (DATA, PIPE),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """`rank`'s coordinate as text, e.g. ``"model_01"`` (axis, `inner_sep`, two-digit
        index; axes joined by `outer_sep`), leaving out `omit_axes` (by default ``data`` and
        ``pipe``: checkpoint file names carry only the model-parallel slice)."""
        omitted = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}"
            for axis in self.axes
            if axis not in omitted
        )

    def get_dim(self, axis: str) -> int:
        """How many ranks lie along `axis` (0 when the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """`rank`'s coordinate, a ``ProcessCoord`` whose fields are the axes
        (``topo.get_coord(3).pipe``)."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} not found in topology of {self.world_size()} ranks")
        return self.ProcessCoord(
            *((rank // stride) % dim for dim, stride in zip(self.dims, self._strides, strict=True))
        )

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The lines of ranks along `axis`: one list per coordinate of the other axes (those
        taken in layout order, row-major), each list in increasing `axis` index. These are the
        communicator groups of that axis. An unknown axis gives ``[]`` (so code written for
        pipeline x data x model also runs on a topology without one of them)."""
        if axis not in self.axes:
            return []
        i = self._axis_index(axis)
        others = [range(d) for j, d in enumerate(self.dims) if j != i]
        lines = []
        for rest in itertools.product(*others):
            base = sum(
                value * stride
                for value, stride in zip(
                    rest, self._strides[:i] + self._strides[i + 1 :], strict=True
                )
            )
            lines.append([base + k * self._strides[i] for k in range(self.dims[i])])
        return lines

    def filter_match(self, **criteria: int) -> list[int]:
        """The ranks, in increasing order, whose coordinate matches every ``axis=index`` given
        (``filter_match(pipe=0)``: the ranks of stage 0)."""
        for axis in criteria:
            self._axis_index(axis)
        return [
            rank
            for coord, rank in self.mapping.items()
            if all(getattr(coord, axis) == value for axis, value in criteria.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks, in increasing order, whose `axis` coordinate is `idx`."""
        i = self._axis_index(axis)
        return [rank for coord, rank in self.mapping.items() if coord[i] == idx]

    def world_size(self) -> int:
        """How many ranks the topology holds (the product of its dims)."""
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"


def prime_factors(n: int) -> list[int]:
    """`n`'s prime factors in increasing order, with repeats (``12 -> [2, 2, 3]``; 1 -> [])."""
    if n <= 0:
        raise ValueError(f"prime factors need a positive integer, got {n}")
    factors = []
    candidate = 2
    while n > 1:
        if candidate * candidate > n:  # what is left is prime
            factors.append(n)
            break
        while n % candidate == 0:
            factors.append(candidate)
            n //= candidate
        candidate += 1
    return factors


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data: axes ``("pipe", "data")``. Data is the fast axis, so a stage's
    data-parallel replicas are neighbouring ranks (often one node) and their gradient
    reductions stay on the fast links; the lighter pipeline traffic crosses nodes."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=[PIPE, DATA], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor slicing): axes ``("pipe", "data", "model")``, model the
    fastest. Note the argument order (pipe, model, data) differs from the axis order."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=[PIPE, DATA, MODEL], dims=[num_pp, num_dp, num_mp])


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """The pipeline x data split DeepSpeed picks for `world_size` ranks when given none: the
    prime factors, smallest first, go alternately to pipe and data (12 = 2*2*3: pipe 2*3 = 6,
    data 2)."""
    factors = prime_factors(world_size)
    return PipeDataParallelTopology(
        num_pp=math.prod(factors[0::2]), num_dp=math.prod(factors[1::2])
    )


class PipelineParallelGrid:
    """This rank's place in a pipeline x data (x model) topology, with the process groups of
    each axis: DeepSpeed's model-parallel unit for pipeline runs (see [Note: process topology]).

    Collective: every rank of the job must construct it, with the same topology; the groups are
    made with ``new_group`` on every rank in one fixed order (the "model" groups, then data,
    then pipe, then slice), as DeepSpeed makes them. The topology must hold exactly the world's
    ranks. `process_group`, when given, must span the whole job (DeepSpeed passes its world
    group; the grid always lays out the world).

    Group names follow DeepSpeed: the *data-parallel* group holds the ranks of this stage (and
    model slice) across pipelines; the *pipe* group the stages of this pipeline; the *model*
    group (``get_model_parallel_group``) every rank of this data-parallel index, all stages and
    slices, which DeepSpeed uses for overflow checks and norms; the *slice* group the tensor
    (``model`` axis) slices of this stage.
    """

    def __init__(
        self, topology: ProcessTopology | None = None, process_group: ProcessGroup | None = None
    ) -> None:
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        if process_group is not None and comm.get_world_size(process_group) != self.world_size:
            raise ValueError(
                "PipelineParallelGrid lays out every rank of the job: process_group has "
                f"{comm.get_world_size(process_group)} ranks, the job {self.world_size}"
            )
        if topology is None:
            topology = default_topology(self.world_size)
        elif self.global_rank == 0:
            logger.info("Using topology: %s", topology)
        self._topo = topology
        self.data_parallel_size = max(topology.get_dim(DATA), 1)
        self.pipe_parallel_size = max(topology.get_dim(PIPE), 1)
        self.model_parallel_size = max(topology.get_dim(MODEL), 1)
        self.slice_parallel_size = self.model_parallel_size
        if not self._is_grid_valid():
            raise ValueError(
                f"the topology {topology!r} holds {topology.world_size()} ranks but the job has "
                f"{self.world_size}"
            )
        if PIPE not in topology.axes or DATA not in topology.axes:
            raise ValueError(
                f"a pipeline grid needs the axes {PIPE!r} and {DATA!r}: {topology.axes}"
            )
        me = topology.get_coord(self.global_rank)
        self.stage_id: int = me.pipe
        self.data_parallel_id: int = me.data
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

        # new_group is collective: every rank makes every group below, in this order.
        self.ds_model_proc_group, self.ds_model_rank, self.ds_model_world_size = None, -1, 0
        for dp in range(self.data_parallel_size):
            ranks = sorted(topology.get_axis_list(DATA, dp))
            group = comm.new_group(ranks)
            if self.global_rank in ranks:
                self.ds_model_proc_group = group
                self.ds_model_rank = ranks.index(self.global_rank)
                self.ds_model_world_size = len(ranks)

        self.dp_groups = topology.get_axis_comm_lists(DATA)
        self.dp_group, self.dp_proc_group = self._make_groups(self.dp_groups)

        self.p2p_groups = self._build_p2p_groups()

        self.pipe_groups = topology.get_axis_comm_lists(PIPE)
        self.pp_group, self.pp_proc_group = self._make_groups(self.pipe_groups)

        # Without a model axis each rank is its own slice (DeepSpeed makes these groups too).
        self.model_groups = (
            topology.get_axis_comm_lists(MODEL)
            if MODEL in topology.axes
            else [[r] for r in range(self.world_size)]
        )
        self.mp_group: list[int] = []
        self.slice_group, self.slice_proc_group = self._make_groups(self.model_groups)

    def _make_groups(self, lines: list[list[int]]) -> tuple[list[int], ProcessGroup]:
        """Makes one group per line (on every rank, in order); returns this rank's line and
        its group."""
        mine: tuple[list[int], ProcessGroup] | None = None
        for ranks in lines:
            group = comm.new_group(ranks)
            if self.global_rank in ranks:
                mine = (ranks, group)
        if mine is None:
            raise ValueError(f"rank {self.global_rank} is in none of the groups {lines}")
        return mine

    def _build_p2p_groups(self) -> list[list[int]]:
        """For every global rank, ``[rank, next]``: the rank of the next stage of its pipeline
        (the last stage wraps round to the first)."""
        nxt = {}
        for line in self._topo.get_axis_comm_lists(PIPE):
            for i, rank in enumerate(line):
                nxt[rank] = line[(i + 1) % len(line)]
        return [[rank, nxt[rank]] for rank in range(self.world_size)]

    def _is_grid_valid(self) -> bool:
        """Whether the topology holds exactly the job's ranks."""
        return self._topo.world_size() == comm.get_world_size()

    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return int(self._topo.get_coord(self.global_rank).pipe)

    def get_data_parallel_id(self) -> int:
        """Which pipeline (data-parallel index) this rank is in."""
        return int(self._topo.get_coord(self.global_rank).data)

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """The global rank of stage `stage_id` at this rank's other coordinates, or at those
        given (``stage_to_global(1, data=0)``)."""
        me = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **coords)
        return self._topo.get_rank(**me._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    # The model-parallel-unit (mpu) interface DeepSpeed and Megatron code call.
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        """This rank's stage."""
        return self.get_stage_id()

    def get_pipe_parallel_world_size(self) -> int:
        """Stages in the pipeline."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> ProcessGroup:
        """The stages of this rank's pipeline."""
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        """Which pipeline this rank is in."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """How many pipelines (data-parallel replicas)."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> ProcessGroup:
        """This stage's ranks across the pipelines (gradients are averaged over it)."""
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """Rank among every rank of this data-parallel index (all stages and slices)."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> ProcessGroup | None:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        """This rank's tensor slice (``model`` coordinate; 0 without a model axis)."""
        if MODEL not in self._topo.axes:
            return 0
        return int(self._topo.get_coord(self.global_rank).model)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> ProcessGroup:
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size


__all__ = [
    "DATA",
    "MODEL",
    "PIPE",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "default_topology",
    "prime_factors",
]
