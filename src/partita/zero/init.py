"""`zero.Init`: build a model already sharded, so no rank ever holds all of it.

Inside the context every `nn.Module` subclass's ``__init__`` is wrapped: when a module's own
constructor returns, its direct parameters (the ones its children do not own) are broadcast from
rank 0 and cut down to this rank's chunk (``ceil(numel / world)`` elements; rank and world of
the data-parallel group, ``data_parallel_group=`` or an ``mpu``'s, else of every rank); the
parameter keeps its shape but holds a zero-memory NaN placeholder. At any moment the full
values of at most one module's direct parameters exist. Initialisation code that writes into
parameters after construction (Hugging Face's ``_init_weights``) runs under
`GatheredParameters` with ``modifier_rank=0``, as DeepSpeed's integration does. Stage 3 later
turns the chunks into its unit shards one parameter at a time.

``remote_device="cpu"`` keeps the chunks in host memory; ``remote_device="nvme"`` keeps them in
swap files under the config's ``zero_optimization.offload_param.nvme_path`` (each read back when
its parameter is gathered), so building a model larger than host memory holds at most one
module's parameters in memory at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from partita import comm
from partita.config import config_error, load_config
from partita.offload import SwappedTensor, SwapSpace, unique_run_id
from partita.platform.accelerator import configure_host_allocator
from partita.zero.placeholder import (
    COPY_PRE_SHARDED,
    mark_gathered,
    mark_managed,
    nan_placeholder,
)


@dataclass
class PreShard:
    """This rank's chunk of a parameter built under `Init`."""

    chunk: torch.Tensor
    numel: int
    world: int
    swap: SwappedTensor | None = None
    """Set when the chunk lives in a swap file (``remote_device="nvme"``)."""
    group: comm.ProcessGroup | None = None
    """The data-parallel group the parameter is sharded over (None: every rank); `world` is
    its size."""
    target: tuple[torch.device, torch.dtype] | None = None
    """Device and dtype the engine wants (applied when gathered; see `prepare_pre_sharded`)."""
    gathered: bool = False
    """True inside `materialized` (the parameter holds its full value)."""

    def value(self) -> torch.Tensor:
        """The chunk's values, in memory and converted to `target` (a copy when converted or
        swapped in; the swapped chunk is freed again)."""
        if self.swap is None:
            return self.chunk if self.target is None else self.chunk.to(*self.target)
        self.swap.ensure()
        device, dtype = self.target or (self.chunk.device, self.chunk.dtype)
        out = self.chunk.to(device=device, dtype=dtype, copy=True)  # the chunk is freed next
        self.swap.evict()
        return out

    def store(self, values: torch.Tensor) -> None:
        """Replaces the chunk's values (written through to its swap file)."""
        if self.swap is not None:
            self.swap.ensure()
        self.chunk.copy_(values)
        if self.swap is not None:
            self.swap.modified()
            self.swap.evict()


# Keyed by identity: tensors compare element-wise, so an ordinary WeakKeyDictionary cannot.
PRE_SHARDED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Parameters built under `Init` and not yet taken over by a stage-3 engine."""

_state = threading.local()


@dataclass
class InitStats:
    """Parameter memory seen while building under `Init` (bytes)."""

    sharded_bytes: int = 0
    peak_materialized_bytes: int = 0
    """Largest sum of full parameter bytes of one module alive at once."""


def _chunk_of(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    flat = full.detach().reshape(-1)
    size = -(-flat.numel() // world)
    out = torch.zeros(size, dtype=full.dtype, device=full.device)
    part = flat[rank * size : (rank + 1) * size]
    out[: part.numel()].copy_(part)
    return out


_swap_keys = itertools.count()


@torch.no_grad()
def shard_param(
    param: torch.Tensor,
    space: SwapSpace | None = None,
    host: bool = False,
    group: comm.ProcessGroup | None = None,
) -> None:
    """Broadcasts `param` from rank 0 of the data-parallel `group` (None: every rank), keeps
    this rank's chunk (on the host with `host`, in a swap file of `space` when given), leaves a
    NaN placeholder."""
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    comm.broadcast(param.data, src=comm.get_global_rank(group, 0), group=group, tag="init")
    chunk = _chunk_of(param.data, world, rank)
    if host or space is not None:
        chunk = chunk.cpu()
    shard = PreShard(chunk, param.numel(), world, group=group)
    if space is not None:
        shard.swap = SwappedTensor(chunk, space, f"init.{next(_swap_keys)}")
        shard.swap.evict()
    PRE_SHARDED[param] = shard
    param.data = nan_placeholder(param)
    mark_managed(param)


def _copy_pre_sharded(param: torch.Tensor) -> torch.Tensor | None:
    """A deep copy of a parameter built under `Init` (see `ZeroParameter.__deepcopy__`): a new
    parameter holding a copy of this rank's chunk, so every rank's copy stands for the same full
    value with no collective; None for a parameter `Init` does not hold (or holds gathered)."""
    shard = PRE_SHARDED.get(param)
    if shard is None or shard.gathered:
        return None
    value = shard.value()
    chunk = value.clone() if value is shard.chunk else value
    copy = torch.nn.Parameter(nan_placeholder(param), param.requires_grad)
    PRE_SHARDED[copy] = PreShard(chunk, shard.numel, shard.world, group=shard.group)
    mark_managed(copy)
    return copy


COPY_PRE_SHARDED.append(_copy_pre_sharded)


@torch.no_grad()
def gather_pre_sharded(param: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter built under `Init` (collective)."""
    shard = PRE_SHARDED[param]
    chunk = shard.value()
    full = torch.empty(chunk.numel() * shard.world, dtype=chunk.dtype, device=chunk.device)
    comm.all_gather(full, chunk, group=shard.group, tag="init")
    return full[: shard.numel].view(param.shape)


def _init_swap_space(
    remote_device: str | None, source: Any, group: comm.ProcessGroup | None = None
) -> SwapSpace | None:
    """The swap space for ``remote_device="nvme"`` (None for memory), from the config's
    ``zero_optimization.offload_param.nvme_path``."""
    if remote_device in (None, "none", "cpu"):
        return None
    if remote_device != "nvme":
        raise ValueError(
            f"zero.Init(remote_device={remote_device!r}): expected 'none', 'cpu' or 'nvme'"
        )
    path = None
    if source is not None:
        config = (
            source
            if hasattr(source, "zero_optimization")
            else load_config(source, world_size=comm.get_world_size(group))
        )
        param = config.zero_optimization.offload_param
        path = None if param is None else param.nvme_path
    if not path:
        raise config_error(
            "zero_optimization.offload_param.nvme_path",
            "zero.Init(remote_device='nvme') needs it: pass config_dict_or_path with it set",
        )
    # Named by global rank: replicas on one node must not share swap files.
    return SwapSpace(str(path), comm.get_rank(), run_id=unique_run_id("init"))


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    sub: type
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


class Init:
    """Context manager: modules constructed inside are sharded as they are built (DeepSpeed's
    ``deepspeed.zero.Init``; most of its arguments are accepted for compatibility)."""

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **kwargs: Any,
    ) -> None:
        del mem_efficient_linear, pin_memory, kwargs
        self.enabled = enabled
        if enabled:
            comm.init_distributed()
        # DeepSpeed's data_parallel_group (or an mpu's): the group the chunks are cut over, as
        # the engine's mpu will be (None: every rank).
        self.group = data_parallel_group
        if mpu is not None and enabled:
            self.group = comm.ParallelDims.from_mpu(mpu).dp_group
        self.host = remote_device == "cpu"
        self.space = (
            _init_swap_space(
                remote_device,
                config_dict_or_path if config_dict_or_path is not None else config,
                self.group,
            )
            if enabled
            else None
        )
        self.dtype = dtype
        self.stats = InitStats()
        self._patched: list[tuple[type, Callable[..., None]]] = []
        self._restore_hf: Callable[[], None] | None = None
        self._restore_subclass_hook: Any = None
        if module is not None and enabled:  # DeepSpeed: shard an already built module
            for m in module.modules():
                self._shard_module(m)

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        comm.init_distributed()
        # Building the model allocates and frees each module's full weights: with glibc's
        # default heap they stay resident (measured: +2 MB per 2 MB block kept after it went
        # to NVMe), with the engine's mmap threshold they go back to the OS.
        configure_host_allocator()
        for cls in [torch.nn.Module, *_subclasses(torch.nn.Module)]:
            if "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                try:
                    setattr(cls, "__init__", self._wrap(original))  # noqa: B010
                except (TypeError, AttributeError):  # a class that refuses new attributes
                    continue
                self._patched.append((cls, original))
        self._restore_hf = _patch_hf_initialize_weights()
        self._hook_new_subclasses()
        _state.current = self
        return self

    def _hook_new_subclasses(self) -> None:
        """Wraps module classes defined while the context is open (lazily imported models)."""
        init = self
        previous = torch.nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls: type, **kwargs: Any) -> None:
            object.__init_subclass__()
            if "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                setattr(cls, "__init__", init._wrap(original))  # noqa: B010
                init._patched.append((cls, original))
            if init._restore_hf is None:
                init._restore_hf = _patch_hf_initialize_weights()

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment,method-assign]
        self._restore_subclass_hook = previous

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:  # __enter__ changed nothing (an enabled outer context stays)
            return
        _state.current = None
        for cls, original in reversed(self._patched):
            setattr(cls, "__init__", original)  # noqa: B010
        self._patched = []
        if self._restore_subclass_hook is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._restore_subclass_hook  # type: ignore[method-assign]
        if self._restore_hf is not None:
            self._restore_hf()
            self._restore_hf = None

    def _wrap(self, original: Callable[..., None]) -> Callable[..., None]:
        init = self

        def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            depth = getattr(_state, "depth", {})
            _state.depth = depth
            key = id(module)
            depth[key] = depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                depth[key] -= 1
                if depth[key] == 0:
                    del depth[key]
            if key not in depth:
                init._shard_module(module)

        return wrapped

    def _shard_module(self, module: torch.nn.Module) -> None:
        params = [p for p in module.parameters(recurse=False) if p not in PRE_SHARDED]
        if not params:
            return
        if self.dtype is not None:
            for p in params:
                if p.is_floating_point():
                    p.data = p.data.to(self.dtype)
        full = sum(p.numel() * p.element_size() for p in params)
        self.stats.peak_materialized_bytes = max(self.stats.peak_materialized_bytes, full)
        for p in params:
            shard_param(p, self.space, self.host, self.group)
            self.stats.sharded_bytes += PRE_SHARDED[p].chunk.numel() * p.element_size()


@contextlib.contextmanager
def materialized(params: Sequence[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    """Full values of pre-sharded `params` inside the block; with `modifier_rank`, that rank's
    values at exit become every rank's new chunks."""
    for p in params:
        p.data = gather_pre_sharded(p)
        PRE_SHARDED[p].gathered = True
    try:
        yield
    finally:
        with torch.no_grad():
            for p in params:
                PRE_SHARDED[p].gathered = False
                if modifier_rank is not None:
                    # modifier_rank is a rank of the parameter's data-parallel group
                    shard = PRE_SHARDED[p]
                    src = comm.get_global_rank(shard.group, modifier_rank)
                    comm.broadcast(p.data, src=src, group=shard.group, tag="gathered")
                    shard.store(_chunk_of(p.data, shard.world, comm.get_rank(shard.group)))
                p.data = nan_placeholder(p)


def _patch_hf_initialize_weights() -> Callable[[], None] | None:
    """Runs Hugging Face's per-module weight initialisation on gathered parameters."""
    import sys

    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not hasattr(modeling, "PreTrainedModel"):  # absent or mid-import
        return None
    cls = modeling.PreTrainedModel
    original = cls._initialize_weights

    def initialize(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # A module's _init_weights may write its direct children's weights too (GPT-2 scales
        # c_proj from the attention module), so those are gathered with it.
        owners = [module, *module.children()]
        params = [p for m in owners for p in m.parameters(recurse=False) if p in PRE_SHARDED]
        params = list({id(p): p for p in params}.values())
        current = getattr(_state, "current", None)
        if current is not None:
            full = sum(p.numel() * p.element_size() for p in params)
            current.stats.peak_materialized_bytes = max(current.stats.peak_materialized_bytes, full)
        with materialized(params, modifier_rank=0):
            return original(self, module, *args, **kwargs)

    cls._initialize_weights = initialize

    def restore() -> None:
        cls._initialize_weights = original

    return restore


@torch.no_grad()
def hand_back(
    param: torch.Tensor, full: torch.Tensor, group: comm.ProcessGroup | None = None
) -> None:
    """Leaves `param` as `Init` leaves a parameter it built: this rank's chunk of `full` (its
    full value, the same on every rank) in `PRE_SHARDED` and a placeholder in the module. A
    stage-3 engine that is destroyed hands its parameters back this way, so another engine can
    take over the same module (Hugging Face's Trainer destroys the evaluation engine before it
    builds the training one). `group` is the data-parallel group the chunk is cut over."""
    world = comm.get_world_size(group)
    chunk = _chunk_of(full, world, comm.get_rank(group))
    mark_gathered(param, nan_placeholder(param, dtype=full.dtype, device=full.device))
    PRE_SHARDED[param] = PreShard(chunk, param.numel(), world, group=group)


def full_value(param: torch.Tensor) -> torch.Tensor:
    """`param`'s full value: gathered (and released from `PRE_SHARDED`) if built under `Init`."""
    if param in PRE_SHARDED:
        value = gather_pre_sharded(param)
        shard = PRE_SHARDED.pop(param)
        if shard.swap is not None:
            # Its file would otherwise stay allocated until Init's space closes, beside the
            # engine's own copies: 2-4 bytes per parameter of a disk the states nearly fill.
            shard.swap.discard()
        return value
    return param.detach()


@torch.no_grad()
def prepare_pre_sharded(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Makes the chunks of `module`'s `Init`-built parameters gather to `device`/`dtype` and
    gives their placeholders the same, so a later ``module.to(device, dtype)`` does not expand them.
    Returns True when the module has such parameters."""
    found = False
    for p in module.parameters():
        shard = PRE_SHARDED.get(p)
        if shard is None:
            continue
        found = True
        target = dtype if p.is_floating_point() else p.dtype
        # Converted when gathered, one parameter at a time: converting every chunk here would
        # read all of them back from NVMe (remote_device="nvme") or copy them to the device.
        shard.target = (device, target)
        p.data = nan_placeholder(p, dtype=target, device=device)
    return found


def materialize_all(module: torch.nn.Module) -> None:
    """Gives every `Init`-built parameter of `module` its full value (stages 0-2 need them)."""
    for p in module.parameters():
        if p in PRE_SHARDED:
            p.data = full_value(p)
