"""`initialize()` and the other top-level entry points a DeepSpeed script calls."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from partita import comm
from partita.comm import mesh as comm_mesh
from partita.comm.dims import set_job_dims
from partita.config import ConfigError, DeepSpeedConfig, config_error, load_config
from partita.config.ranks import flatten, ranks_differ
from partita.data import DistributedDataLoader
from partita.engine import Engine
from partita.engine import experts as engine_experts
from partita.engine import setup as engine_setup
from partita.engine import tensor_parallel as engine_tensor
from partita.platform import cluster_env, env


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's command-line arguments: ``--deepspeed [CONFIG]`` and
    ``--deepspeed_config CONFIG`` (``--deepscale*`` kept as hidden aliases)."""
    group = parser.add_argument_group("partita", "partita / DeepSpeed configuration")
    group.add_argument(
        "--deepspeed",
        nargs="?",
        const=True,
        default=False,
        help="enable partita; optionally followed by the config file (as in Hugging Face scripts)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed JSON/hjson config"
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise config_error("", "pass the config as either config= or config_params=, not both")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(
            args, "deepscale_config", None
        )
        flag = getattr(args, "deepspeed", None)
        if from_args is None and isinstance(flag, str):
            from_args = flag
    if config is not None and from_args is not None:
        raise config_error(
            "",
            f"a config was given both in the arguments ({from_args}) and to initialize(config=...); keep one",
        )
    source = config if config is not None else from_args
    if source is None:
        raise config_error(
            "", "no config: pass initialize(config=dict or path) or --deepspeed_config PATH"
        )
    return source


def _world_size(dims: comm.ParallelDims | None) -> int:
    """Data-parallel world size (the batch arithmetic's), known before any collective runs."""
    if dims is not None:
        return dims.dp_world_size
    if comm.is_initialized():
        return comm.get_world_size()
    return cluster_env.detect().world_size


def _job_world() -> int:
    """Ranks in the job (every dimension), known before any collective runs."""
    return comm.get_world_size() if comm.is_initialized() else cluster_env.detect().world_size


def _check_same_config_on_every_rank(cfg: DeepSpeedConfig) -> None:
    """Raises on every rank when the ranks' configs differ, naming the keys and the ranks'
    values. Among the first collectives of `initialize`, so nothing has yet been built on a config
    that other ranks do not share."""
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return
    problems = ranks_differ(comm.all_gather_object(flatten(cfg.to_dict()), group=None))
    if problems:
        raise ConfigError(problems)


def _engine_class(model: Any, mpu: Any) -> tuple[type[Engine], Any]:
    """The engine for `model` and the mpu it runs on: a `PipelineModule` gets the pipeline
    engine and its own grid as the mpu (DeepSpeed refuses another mpu beside it)."""
    from partita.parallel.pipe_module import PipelineModule

    if not isinstance(model, PipelineModule):
        return Engine, mpu
    if mpu is not None and mpu is not model.mpu():
        raise ValueError("initialize(mpu=...) must be None with a PipelineModule (it is its own)")
    from partita.parallel.pipe_engine import PipelineEngine

    return PipelineEngine, model.mpu()


def _job_dims(from_mpu: comm.ParallelDims | None, shard: int | None, sp: int) -> comm.ParallelDims:
    """The job's parallel dimensions, once the process group is up (building groups is
    collective): sequence groups, else hybrid shard groups (the two are refused together
    before), else the mpu's, else data parallelism over the world."""
    if sp > 1:
        return comm.ParallelDims.sequence_parallel(sp)
    if shard is not None:
        return comm.ParallelDims.hybrid_shard(shard)
    return from_mpu or comm.ParallelDims.world()


@dataclass(frozen=True)
class _Job:
    """What `initialize` decides before any collective: the validated config and the sizes of
    the job's parallel dimensions."""

    config: DeepSpeedConfig
    sp: int
    """Ulysses sequence-parallel size (1: off)."""
    tp: int
    """AutoTP tensor-parallel size (1: off)."""
    ep: int | None
    """MoE expert-parallel size (None: no MoE layers)."""
    shard: int | None
    """Hybrid sharding's shard group size (None: off)."""


def _plan_job(model: Any, source: Any, mpu: Any, dims: comm.ParallelDims | None) -> _Job:
    """Reads and checks the config against the model, the mpu and the world, on every rank
    alike, before any collective (a bad value fails every rank at once, naming its key)."""
    # Ranks of one sequence group read one batch: the batch arithmetic counts world / sp.
    sp = engine_setup.sequence_parallel_size(source, mpu, _world_size(dims))
    # Not so the ranks of one tensor slice: DeepSpeed's AutoTP batch arithmetic counts them
    # (its config sees the world), and Accelerate and the Trainer fill "auto" batch sizes so.
    tp = engine_tensor.autotp_size(source, _job_world())
    cfg: DeepSpeedConfig = (
        source
        if isinstance(source, DeepSpeedConfig)
        else load_config(source, world_size=_world_size(dims) // sp)
    )
    engine_setup.check_supported(cfg)
    engine_setup.check_sequence_parallel(
        cfg, None if mpu else _world_size(dims), None if dims is None else dims.dp_world_size
    )
    shard = engine_setup.hybrid_shard_size(cfg, mpu, _world_size(dims))
    rank = comm.get_rank() if comm.is_initialized() else cluster_env.detect().rank
    engine_setup.check_offload_paths(cfg, model, rank, _world_size(dims))
    engine_tensor.check_tensor_parallel(cfg, model, tp, _job_world(), sp, mpu)
    cfg = engine_tensor.with_autotp(cfg, tp)  # tp_model_init's size, as DeepSpeed merges it
    engine_experts.apply_autoep(model, cfg, rank)  # Hugging Face experts split in place
    holders = _job_world() if sp > 1 else _world_size(dims)  # ranks holding dense parameters
    ep = engine_experts.expert_parallel_size(model, cfg, holders, mpu)
    return _Job(cfg, sp, tp, ep, shard)


def _build_dims(model: Any, job: _Job, dims: comm.ParallelDims | None) -> comm.ParallelDims:
    """The job's groups, once the process group is up (collective), recorded as the job's and
    checked to be replicas of one shape."""
    if job.tp > 1:  # the tensor groups (or the mpu's): ZeRO runs over each slice's lane
        dims = engine_tensor.tensor_dims(job.tp, dims)
    dims = engine_experts.with_expert_groups(model, _job_dims(dims, job.shard, job.sp), job.ep)
    dims = dataclasses.replace(dims, mesh=comm_mesh.job_mesh(dims))  # collective
    set_job_dims(dims)
    dims.check_replicas()  # before the config check: mixed groups make the batch sizes differ
    return dims


def _training_loader(
    data: Any, cfg: DeepSpeedConfig, dims: comm.ParallelDims, collate_fn: Any
) -> DistributedDataLoader:
    """``initialize(training_data=...)``'s loader, split by data-parallel rank: the same rank
    of every replica reads the same samples (model-parallel peers work on one batch)."""
    return DistributedDataLoader(
        data,
        batch_size=cfg.train_micro_batch_size_per_gpu,
        rank=dims.dp_rank,
        world_size=dims.dp_world_size,
        collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
        seed=env.data_seed(),
    )


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[Engine, Any, DistributedDataLoader | None, Any]:
    """Wraps `model` for distributed training; returns ``(engine, optimizer, dataloader,
    lr_scheduler)`` like ``deepspeed.initialize``.

    The config is validated on every rank before any process group or collective exists, so a
    bad config fails fast with the offending key instead of hanging the job. `mpu`, DeepSpeed's
    model-parallel unit (``get_data_parallel_group/_world_size/_rank``), makes ZeRO run over its
    data-parallel group (see `partita.comm.ParallelDims`); without it, over every rank.
    `mesh_param`, DeepSpeed's ``(data_parallel_size, sequence_parallel_size)`` or a torch
    `DeviceMesh` with named dimensions, sets the sizes the config would (`partita.comm.mesh`);
    ``engine.mesh_device`` is the job's layout as a `DeviceMesh`.
    """
    if model is None:
        raise ValueError("initialize() needs model=")
    engine_class, mpu = _engine_class(model, mpu)
    # The mpu's groups exist already, so its dimensions are known before the config is read
    # (the batch arithmetic counts data-parallel ranks, not the world).
    dims = None if mpu is None else comm.ParallelDims.from_mpu(mpu)
    source = _config_source(args, config, config_params)
    if mesh_param is not None:  # [Note: the job's mesh] in partita.comm.mesh
        if mpu is not None:
            raise ValueError("initialize(): pass mesh_param= or mpu=, not both")
        source = comm_mesh.merge_mesh_sizes(source, comm_mesh.mesh_sizes(mesh_param, _job_world()))
    if engine_class is not Engine:  # the pipeline engine reads the config's "pipeline" section
        from partita.parallel.pipe_engine import take_pipeline_section

        source = take_pipeline_section(source, model)
    job = _plan_job(model, source, mpu, dims)  # every check, before any collective
    cfg = job.config
    if dist_init_required is not False:
        comm.init_distributed(distributed_port=distributed_port)
    dims = _build_dims(model, job, dims)
    _check_same_config_on_every_rank(cfg)
    if job.tp > 1:  # AutoTP splits the model; an mpu's tensor group alone means it is split
        engine_tensor.parallelize_model(model, dims)  # before the engine broadcasts over dp
    engine_tensor.clear_recorded()  # tp_model_init's arguments were this job's
    engine = engine_class(
        model,
        cfg,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        dims=dims,
    )
    loader = None
    if training_data is not None:
        loader = _training_loader(training_data, cfg, dims, collate_fn)
        engine.training_dataloader = loader
    # An engine built without an optimizer returns None in its place, as DeepSpeed does.
    optimizer_out = (
        None if isinstance(engine.optimizer, engine_setup.NoOptimizer) else engine.optimizer
    )
    return engine, optimizer_out, loader, engine.lr_scheduler


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed's ``deepspeed.init_distributed``: see `partita.comm.init_distributed`."""
    comm.init_distributed(*args, **kwargs)
