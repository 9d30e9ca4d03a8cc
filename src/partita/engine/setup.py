"""Builds the engine's parts from the config: parameter groups, optimizer, scheduler, loss
scaler and the ZeRO strategy. Composition only; the algorithms live in `partita.zero`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from partita import comm
from partita.comm.dims import check_sequence_parallel_size
from partita.config import ConfigError, DeepSpeedConfig, Problem, config_error
from partita.config.reader import read_config_file
from partita.engine.experts import expert_family
from partita.offload import SwapSpace, ThreadPoolIO, check_offload_config, unique_run_id
from partita.offload.placement import OffloadPlacement, OptimizerPlacement, ParamPlacement
from partita.optim import OptimConfigError, build_optimizer, build_scheduler
from partita.optim.optimizers import check_optimizer_config
from partita.optim.schedulers import check_scheduler_config
from partita.precision import DynamicLossScaler, LossScaler, PrecisionPolicy, StaticLossScaler
from partita.zero.reduction import ReduceScaling
from partita.zero.shard_step import TensorParallelNorm
from partita.zero.sharded import Sharded
from partita.zero.stage0 import DataParallel
from partita.zero.stage3 import FullySharded, Stage3Settings
from partita.zero.stage3.gather import DEFAULT_BLOCK_SIZE
from partita.zero.stage3.nvme import optimizer_pipeline
from partita.zero.strategy import OptimizerFactory, ParamGroups, Strategy

logger = logging.getLogger("partita")

ClientOptimizer = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
ClientScheduler = Any  # an LR scheduler instance, or a callable taking the optimizer


def param_groups(
    module: torch.nn.Module, model_parameters: Iterable[Any] | None, client: ClientOptimizer = None
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups as dicts (hyperparameters and trainable ``params``).

    The groups come from a client optimizer instance when one is given, else from
    `model_parameters`: None (all of the module's parameters), an iterable of tensors, or an
    iterable of group dicts with per-group hyperparameters. Frozen parameters are left out. Every
    parameter must belong to `module`, and every trainable parameter of `module` must be in a
    group: the engine reduces and steps exactly the parameters it manages.
    """
    if isinstance(client, torch.optim.Optimizer):
        groups = list(client.param_groups)
    else:
        items = list(module.parameters() if model_parameters is None else model_parameters)
        groups = (
            [dict(g) for g in items]
            if items and isinstance(items[0], dict)
            else [{"params": items}]
        )
    names = {p: n for n, p in module.named_parameters()}
    covered: set[torch.nn.Parameter] = set()
    for gi, group in enumerate(groups):
        raw = group["params"]
        params = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        for p in params:
            if p not in names:
                raise ValueError(
                    f"optimizer parameter group {gi} holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model passed to initialize()"
                )
        group["params"] = [p for p in params if p.requires_grad]
        covered.update(group["params"])
    missing = [n for p, n in names.items() if p.requires_grad and p not in covered]
    if missing:
        raise ValueError(
            f"parameters {missing[:5]} require grad but are in no optimizer parameter group; "
            "pass them in model_parameters (or to the optimizer) or freeze them"
        )
    return [g for g in groups if g["params"]]


def optimizer_factory(
    config: DeepSpeedConfig,
    client: ClientOptimizer,
    groups: list[dict[str, Any]],
) -> OptimizerFactory:
    """How to build the optimizer once the strategy knows which tensors it steps per group."""
    if client is not None and config.optimizer is not None:
        raise config_error(
            "optimizer",
            "an optimizer was passed to initialize() and the config also has an 'optimizer' block; keep one",
        )

    def mapped(stepped: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
        return [{**g, "params": s} for g, s in zip(groups, stepped, strict=True)]

    if isinstance(client, torch.optim.Optimizer):
        instance = client

        def rewrite(stepped: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
            if instance.state:
                raise ValueError(
                    "the optimizer passed to initialize() already has state; pass a fresh one"
                )
            for group, tensors in zip(groups, stepped, strict=True):
                group["params"] = tensors
            instance.param_groups = list(groups)
            return instance

        return rewrite
    if client is not None:
        factory = client
        return lambda stepped: factory(mapped(stepped))
    opt = config.optimizer
    if opt is None:
        return lambda stepped: NoOptimizer(mapped(stepped))
    return lambda stepped: build_optimizer(opt.type, dict(opt.params), mapped(stepped))


class NoOptimizer(torch.optim.Optimizer):
    """The optimizer of an engine built without one (neither ``initialize(optimizer=...)`` nor
    an ``optimizer`` block): forward, evaluation and generation work (Hugging Face's eval-only
    ZeRO-3 Trainer builds such an engine), and an optimizer step says what is missing."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, {"lr": 0.0})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Refuses: there is nothing to step with."""
        raise RuntimeError(
            "this engine was built without an optimizer (evaluation only): pass "
            "initialize(optimizer=...) or add an 'optimizer' block to the config to train"
        )


def lr_scheduler(
    config: DeepSpeedConfig, client: ClientScheduler, optimizer: torch.optim.Optimizer
) -> Any:
    """The config's scheduler (it takes precedence, as in DeepSpeed), else the client's."""
    if isinstance(optimizer, NoOptimizer):
        return None  # nothing to schedule (DeepSpeed builds no scheduler without an optimizer)
    if config.scheduler is not None:
        return build_scheduler(config.scheduler.type, dict(config.scheduler.params), optimizer)
    if client is None or hasattr(client, "step"):
        return client
    return client(optimizer)


def loss_scaler(config: DeepSpeedConfig, policy: PrecisionPolicy) -> LossScaler:
    """Dynamic or static scaling for fp16; a unit static scale otherwise."""
    fp16 = config.fp16
    if not policy.uses_loss_scaling:
        return StaticLossScaler(1.0)
    if fp16.loss_scale > 0:
        return StaticLossScaler(float(fp16.loss_scale))
    return DynamicLossScaler(
        initial_scale_power=fp16.initial_scale_power,
        loss_scale_window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_loss_scale=fp16.min_loss_scale,
    )


def check_supported(config: DeepSpeedConfig) -> None:
    """Rejects valid DeepSpeed settings this version of partita does not implement yet, so a
    job fails at start-up, before any collective, instead of silently training differently."""
    zero = config.zero_optimization
    problems: list[Problem] = []
    opt = zero.offload_optimizer  # parameter offload below stage 3 is a config error (config/)
    if opt is not None and opt.device == "nvme" and zero.stage != 3:
        problems.append(
            Problem(
                "zero_optimization.offload_optimizer.device",
                f"'nvme' needs zero_optimization.stage 3 (got {zero.stage}); use 'cpu' for stages 1-2",
            )
        )
    for key, on in (
        ("fp16.fp16_master_weights_and_grads", config.fp16.fp16_master_weights_and_grads),
        ("bf16.bf16_master_weights_and_grads", config.bf16.bf16_master_weights_and_grads),
        ("bf16.bf16_optimizer_states", config.bf16.bf16_optimizer_states),
    ):
        if on:
            problems.append(
                Problem(key, "partita keeps fp32 master weights and optimizer states; use false")
            )
    if config.data_types.grad_accum_dtype is not None:
        problems.append(
            Problem(
                "data_types.grad_accum_dtype",
                "a separate accumulation dtype is not supported by partita; remove the key "
                "(stage 0 accumulates in the training dtype, ZeRO 1-2 gradient shards are fp32)",
            )
        )
    problems += _optim_problems(config)
    if problems:
        raise ConfigError(problems)


def _optim_problems(config: DeepSpeedConfig) -> list[Problem]:
    """The ``optimizer`` / ``scheduler`` checks that need torch (names of torch classes, their
    params) and so cannot run in ``partita.config``; run before the process group exists."""
    problems: list[Problem] = []
    sections = (
        (config.optimizer, check_optimizer_config),
        (config.scheduler, check_scheduler_config),
    )
    for section, check in sections:
        if section is None:
            continue
        try:
            check(section.type, dict(section.params))
        except OptimConfigError as error:
            key = error.key or ""
            problems.append(Problem(key, str(error).removeprefix(f"{key}: ")))
    return problems


def hybrid_shard_size(config: DeepSpeedConfig, mpu: Any, world: int) -> int | None:
    """The shard size of hybrid sharding (``zero_optimization.mics_shard_size``; None when off:
    -1 or absent), checked against the data-parallel `world` before any collective, so a bad
    size fails every rank alike ([Note: hybrid sharding] in `partita.comm.dims`)."""
    size = int(config.zero_optimization.mics_shard_size)
    if size == -1:
        return None
    key = "zero_optimization.mics_shard_size"
    if mpu is not None:
        raise config_error(
            key,
            f"{size}: hybrid sharding together with an mpu (model parallelism) is not "
            "supported by partita; use -1 or drop mpu=",
        )
    try:
        comm.check_shard_size(size, world)
    except ValueError as error:
        raise config_error(key, str(error).removeprefix(f"{key}: ")) from None
    return size


def sequence_parallel_size(source: Any, mpu: Any, world: int) -> int:
    """The Ulysses degree (``sequence_parallel_size``, 1 when absent) of the config `source`
    (a dict, a file path or a `DeepSpeedConfig`), read before the config is validated: the
    batch arithmetic counts data-parallel ranks, ``world / sp``. Checked against the `world`
    with the key named, before any collective, so a bad size fails every rank alike
    ([Note: sequence parallelism] in `partita.comm.dims`)."""
    key = "sequence_parallel_size"
    raw = _raw_value(source, key)
    if raw is None or raw == 1 or isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        return 1  # absent, off, or of the wrong type: validation names the last
    if mpu is not None:
        # The mpu's groups are the job's: a Ulysses mpu brings them (ParallelDims.from_mpu).
        mpu_sp = getattr(mpu, "get_sequence_parallel_world_size", None)
        if callable(mpu_sp) and int(mpu_sp()) == raw:
            return 1  # world is already the mpu's data-parallel size
        raise config_error(
            key,
            f"{raw}: sequence parallelism needs its groups from the config or from an mpu with "
            "the same sequence-parallel size (DeepSpeed's parallel_state_sp); this mpu has "
            f"{int(mpu_sp()) if callable(mpu_sp) else 'none'}",
        )
    try:
        check_sequence_parallel_size(raw, world)
    except ValueError as error:
        raise config_error(key, str(error).removeprefix(f"{key}: ")) from None
    return raw


def check_sequence_parallel(
    config: DeepSpeedConfig, world: int | None, mpu_dp: int | None = None
) -> None:
    """Refuses what partita does not compose with sequence parallelism yet, and a
    ``data_parallel_size`` (DeepSpeed's mesh with ``sequence_parallel_size``) other than the
    `world` over the sequence-parallel size, or (`world` None: the groups come from an mpu)
    than the mpu's data-parallel size `mpu_dp`, naming the keys."""
    size = int(config.sequence_parallel_size)
    dp = config.data_parallel_size
    if world is not None and dp is not None and world % size == 0 and dp != world // size:
        raise config_error(
            "data_parallel_size",
            f"{dp}: with {world} ranks and sequence_parallel_size {size} the data-parallel "
            f"size is {world // size}",
        )
    if world is None and dp is not None and mpu_dp is not None and dp != mpu_dp:
        raise config_error(
            "data_parallel_size",
            f"{dp}: the mpu's data-parallel group has {mpu_dp} ranks (config and mpu disagree)",
        )
    if size > 1 and int(config.zero_optimization.mics_shard_size) != -1:
        raise config_error(
            "sequence_parallel_size",
            f"{size}: sequence parallelism together with zero_optimization.mics_shard_size "
            "(hybrid sharding) is not supported by partita yet",
        )


def _raw_value(source: Any, key: str) -> Any:
    """`source`'s top-level `key` before validation (None when absent or unreadable: loading
    the config reports that)."""
    if isinstance(source, DeepSpeedConfig):
        return getattr(source, key)
    if isinstance(source, Mapping):
        return source.get(key)
    if isinstance(source, str | os.PathLike) and not str(source).lstrip().startswith("{"):
        try:
            return read_config_file(source).get(key)
        except (OSError, ValueError, ConfigError):
            return None
    return None


def precision_policy(config: DeepSpeedConfig) -> PrecisionPolicy:
    """Module, master and communication dtypes from the config."""
    return PrecisionPolicy.from_flags(
        config.fp16.enabled, config.bf16.enabled, config.communication_data_type
    )


def bucket_numel(zero: Any) -> int:
    """Gradient elements per reduction bucket: ``reduce_bucket_size``, whose schema default
    (4M elements, not DeepSpeed's 5e8; see `partita.config.ZeroConfig`) is the one in force."""
    return int(zero.reduce_bucket_size)


def swap_space(config: DeepSpeedConfig, block: str = "offload_optimizer") -> SwapSpace | None:
    """This rank's NVMe swap space when `block` (``offload_optimizer`` or ``offload_param``)
    offloads to NVMe."""
    offload = getattr(config.zero_optimization, block)
    if offload is None or offload.device != "nvme":
        return None
    run_id = unique_run_id("param" if block == "offload_param" else "optim")
    aio = ThreadPoolIO.from_config(config.aio)
    # Files are named by global rank: replicas on one node must not share swap files.
    return SwapSpace(str(offload.nvme_path), comm.get_rank(), aio=aio, run_id=run_id)


def check_offload_paths(
    config: DeepSpeedConfig, module: torch.nn.Module, rank: int, world: int
) -> None:
    """NVMe paths exist, are writable and have room for this rank's swap files (before any
    collective, so a bad path fails every rank at once instead of hanging some)."""
    zero = config.zero_optimization
    param = zero.offload_param if zero.stage == 3 else None  # ignored below stage 3 (rules)
    if not any(b is not None and b.device == "nvme" for b in (zero.offload_optimizer, param)):
        return
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    # fp32 master, gradient and two Adam moments per element of this rank's shard; the
    # module-dtype shard of every parameter
    need = {"offload_optimizer": 16 * -(-trainable // world), "offload_param": -(-total // world)}
    check_offload_config(zero, config.aio, rank, required_bytes=need)


def offload_placement(config: DeepSpeedConfig) -> OffloadPlacement:
    """Where masters with optimizer state, and stage-3 parameter shards, live: decided here,
    once, from the ``offload_optimizer`` and ``offload_param`` blocks (swap files opened)."""
    zero = config.zero_optimization
    # offload_param means nothing below stage 3, as in DeepSpeed (a warning says so at load).
    opt = zero.offload_optimizer
    param = zero.offload_param if zero.stage == 3 else None
    optimizer = OptimizerPlacement()
    if opt is not None and opt.device in ("cpu", "nvme"):
        nvme = opt.device == "nvme" and zero.stage == 3
        if opt.device == "nvme" and not nvme:
            logger.warning(
                "zero_optimization.offload_optimizer.device='nvme' swaps state to NVMe in stage 3 "
                "only (as in DeepSpeed); stage %d keeps it in host memory",
                zero.stage,
            )
        optimizer = OptimizerPlacement(
            where="nvme" if nvme else "host",
            pin_memory=bool(opt.pin_memory),
            swap=swap_space(config) if nvme else None,
            ratio=float(opt.ratio),
            pipeline=optimizer_pipeline(opt) if nvme else (False, False),
        )
    params = ParamPlacement()
    if param is not None and param.device in ("cpu", "nvme"):
        nvme = param.device == "nvme"
        params = ParamPlacement(
            where="nvme" if nvme else "host",
            pin_memory=bool(param.pin_memory),
            swap=swap_space(config, "offload_param"),
            # DeepSpeed ignores max_in_cpu, so a config written for it that leaves the key out
            # expects every shard on NVMe: 0 then.
            max_in_cpu=int(param.max_in_cpu) if "max_in_cpu" in param.model_fields_set else 0,
            read_ahead=(int(param.buffer_count), int(param.buffer_count) * int(param.buffer_size)),
        )
    return OffloadPlacement(optimizer, params)


def strategy(
    config: DeepSpeedConfig,
    module: torch.nn.Module,
    groups: ParamGroups,
    policy: PrecisionPolicy,
    make_optimizer: OptimizerFactory,
    dims: comm.ParallelDims,
) -> Strategy:
    """The ZeRO stage the config asks for, over the data-parallel group of `dims` (its norm
    also over the tensor group, when there is one)."""
    zero = config.zero_optimization
    # Hybrid sharding: shards over the shard group, gradient shards summed across replicas;
    # the average stays over every data-parallel rank ([Note: hybrid sharding]). Sequence
    # parallelism: shards and averages over every rank holding the parameters
    # ([Note: sequence parallelism]).
    group = dims.zero_group
    replicas = dims.replicate_group if dims.hybrid else None
    scaling = ReduceScaling(
        len(dims.grad_ranks),
        config.prescale_gradients,
        config.gradient_predivide_factor,
        average=config.gradient_allreduce_op == "mean",
    )
    tensor = tensor_parallel_norm(module, dims)
    experts = expert_family(module, dims)  # [Note: expert parallelism] in partita.comm.dims
    if zero.stage == 0:
        return DataParallel(
            groups, policy, make_optimizer, bucket_numel(zero), scaling, dims.grad_group,
            tensor=tensor, experts=experts,
        )  # fmt: skip
    if zero.stage == 3:
        return FullySharded(
            module, groups, policy, make_optimizer, Stage3Settings.from_config(zero), scaling,
            group=group,
            placement=offload_placement(config), tensor=tensor, replicas=replicas,
            holders=dims.grad_group, experts=experts,
        )  # fmt: skip
    if zero.stage in (1, 2):
        return Sharded(
            zero.stage, groups, policy, make_optimizer, bucket_numel(zero), scaling, group,
            placement=offload_placement(config).optimizer,
            sub_group_numel=int(zero.sub_group_size), tensor=tensor,
            replicas=replicas, experts=experts,
            quantize_block=DEFAULT_BLOCK_SIZE if zero.zero_quantized_weights else None,
        )  # fmt: skip
    raise config_error(
        "zero_optimization.stage", f"{zero.stage} is not available in this version of partita"
    )


def tensor_parallel_norm(
    module: torch.nn.Module, dims: comm.ParallelDims
) -> TensorParallelNorm | None:
    """What the gradient norm needs when `dims` split the model over tensor ranks (None
    otherwise): the tensor group, and the parameters every tensor rank holds whole. Those are
    the ones without a true ``tensor_model_parallel`` or ``model_parallel`` attribute, the
    attributes Megatron sets and DeepSpeed's ``is_model_parallel_parameter`` reads; read once
    here, so that the algorithm never looks at attributes on parameters."""
    if dims.tp_world_size == 1:
        return None
    replicated = tuple(
        p
        for p in module.parameters()
        if not (getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))
    )
    return TensorParallelNorm(dims.tp_group, dims.tp_rank == 0, replicated)


def attach_tools(engine: Any, config: DeepSpeedConfig) -> None:
    """Wires the config's tool sections into a new engine: the FLOPs profile at
    ``flops_profiler.profile_step``, the comms logger, and the ``activation_checkpointing``
    settings (the defaults of `partita.activations.checkpoint` unless the script called
    ``deepspeed.checkpointing.configure`` itself, which wins as in DeepSpeed); with
    ``cpu_checkpointing``, the host offload of an HF model's checkpointed layer inputs."""
    from partita.activations import checkpointing, offload
    from partita.profiling import comms
    from partita.profiling.engine_hooks import EngineFlopsProfile

    # DeepSpeed's engine.flops_profiler is the profiler itself; the profile step's results
    # (flops, fwd_duration) stay readable on engine.flops_profile after its report.
    profile = (
        EngineFlopsProfile(engine, config.flops_profiler) if config.flops_profiler.enabled else None
    )
    engine.flops_profile = profile
    engine.flops_profiler = profile.profiler if profile is not None else None
    if config.comms_logger.enabled:
        comms.configure(config.comms_logger)
    if not checkpointing.is_configured():
        checkpointing.apply_config(config.activation_checkpointing)
    # cpu_checkpointing covers a Hugging Face model's own gradient checkpointing too: its
    # layers call torch's checkpoint directly, never partita.activations.checkpoint.
    model = engine.module
    if checkpointing.settings().config.cpu_checkpointing and offload.has_hf_checkpointing(model):
        offload.offload_checkpoints(model)
