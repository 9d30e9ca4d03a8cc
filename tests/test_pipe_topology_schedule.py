"""DeepSpeed's pipeline topology and schedules (partita.parallel.topology / pipe_schedule, and
their ``deepspeed.runtime.pipe`` names): rank layouts, group lists and instruction sequences
worked out by hand, sends paired with receives, and the grid's groups on 4 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from partita.parallel.pipe_schedule import (
    BackwardPass,
    BufferOpInstruction,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)
from partita.parallel.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    default_topology,
    prime_factors,
)
from partita.testing import run_distributed

# ---- topology ----


def test_pipe_data_layout_is_row_major_data_fastest() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.axes == ["pipe", "data"] and topo.world_size() == 6
    assert [tuple(topo.get_coord(r)) for r in range(6)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)
    ]  # fmt: skip
    assert topo.get_coord(4).pipe == 1 and topo.get_coord(4).data == 1
    assert topo.get_rank(pipe=1, data=2) == 5
    assert topo.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    assert topo.get_axis_comm_lists("model") == []
    assert topo.get_axis_list("data", 2) == [2, 5]
    assert topo.filter_match(pipe=1) == [3, 4, 5]
    assert topo.filter_match(pipe=0, data=1) == [1]
    assert topo.get_dim("data") == 3 and topo.get_dim("model") == 0


def test_pipe_model_data_takes_arguments_in_another_order_than_its_axes() -> None:
    topo = PipeModelDataParallelTopology(num_pp=3, num_mp=2, num_dp=1)
    assert topo.axes == ["pipe", "data", "model"] and topo.dims == [3, 1, 2]
    assert topo.get_rank(pipe=2, data=0, model=1) == 5
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 2, 4], [1, 3, 5]]
    # Checkpoint names carry only the model slice by default.
    assert [topo.get_rank_repr(r) for r in (0, 3)] == ["model_00", "model_01"]
    assert topo.get_rank_repr(3, omit_axes=[]) == "pipe_01-data_00-model_01"
    assert topo.get_rank_repr(3, omit_axes=["data"], inner_sep=":", outer_sep="/") == (
        "pipe:01/model:01"
    )


def test_four_axes_comm_lists_vary_the_other_axes_row_major() -> None:
    topo = ProcessTopology(axes=["a", "b", "c"], dims=[2, 3, 2])
    # Strides 6, 2, 1: lines along b at (a, c) = (0,0), (0,1), (1,0), (1,1).
    assert topo.get_axis_comm_lists("b") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert topo.filter_match(b=2, c=1) == [5, 11]
    assert str(ProcessTopology(["x"], [2])) == "{ProcessCoord(x=0): 0, ProcessCoord(x=1): 1}"


def test_topology_refuses_what_it_cannot_place() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    with pytest.raises(ValueError, match="filter_match"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="outside the topology"):
        topo.get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match="rank 4 not found"):
        topo.get_coord(4)
    with pytest.raises(ValueError, match="'model' is not in"):
        topo.filter_match(model=0)
    with pytest.raises(ValueError, match="2 axes"):
        ProcessTopology(["pipe", "data"], [2])


def test_prime_factors_and_the_default_split() -> None:
    assert prime_factors(1) == [] and prime_factors(12) == [2, 2, 3]
    assert prime_factors(97) == [97] and prime_factors(360) == [2, 2, 2, 3, 3, 5]
    with pytest.raises(ValueError):
        prime_factors(0)
    # Factors, smallest first, alternate pipe, data, pipe, ...
    assert default_topology(12).dims == [6, 2]
    assert default_topology(8).dims == [4, 2]
    assert default_topology(7).dims == [7, 1]
    assert default_topology(1).dims == [1, 1]


# ---- instructions ----


def test_instructions_print_as_calls_and_compare_by_value() -> None:
    assert repr(ForwardPass(3)) == "ForwardPass(buffer_id=3)"
    assert repr(OptimizerStep()) == "OptimizerStep()"
    fwd = ForwardPass(buffer_id=1)
    assert fwd.buffer_id == 1 and fwd.name == "ForwardPass" and fwd.kwargs == {"buffer_id": 1}
    assert fwd == ForwardPass(1) and hash(fwd) == hash(ForwardPass(1))
    assert fwd != ForwardPass(2) and fwd != BackwardPass(1)
    assert isinstance(fwd, BufferOpInstruction) and not isinstance(
        ReduceGrads(), BufferOpInstruction
    )


# ---- schedules, by hand ----


def _steps(schedule: PipeSchedule) -> list[list[PipeInstruction]]:
    return [list(step) for step in schedule]


STEP_END = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def test_train_schedule_two_stages_two_micro_batches() -> None:
    # Stage s runs forward at step t when t - s is even (micro-batch (t - s) / 2), else
    # backward (micro-batch (t + s + 1) / 2 - stages); 2 * (2 + 2 - 1) = 6 steps.
    first = TrainSchedule(micro_batches=2, stages=2, stage_id=0)
    assert first.num_pipe_buffers() == 2
    assert _steps(first) == [
        [LoadMicroBatch(0), ForwardPass(0)],
        [SendActivation(0)],
        [LoadMicroBatch(1), ForwardPass(1)],
        [RecvGrad(0), SendActivation(1), BackwardPass(0)],
        [],
        [RecvGrad(1), BackwardPass(1), *STEP_END],
    ]
    last = TrainSchedule(micro_batches=2, stages=2, stage_id=1)
    assert last.num_pipe_buffers() == 2
    assert _steps(last) == [
        [],
        [RecvActivation(0), LoadMicroBatch(0), ForwardPass(0)],
        [BackwardPass(0)],
        [SendGrad(0), RecvActivation(1), LoadMicroBatch(1), ForwardPass(1)],
        [BackwardPass(1)],
        [SendGrad(1), *STEP_END],
    ]


def test_train_schedule_middle_stage_neither_loads_nor_owns_the_ends() -> None:
    middle = TrainSchedule(micro_batches=3, stages=3, stage_id=1)
    assert middle.num_pipe_buffers() == 2  # stages - stage_id in flight
    steps = _steps(middle)
    assert len(steps) == 2 * (3 + 3 - 1)
    assert steps[0] == [] and steps[1] == [RecvActivation(0), ForwardPass(0)]
    # Step 2 is a bubble backward that still passes micro-batch 0's activation on.
    assert steps[2] == [SendActivation(0)] and steps[3] == [RecvActivation(1), ForwardPass(1)]
    # Step 4: backward of micro-batch (4 + 2) / 2 - 3 = 0, the previous step forwarded mb 1.
    assert steps[4] == [RecvGrad(0), SendActivation(1), BackwardPass(0)]
    flat = [i for step in steps for i in step]
    assert not any(isinstance(i, LoadMicroBatch) for i in flat)
    # Micro-batch 2 reuses buffer 0 (round-robin over 2 buffers).
    assert flat.count(ForwardPass(0)) == 2 and flat.count(BackwardPass(0)) == 2


def test_inference_schedule_two_stages_alternates_two_buffers() -> None:
    first = InferenceSchedule(micro_batches=2, stages=2, stage_id=0)
    assert first.num_pipe_buffers() == 2
    assert _steps(first) == [
        [LoadMicroBatch(0), ForwardPass(0)],
        [LoadMicroBatch(1), SendActivation(0), ForwardPass(1)],
        [SendActivation(1)],
    ]
    # The last stage loads too (labels); odd stages receive before they send.
    assert _steps(InferenceSchedule(micro_batches=2, stages=2, stage_id=1)) == [
        [],
        [LoadMicroBatch(0), RecvActivation(0), ForwardPass(0)],
        [LoadMicroBatch(1), RecvActivation(1), ForwardPass(1)],
    ]
    middle = _steps(InferenceSchedule(micro_batches=2, stages=3, stage_id=1))
    assert middle[1] == [RecvActivation(0), ForwardPass(0)]
    assert middle[2] == [RecvActivation(1), SendActivation(0), ForwardPass(1)]


def test_data_parallel_schedule_accumulates_then_steps() -> None:
    sched = DataParallelSchedule(micro_batches=2, stages=1, stage_id=0)
    one = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
    assert _steps(sched) == [one, [*one, ReduceGrads(), OptimizerStep()]]
    assert sched.num_pipe_buffers() == 1


def test_schedule_queries_and_iterating_twice() -> None:
    sched = TrainSchedule(micro_batches=4, stages=3, stage_id=2)
    assert (sched.stage, sched.num_stages, sched.num_micro_batches) == (2, 3, 4)
    assert (sched.prev_stage, sched.next_stage) == (1, 3)
    assert sched.is_last_stage and not sched.is_first_stage
    assert _steps(sched) == _steps(sched)
    with pytest.raises(ValueError, match="micro-batch 4"):
        sched._buffer_idx(4)


# ---- schedules, properties over many shapes ----

SHAPES = [(m, s) for s in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 7)]


def _by_step(sched_cls: type[PipeSchedule], m: int, s: int) -> list[list[list[PipeInstruction]]]:
    return [_steps(sched_cls(micro_batches=m, stages=s, stage_id=i)) for i in range(s)]


@pytest.mark.parametrize(("micro_batches", "stages"), SHAPES)
def test_train_sends_meet_receives_in_the_same_step(micro_batches: int, stages: int) -> None:
    """Every activation stage i sends at step t, stage i+1 receives at step t (and gradients
    the other way), so blocking pairs line up; each stage forwards and back-propagates every
    micro-batch once, forward first, and ends with exactly one optimizer step."""
    plans = _by_step(TrainSchedule, micro_batches, stages)
    assert all(len(p) == 2 * (micro_batches + stages - 1) for p in plans)

    def count(stage: int, step: int, kind: type) -> int:
        return sum(isinstance(i, kind) for i in plans[stage][step])

    for t in range(len(plans[0])):
        for i in range(stages - 1):
            assert count(i, t, SendActivation) == count(i + 1, t, RecvActivation)
            assert count(i + 1, t, SendGrad) == count(i, t, RecvGrad)
    for i, plan in enumerate(plans):
        sched = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=i)
        order = [
            type(x) for step in plan for x in step if isinstance(x, ForwardPass | BackwardPass)
        ]
        assert order.count(ForwardPass) == order.count(BackwardPass) == micro_batches
        # In flight: forwards minus backwards never exceeds the buffers.
        depth = peak = 0
        for kind in order:
            depth += 1 if kind is ForwardPass else -1
            assert depth >= 0
            peak = max(peak, depth)
        assert peak <= sched.num_pipe_buffers()
        assert plan[-1][-3:] == STEP_END and sum(x == OptimizerStep() for s in plan for x in s) == 1


@pytest.mark.parametrize(("micro_batches", "stages"), SHAPES)
def test_inference_sends_meet_receives_in_the_same_buffer_order(
    micro_batches: int, stages: int
) -> None:
    plans = _by_step(InferenceSchedule, micro_batches, stages)
    assert all(len(p) == micro_batches + stages - 1 for p in plans)
    for t in range(len(plans[0])):
        for i in range(stages - 1):
            sent = [x for x in plans[i][t] if isinstance(x, SendActivation)]
            got = [x for x in plans[i + 1][t] if isinstance(x, RecvActivation)]
            assert len(sent) == len(got)
    for plan in plans:
        assert sum(isinstance(x, ForwardPass) for s in plan for x in s) == micro_batches


# ---- the deepspeed names ----


def test_deepspeed_modules_are_partitas() -> None:
    from partita.compat.deepspeed._missing import NotInPartita
    from partita.compat.deepspeed.runtime import pipe
    from partita.compat.deepspeed.runtime.pipe import schedule, topology

    assert schedule.TrainSchedule is TrainSchedule and schedule.SendGrad is SendGrad
    assert topology.ProcessTopology is ProcessTopology is pipe.ProcessTopology
    assert topology._prime_factors(6) == [2, 3]
    with pytest.raises(NotInPartita, match="pipeline parallelism"):
        schedule.DualPipeVSchedule  # noqa: B018


# ---- the grid on 4 ranks ----


def _grid_worker(_: Any) -> dict[str, Any]:
    from partita import comm
    from partita.comm import ParallelDims
    from partita.parallel.topology import PipelineParallelGrid

    def summed(group: Any) -> int:
        t = torch.tensor([comm.get_rank()])
        comm.all_reduce(t, group=group)
        return int(t.item())

    out: dict[str, Any] = {}
    grid = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=2))
    out["pd"] = {
        "stage": grid.get_stage_id(),
        "dp_rank": grid.get_data_parallel_rank(),
        "dp_group": grid.dp_group,
        "pp_group": grid.pp_group,
        "dp_sum": summed(grid.get_data_parallel_group()),
        "pp_sum": summed(grid.get_pipe_parallel_group()),
        "model": (grid.get_model_parallel_rank(), grid.get_model_parallel_world_size()),
        "model_sum": summed(grid.get_model_parallel_group()),
        "slice": (grid.slice_group, grid.get_slice_parallel_rank()),
        "ends": (grid.is_first_stage, grid.is_last_stage),
        "p2p": grid.p2p_groups,
        "stage_to_global": [grid.stage_to_global(0), grid.stage_to_global(1, data=1)],
        "mpu_dp": ParallelDims.from_mpu(grid).dp_ranks,
    }
    grid = PipelineParallelGrid(
        topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    )
    out["pmd"] = {
        "slice": (grid.slice_group, grid.get_slice_parallel_rank()),
        "slice_sum": summed(grid.get_slice_parallel_group()),
        "dp_group": grid.dp_group,
        "pp_group": grid.pp_group,
        "mp_world": grid.get_model_parallel_world_size(),
        "tp": grid.get_tensor_model_parallel_world_size(),
    }
    default = PipelineParallelGrid()
    out["default"] = default.topology().dims
    try:
        PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=3, num_dp=1))
    except ValueError as err:
        out["refused"] = str(err)
    return out


def test_grid_makes_each_axis_groups_on_four_gloo_ranks() -> None:
    ranks = run_distributed(_grid_worker, 4, None, timeout=60)
    # pipe x data = 2 x 2: rank = 2 * stage + data index.
    for rank, r in enumerate(ranks):
        pd = r["pd"]
        stage, data = divmod(rank, 2)
        assert (pd["stage"], pd["dp_rank"]) == (stage, data)
        assert pd["dp_group"] == [2 * stage, 2 * stage + 1]
        assert pd["pp_group"] == [data, data + 2]
        assert pd["dp_sum"] == sum(pd["dp_group"]) and pd["pp_sum"] == sum(pd["pp_group"])
        # DeepSpeed's "model parallel" group: every rank of this data index.
        assert pd["model"] == (stage, 2) and pd["model_sum"] == data + data + 2
        assert pd["slice"] == ([rank], 0)
        assert pd["ends"] == (stage == 0, stage == 1)
        assert pd["p2p"] == [[0, 2], [1, 3], [2, 0], [3, 1]]
        assert pd["stage_to_global"] == [data, 3]
        assert pd["mpu_dp"] == tuple(pd["dp_group"])
        # pipe x data x model = 2 x 1 x 2: rank = 2 * stage + slice.
        pmd = r["pmd"]
        assert pmd["slice"] == ([2 * stage, 2 * stage + 1], data)
        assert pmd["slice_sum"] == 4 * stage + 1
        assert pmd["dp_group"] == [rank] and pmd["pp_group"] == [data, data + 2]
        assert pmd["mp_world"] == 4 and pmd["tp"] == 2
        assert r["default"] == [2, 2]
        assert "holds 3 ranks but the job has 4" in r["refused"]
