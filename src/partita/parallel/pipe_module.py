"""DeepSpeed's ``PipelineModule``: a model given as a list of layers, cut into pipeline stages.

[Note: pipeline module]
The model is a sequence of layers whose outputs feed the next layer (a tensor or a tuple of
tensors). `PipelineModule` cuts the list into ``num_stages`` contiguous ranges (`partition`:
``uniform`` by count, ``parameters`` balancing trainable parameter counts, ``type:REGEX``
balancing the layers whose class name matches), and each rank builds only the layers of its
stage: a `LayerSpec` is a layer not yet constructed, so a model too big for one rank never
exists whole on any rank. Layers are registered under their global index (``"3.weight"``), so
a stage's ``state_dict`` names layers as the whole model does.

A `TiedLayerSpec` is a module shared by several layers under one key (the embedding that is
also the output projection): each stage holding one of those layers builds the module once,
its weights are broadcast from the first of those stages when the module is made, and after
every backward the gradients of its tied weights are summed over those stages
(`allreduce_tied_weight_gradients`), so the copies stay equal. Only the first stage counts them
in the gradient norm (`replicated_tied_parameters` names the others).

With ``virtual_stages`` = v > 1 (partita's argument; torch's and Megatron's interleaved
layout) the list is cut into P x v chunks and stage s builds chunks s, s + P, ..., each run by
`forward_chunk` under one of torch's interleaved schedules (`partita.parallel.pipe_torch`).

Weights save one safetensors file per layer, named by its global index (`save_state_dict`),
so they load into a module cut at any pipeline degree (`load_state_dir`).

Behaviour follows DeepSpeed's ``deepspeed/runtime/pipe/module.py`` (0.19.8): the same
partitions (DeepSpeed's ``partition_uniform`` and the dynamic programme of its
``partition_balanced``, ties broken alike), the same per-layer seeds with ``seed_layers``, the
same ``forward`` (per-layer reseeding, activation checkpointing every
``activation_checkpoint_interval`` layers), the same tied-module groups. Unlike DeepSpeed, bad
input is refused before any collective (a world that ``num_stages`` does not divide, fewer
layers than stages, tied specs that would build different modules), so it cannot hang a job.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partita import comm
from partita.comm import ProcessGroup
from partita.parallel.topology import (
    PIPE,
    PipeDataParallelTopology,
    PipelineParallelGrid,
    ProcessTopology,
)

logger = logging.getLogger(__name__)


class PipelineError(Exception):
    """DeepSpeed's error for using a pipeline engine the way it cannot be used."""


class LayerSpec:
    """A pipeline layer not yet built: its class and constructor arguments (DeepSpeed's
    ``LayerSpec``). ``LayerSpec(nn.Linear, 4, 8, bias=False).build()`` makes the layer."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = comm.get_rank() if comm.is_initialized() else -1

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """Constructs the layer."""
        if log:
            logger.info("RANK=%d building %r", self.global_rank, self)
        module: nn.Module = self.typename(*self.module_args, **self.module_kwargs)
        return module


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared with every other `TiedLayerSpec` of the same `key`
    (DeepSpeed's ``TiedLayerSpec``). `forward_fn(module, inputs)`, when given, replaces the
    module's forward at this position (an embedding used as the output projection);
    `tied_weight_attr` names the shared weights (dotted paths, ``"weight"`` by default)."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable[..., Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


# --- partitioning (pure arithmetic, DeepSpeed's results) ---------------------------------------


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of `num_parts` contiguous parts of `num_items` items, as even as possible,
    the first parts one longer when it does not divide (DeepSpeed's ``partition_uniform``);
    with fewer items than parts, one item per part and the rest empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of `num_parts` non-empty contiguous parts of `weights` minimising the spread
    (heaviest part minus lightest), DeepSpeed's ``partition_balanced``: the same dynamic
    programme over (items, parts) with the same tie-break (the last split point of equal cost
    wins), so it cuts where DeepSpeed cuts."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # best[i][j]: (cost, heaviest, lightest) of the first i items in j parts; where[i][j]: the
    # start of the last part. Unreachable states keep infinite cost.
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    heavy = [[inf] * (m + 1) for _ in range(n + 1)]
    light = [[inf] * (m + 1) for _ in range(n + 1)]
    where = [[0] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = heavy[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(heavy[k][j - 1], part), min(light[k][j - 1], part)
                spread = hi - lo
                if cost[i][j] >= spread:
                    cost[i][j], heavy[i][j], light[i][j], where[i][j] = spread, hi, lo, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(where[bounds[-1]][j])
    return bounds[::-1]


def layer_type_name(layer: Any) -> str | None:
    """The class name DeepSpeed matches ``type:REGEX`` against: a spec's class, a module's
    class, a function's ``__name__`` (None for anything else)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def layer_param_count(layer: Any) -> int:
    """Trainable parameters of one layer (a spec is built to count, as DeepSpeed does)."""
    if isinstance(layer, LayerSpec):
        layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def partition(layers: Sequence[Any], num_stages: int, method: str = "parameters") -> list[int]:
    """Stage boundaries (``num_stages + 1`` layer indices) for `layers` by `method`:
    ``"uniform"``, ``"parameters"`` or ``"type:REGEX"`` (case-insensitive, searched in each
    layer's class name; DeepSpeed's methods and results)."""
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(layers), num_stages)
    if method == "parameters":
        return partition_balanced([layer_param_count(x) for x in layers], num_stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        hits = [
            1 if (name := layer_type_name(x)) is not None and pattern.search(name) else 0
            for x in layers
        ]
        if not any(hits):
            raise RuntimeError(
                f"Partitioning '{method.split(':', 1)[1]}' found no valid layers to partition."
            )
        return partition_balanced(hits, num_stages)
    raise NotImplementedError(
        f"Partitioning method {method} not implemented (use 'uniform', 'parameters' or "
        "'type:REGEX')"
    )


@dataclass
class TiedGroup:
    """The stages of this rank's pipeline that hold one tied module, with their group."""

    key: str
    ranks: list[int]
    group: ProcessGroup
    weight_attrs: list[str]
    module: nn.Module


def _get_attr(module: nn.Module, path: str) -> torch.Tensor:
    """``module.a.b`` for ``path="a.b"``."""
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _check_tied_specs(layers: Sequence[Any]) -> None:
    """Raises when two `TiedLayerSpec` of one key would build different modules (each stage
    builds from its first spec of the key, so they would not be one module)."""
    first: dict[str, tuple[int, TiedLayerSpec]] = {}
    for idx, spec in enumerate(layers):
        if not isinstance(spec, TiedLayerSpec):
            continue
        if spec.key not in first:
            first[spec.key] = (idx, spec)
            continue
        j, other = first[spec.key]
        same = (spec.typename, repr(spec.module_args), repr(spec.module_kwargs)) == (
            other.typename,
            repr(other.module_args),
            repr(other.module_kwargs),
        )
        if not same or spec.tied_weight_attr != other.tied_weight_attr:
            raise ValueError(
                f"TiedLayerSpec key {spec.key!r}: layer {j} builds {other!r} "
                f"(tied {other.tied_weight_attr}) but layer {idx} builds {spec!r} (tied "
                f"{spec.tied_weight_attr}); tied layers must build the same module"
            )


def layer_file(directory: str, layer_idx: int, tensor_slice: int | None = None) -> str:
    """Where `PipelineModule.save_state_dict` puts layer `layer_idx`'s weights; with a model
    (tensor) axis, those of slice `tensor_slice` (DeepSpeed's ``layer_03-model_01`` naming)."""
    part = "" if tensor_slice is None else f"-model_{tensor_slice:02d}"
    return os.path.join(directory, f"layer_{layer_idx:02d}{part}.safetensors")


def set_random_seed(seed: int) -> None:
    """Seeds Python's, NumPy's (when installed) and torch's generators, as DeepSpeed's
    ``set_random_seed`` does."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    if torch.accelerator.is_available():
        torch.manual_seed(seed)  # every device's generator (queued until one initialises)
    else:
        # The same CPU stream, without torch.manual_seed's queueing of a seed for each
        # uninitialised backend, which formats a stack trace per call: 0.4 ms, paid for every
        # layer of every micro-batch under seed_layers.
        torch.default_generator.manual_seed(seed)


def _default_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """partita's activation checkpoint (non-reentrant: the stage's inputs need no grad)."""
    from partita.activations import checkpointing

    return checkpointing.checkpoint(function, *args)


def _topology(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    """The pipeline x data topology the module runs on; raises, before any collective, when
    `num_stages` does not divide the world or disagrees with `topology`."""
    if num_stages is None and topology is None:
        raise RuntimeError("PipelineModule: must provide num_stages or topology")
    world = comm.get_world_size()
    if topology is not None:
        if PIPE not in topology.get_axis_names():
            raise ValueError(f"PipelineModule: the topology {topology!r} has no 'pipe' axis")
        if num_stages is not None and num_stages != topology.get_dim(PIPE):
            raise ValueError(
                f"PipelineModule: num_stages={num_stages} but the topology has "
                f"{topology.get_dim(PIPE)} pipeline stages"
            )
        if topology.world_size() != world:
            raise ValueError(
                f"PipelineModule: the topology holds {topology.world_size()} ranks but the job "
                f"has {world}"
            )
        return topology
    assert num_stages is not None
    if num_stages < 1 or world % num_stages:
        raise RuntimeError(
            f"PipelineModule: num_stages ({num_stages}) must divide distributed world size "
            f"({world})"
        )
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)


class PipelineModule(nn.Module):
    """A model given as a sequence of layers, split into pipeline stages; this rank builds
    its stage's layers only (see [Note: pipeline module]). DeepSpeed's ``PipelineModule``
    signature; `partita.initialize` returns a `partita.parallel.pipe_engine.PipelineEngine`
    for it. Collective: every rank of the job constructs it with the same arguments."""

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError("PipelineModule: checkpointable_layers must be a list of class names")
        if activation_checkpoint_interval < 0:
            raise ValueError("PipelineModule: activation_checkpoint_interval must be >= 0")
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be an int >= 1, got "
                             f"{virtual_stages!r}")  # fmt: skip
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.checkpointable_layers = checkpointable_layers
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or _default_checkpoint
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        # Every check before the first collective (the grid's groups), on every rank alike.
        self._topo = _topology(num_stages, topology)
        self.num_stages = self._topo.get_dim(PIPE)
        self.virtual_stages = virtual_stages
        chunks = self.num_stages * virtual_stages
        if self._num_layers < chunks:
            raise ValueError(
                f"PipelineModule: {self._num_layers} layers cannot fill {self.num_stages} "
                "pipeline stages (each stage needs at least one layer)"
                if virtual_stages == 1
                else f"PipelineModule: {self._num_layers} layers cannot fill {self.num_stages} "
                f"stages x {virtual_stages} virtual stages (each chunk needs at least one layer)"
            )
        _check_tied_specs(self._layer_specs)
        self.stage_id: int = self._topo.get_coord(self.global_rank).pipe
        self.parts = partition(self._layer_specs, chunks, partition_method)
        self._place_chunks()
        if self.global_rank == 0:
            logger.info("pipeline partition (%s): %s", partition_method, self.parts)

        self._grid = PipelineParallelGrid(topology=self._topo)
        self.forward_funcs: list[Callable[..., Any]] = []
        self.fwd_map: dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()
        from partita.platform.accelerator import get_accelerator

        self.to(get_accelerator().current_device())
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    # --- building ------------------------------------------------------------------------
    def _place_chunks(self) -> None:
        """This rank's chunks: stage s holds chunks s, s + P, s + 2P, ... (the interleaved
        layout of torch's and Megatron's virtual stages; one chunk without them), and who
        runs a batch: the config's ``pipeline.schedule`` may change it ([Note: torch pipeline
        schedules] in `partita.parallel.pipe_torch`)."""
        v = self.virtual_stages
        self.local_chunks = [self.stage_id + k * self.num_stages for k in range(v)]
        self._local_layers = [
            i for c in self.local_chunks for i in range(self.parts[c], self.parts[c + 1])
        ]
        self._chunk_calls = [0] * v
        self.schedule = "interleaved_1f1b" if v > 1 else "1f1b"

    def _build(self) -> None:
        """Builds this stage's layers, registered under their global index."""
        for idx in self._local_layers:
            layer = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or set_random_seed)(self.base_seed + idx)
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("a PipelineModule inside a PipelineModule")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                shared = self.tied_modules[layer.key]
                fn = (
                    shared
                    if layer.forward_fn is None
                    else functools.partial(layer.forward_fn, shared)
                )
                self.forward_funcs.append(fn)
                continue
            if isinstance(layer, LayerSpec):
                layer = layer.build()
            if isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self.fwd_map[str(idx)] = len(self.forward_funcs)
            elif not callable(layer):
                raise TypeError(f"PipelineModule: layer {idx} ({layer!r}) is not callable")
            self.forward_funcs.append(layer)

    def _index_tied_modules(self) -> dict[str, TiedGroup]:
        """Makes one group per tied key and pipeline (collective: every rank makes every
        group, keys sorted); returns this rank's."""
        mine: dict[str, TiedGroup] = {}
        if self.num_stages == 1:
            return mine
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        slices = self._grid.get_slice_parallel_world_size()
        for key in keys:
            stages = sorted(
                {
                    self.stage_owner(i)
                    for i, s in enumerate(self._layer_specs)
                    if isinstance(s, TiedLayerSpec) and s.key == key
                }
            )
            for dp in range(self._grid.data_parallel_size):
                for mp in range(slices):
                    extra = {"model": mp} if slices > 1 else {}
                    ranks = [self._grid.stage_to_global(s, data=dp, **extra) for s in stages]
                    group = comm.new_group(ranks)
                    if self.global_rank in ranks:
                        mine[key] = TiedGroup(
                            key, ranks, group, self.tied_weight_attrs[key], self.tied_modules[key]
                        )
        return mine

    def _synchronize_tied_weights(self) -> None:
        """Makes every copy of a tied weight equal to the first stage's."""
        for tie in self.tied_comms.values():
            for attr in tie.weight_attrs:
                weight = _get_attr(tie.module, attr)
                with torch.no_grad():
                    comm.broadcast(weight.data, src=min(tie.ranks), group=tie.group, tag="tied")

    # --- tied gradients ----------------------------------------------------------------------
    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, ProcessGroup]]:
        """Each tied weight this rank holds with the group of the stages sharing it."""
        return [
            (_get_attr(tie.module, attr), tie.group)
            for tie in self.tied_comms.values()
            for attr in tie.weight_attrs
        ]

    def allreduce_tied_weight_gradients(self) -> None:
        """Sums the gradients of the tied weights over the stages that hold them."""
        for weight, group in self.get_tied_weights_and_groups():
            if weight.grad is not None:
                comm.all_reduce(weight.grad, group=group, tag="tied_grad")

    def replicated_tied_parameters(self) -> list[torch.nn.Parameter]:
        """The tied module parameters whose copy on another stage counts in the gradient norm
        (this rank is not the first of their tied group)."""
        return [
            p
            for tie in self.tied_comms.values()
            if self.global_rank != tie.ranks[0]
            for p in tie.module.parameters()
        ]

    # --- forward -----------------------------------------------------------------------------
    def _run_range(self, start: int, end: int) -> Callable[..., Any]:
        """A function running local layers ``start:end`` on its inputs (reseeding each layer
        per micro-batch with `seed_layers`, as DeepSpeed does)."""
        micro_offset = self.micro_offset + 1

        def run(*inputs: Any) -> Any:
            x: Any = inputs[0] if len(inputs) == 1 else inputs
            for i, layer in enumerate(self.forward_funcs[start:end]):
                self.curr_layer = self._local_layers[start + i]
                if self.seed_layers:
                    seed = self.base_seed * micro_offset + self.curr_layer
                    (self.seed_fn or set_random_seed)(seed)
                x = layer(x)
            return x

        return run

    def forward(self, forward_input: Any) -> Any:
        """Runs this stage's layers in order, checkpointing every
        ``activation_checkpoint_interval`` layers when it is set."""
        self.micro_offset += 1
        return self._run_layers(0, len(self.forward_funcs), forward_input)

    def forward_chunk(self, k: int, forward_input: Any) -> Any:
        """Runs this rank's `k`-th chunk (virtual stage ``stage_id + k * num_stages``) as
        `forward` runs a stage."""
        # Each chunk runs its micro-batches in order: its n-th call is micro-batch n, which
        # `seed_layers` reseeds as `forward` does (chunks are not called in layer order).
        self._chunk_calls[k] += 1
        self.micro_offset = self._chunk_calls[k]
        return self._run_layers(*self._chunk_span(k), forward_input)

    def _chunk_span(self, k: int) -> tuple[int, int]:
        """Local layer indices ``[begin, end)`` of this rank's `k`-th chunk."""
        sizes = [self.parts[c + 1] - self.parts[c] for c in self.local_chunks]
        begin = sum(sizes[:k])
        return begin, begin + sizes[k]

    def expect_metadata_pass(self) -> None:
        """torch's stages run every chunk once before the first micro-batch to learn the
        shapes (`partita.parallel.pipe_torch`): that call must not count as a micro-batch for
        the per-layer seeds."""
        self._chunk_calls = [c - 1 for c in self._chunk_calls]

    def chunk_modules(self, k: int) -> list[nn.Module]:
        """The modules (with their weights) of this rank's `k`-th chunk, each once."""
        begin, end = self._chunk_span(k)
        out: list[nn.Module] = []
        for fn in self.forward_funcs[begin:end]:
            module = fn.args[0] if isinstance(fn, functools.partial) else fn
            if isinstance(module, nn.Module) and all(module is not m for m in out):
                out.append(module)
        return out

    def _run_layers(self, begin: int, stop: int, forward_input: Any) -> Any:
        """Local layers ``begin:stop``, checkpointed in blocks of the interval."""
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run_range(begin, stop)(forward_input)
        x = forward_input
        for start in range(begin, stop, interval):
            end = min(start + interval, stop)
            inputs = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(self.forward_funcs[start:end]):
                x = self.activation_checkpoint_func(self._run_range(start, end), *inputs)
            else:
                x = self._run_range(start, end)(*inputs)
        return x

    def _is_checkpointable(self, funcs: Sequence[Any]) -> bool:
        """Whether a block of layers is checkpointed: those named in `checkpointable_layers`
        when given, else any block with parameters (DeepSpeed's rule)."""
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))

    def set_checkpoint_interval(self, interval: int) -> None:
        """Changes the activation checkpoint interval (0: off)."""
        if interval < 0:
            raise ValueError("activation checkpoint interval must be >= 0")
        self.activation_checkpoint_interval = interval

    # --- weights per layer ---------------------------------------------------------------------
    def _layer_modules(self) -> list[tuple[int, nn.Module]]:
        """(global index, module) of each local layer with weights; a tied layer's is its
        shared module, also where a ``forward_fn`` uses it."""
        out = []
        for local, fn in enumerate(self.forward_funcs):
            module = fn.args[0] if isinstance(fn, functools.partial) else fn
            if isinstance(module, nn.Module):
                out.append((self._local_layers[local], module))
        return out

    def save_state_dict(
        self, save_dir: str, checkpoint_engine: Any = None, exclude_frozen_params: bool = False
    ) -> None:
        """Writes this stage's weights, one safetensors file per layer named by its global
        index (``layer_03.safetensors``; with a model axis one file per tensor slice,
        ``layer_03-model_01.safetensors``), so they load at any pipeline degree
        (`load_state_dir`; the same number of slices). Data-parallel rank 0 of each stage (and
        slice) writes; each file is written to a temporary name and renamed. Every rank may
        call it; none waits for the others."""
        del checkpoint_engine  # DeepSpeed's signature; partita writes safetensors itself
        from safetensors.torch import save_file

        if self._grid.get_data_parallel_rank() != 0:
            return
        os.makedirs(save_dir, exist_ok=True)
        for idx, module in self._layer_modules():
            frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
            state = {
                k: v.detach().cpu().contiguous()
                for k, v in module.state_dict().items()
                if not (exclude_frozen_params and k in frozen)
            }
            path = layer_file(save_dir, idx, self._tensor_slice())
            save_file(state, path + ".tmp")
            os.replace(path + ".tmp", path)

    def load_state_dir(
        self, load_dir: str, checkpoint_engine: Any = None, strict: bool = True
    ) -> None:
        """Loads this stage's layers from `save_state_dict`'s files (written at any pipeline
        degree), then makes tied weights equal again. Collective (the tied broadcast): every
        rank calls it. Call it before `partita.initialize`, which copies the weights into the
        optimizer's masters."""
        del checkpoint_engine
        from safetensors.torch import load_file

        for idx, module in self._layer_modules():
            path = layer_file(load_dir, idx, self._tensor_slice())
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"rank {self.global_rank}: no weights for layer {idx}: {path}"
                )
            # Read to host memory; load_state_dict copies onto the layer's device.
            module.load_state_dict(load_file(path), strict=strict)
        self._synchronize_tied_weights()

    def _tensor_slice(self) -> int | None:
        """This rank's tensor slice when the topology has a model axis over several ranks."""
        if self._grid.get_slice_parallel_world_size() == 1:
            return None
        return self._grid.get_slice_parallel_rank()

    # --- queries -----------------------------------------------------------------------------
    def partitions(self) -> list[int]:
        """The stage boundaries: stage s holds layers ``parts[s]:parts[s + 1]`` (with virtual
        stages, chunk c those layers, on stage ``c % num_stages``)."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage holding layer `layer_idx`."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} not in [0, {self._num_layers})")
        for chunk in range(len(self.parts) - 1):
            if self.parts[chunk] <= layer_idx < self.parts[chunk + 1]:
                return chunk % self.num_stages
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    def topology(self) -> ProcessTopology:
        """The process topology the module was split over."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        """The pipeline grid (DeepSpeed's model-parallel unit for this module)."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        """Stages in the pipeline."""
        return self.num_stages

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Model-specific losses to report besides the loss (none by default)."""
        return None


__all__ = [
    "LayerSpec",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
    "layer_file",
    "partition",
    "partition_balanced",
    "partition_uniform",
]
