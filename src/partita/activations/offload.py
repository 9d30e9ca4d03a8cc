"""Checkpoint inputs of Hugging Face gradient checkpointing kept in host memory (what
DeepSpeed's Arctic Long Sequence Training calls "activation checkpoint offload").

With ``model.gradient_checkpointing_enable()`` each decoder layer runs under
`torch.utils.checkpoint`; between forward and backward it keeps only its input (the hidden
states at the layer boundary, B x S x H per layer), which at long sequence length is most of
the activation memory left. `offload_checkpoints(model)` moves those inputs to host memory as
each layer's forward saves them and copies them back for the backward that recomputes the
layer, one layer ahead: when layer i's input is restored, layer i-1's starts copying back.

How: HF calls each layer's ``_gradient_checkpointing_func(function, *args)``; we wrap that
function so that torch's checkpoint is entered under our saved-tensor hooks. torch saves the
region's positional tensor inputs through the hooks in force when it is called (its own hooks
take over inside the region), so exactly the region inputs pass through `pack`; everything
else autograd saves is untouched. DeepSpeed 0.19.8 (``CheckpointHiddenStatesOffload``) gets the
same tensors by patching ``GradientCheckpointingLayer.__call__`` to mark ``args[0]`` under a
process-wide hook; wrapping the per-model function touches no class and nothing else. Its names
are here too: `get_checkpoint_hidden_states_offloading_ctx_manager` returns a
`CheckpointHiddenStatesOffload` context that offloads for every model run inside it.

One code path on every device: on CUDA the host buffers are pinned and copies run on a side
stream ordered by events (the device block is held by ``record_stream`` until its copy ran);
on CPU the side stream and events are None and the same copies run in place, so a CPU run
exercises the copy, restore and prefetch logic bit for bit. The bytes offloaded are counted in
``partita.activations.STATS`` as host-held (see storage's [Note: saved-input accounting]) and
thus in the engine's ``memory_report``.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from partita.activations.storage import STATS
from partita.platform.accelerator import get_accelerator

__all__ = [
    "CheckpointHiddenStatesOffload",
    "CheckpointOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "has_hf_checkpointing",
    "offload_checkpoints",
]

_FUNC = "_gradient_checkpointing_func"
"""The attribute HF's ``gradient_checkpointing_enable`` sets on each checkpointable module."""


@dataclass
class OffloadCounts:
    """What one `CheckpointOffload` has moved (cumulative)."""

    offloaded: int = 0
    offloaded_bytes: int = 0
    restored: int = 0
    prefetched: int = 0


class _HostCopy:
    """One checkpoint input: kept on the device until `offload`, then in host memory, and its
    way back to the device."""

    def __init__(
        self, tensor: torch.Tensor, side: Any, previous: _HostCopy | None, pin: bool, keep: bool
    ) -> None:
        self.device, self.shape, self.dtype = tensor.device, tensor.shape, tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self.side = side
        self.previous = weakref.ref(previous) if previous is not None else None
        self.prefetched: tuple[torch.Tensor, Any] | None = None
        self.kept: torch.Tensor | None = tensor
        # Only a copy into page-locked memory may run behind the host's back: a non-blocking
        # device-to-host copy into pageable memory could be read before it landed.
        self.async_copy = tensor.device.type != "cpu" and pin
        self.host: torch.Tensor | None = None
        # Where STATS counts it (None: not yet), read by the finalizer, which must not hold
        # self. An input offloaded at once is never counted on the device.
        self._counted: list[bool | None] = [None]
        weakref.finalize(self, _uncount, self._counted, self.nbytes)
        if keep:
            STATS.add(False, self.nbytes)
            self._counted[0] = False

    def offload(self) -> int:
        """Starts the copy to host memory and lets the device tensor go; the bytes moved (0 if
        it was moved before)."""
        if self.kept is None:
            return 0
        tensor, self.kept = self.kept, None
        accelerator = get_accelerator()
        self.host = torch.empty(self.shape, dtype=self.dtype, pin_memory=self.async_copy)
        accelerator.wait_stream(self.side, None)  # the copy reads what the compute stream wrote
        with accelerator.stream(self.side):
            self.host.copy_(tensor, non_blocking=self.async_copy)
        if self.side is not None:
            # We drop the device tensor now; its block must outlive the copy.
            tensor.record_stream(self.side)
        if self._counted[0] is None:
            STATS.add(True, self.nbytes)
        else:
            STATS.move_to_host(self.nbytes)
        self._counted[0] = True
        return self.nbytes

    def prefetch(self) -> None:
        """Starts the copy back to the device (on the side stream; in place on CPU)."""
        if self.prefetched is not None or self.host is None:
            return
        accelerator = get_accelerator()
        target = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        # After the compute stream's work so far (the block's previous users) and, being on the
        # same stream, after the offload copy that filled the host buffer.
        accelerator.wait_stream(self.side, None)
        with accelerator.stream(self.side):
            target.copy_(self.host, non_blocking=self.async_copy)
        if self.side is not None:
            target.record_stream(self.side)  # freed unused (graph dropped) while copying
        self.prefetched = (target, accelerator.record_event(self.side))

    def restore(self) -> tuple[torch.Tensor, bool]:
        """The input on its device, and whether a prefetch had already started its copy; starts
        the previous layer's prefetch (backward runs the layers in reverse)."""
        if self.kept is not None:
            data, hit = self.kept, False
        else:
            hit = self.prefetched is not None
            self.prefetch()
            assert self.prefetched is not None
            data, event = self.prefetched
            self.prefetched = None
            if event is not None:
                event.wait()  # the compute stream waits for the copy, the host does not
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.prefetch()
        return data, hit


def _uncount(counted: list[bool | None], nbytes: int) -> None:
    if counted[0] is not None:
        STATS.remove(counted[0], nbytes)


def _offloadable(tensor: torch.Tensor) -> bool:
    # Parameters are kept by the model anyway; non-contiguous or sparse inputs would need their
    # layout rebuilt, and an exact layout is what keeps recomputation bitwise equal.
    return (
        tensor.is_floating_point()
        and not isinstance(tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
    )


class CheckpointOffload:
    """Saved-tensor hooks that keep checkpoint-region inputs in host memory, and the modules
    whose checkpoint function they were wrapped into; `remove` unwraps them.

    Args:
        pin: page-locked host buffers on CUDA (torch's caching host allocator reuses them).
        side_stream: copies on a side stream; False: on the compute stream.
        min_bytes: inputs smaller than this stay where they are.
        keep_last: the newest this many inputs stay on the device (the last layers' inputs,
            which backward needs first) until a newer one is saved.

    Attributes:
        counts: tensors and bytes offloaded, restored, and restored from a prefetch.
    """

    def __init__(
        self, pin: bool = True, side_stream: bool = True, min_bytes: int = 0, keep_last: int = 0
    ) -> None:
        self.counts = OffloadCounts()
        self.pin, self.min_bytes, self.keep_last = pin, min_bytes, keep_last
        self._side = get_accelerator().new_stream() if side_stream else None
        self._last: weakref.ref[_HostCopy] | None = None
        self._newest: collections.deque[weakref.ref[_HostCopy]] = collections.deque()
        self._wrapped: list[weakref.ref[torch.nn.Module]] = []
        self._hooks: list[Any] = []

    def wrap(self, module: torch.nn.Module) -> None:
        """Routes `module`'s HF checkpoint function (if it has one) through these hooks."""
        func = module.__dict__.get(_FUNC)
        if func is not None and not isinstance(func, _OffloadingCheckpoint):
            setattr(module, _FUNC, _OffloadingCheckpoint(func, self))
            self._wrapped.append(weakref.ref(module))

    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook for a checkpoint region's inputs."""
        if not _offloadable(tensor) or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        previous = self._last() if self._last is not None else None
        keep = self.keep_last > 0
        stored = _HostCopy(tensor, self._side, previous, self.pin, keep)
        self._last = weakref.ref(stored)
        if keep:
            self._newest.append(self._last)
        else:
            self._count(stored)
        while len(self._newest) > self.keep_last:
            self._count(self._newest.popleft()())
        return stored

    def _count(self, stored: _HostCopy | None) -> None:
        moved = stored.offload() if stored is not None else 0
        self.counts.offloaded += int(moved > 0)
        self.counts.offloaded_bytes += moved

    def unpack(self, stored: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the input back on its device."""
        if not isinstance(stored, _HostCopy):
            return stored
        data, hit = stored.restore()
        self.counts.restored += 1
        self.counts.prefetched += int(hit)
        return data

    def remove(self) -> None:
        """Restores the wrapped checkpoint functions and drops the hooks that wrap them. What
        was offloaded before stays restorable: the backward of a graph built earlier works."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for ref in self._wrapped:
            module = ref()
            func = module.__dict__.get(_FUNC) if module is not None else None
            if isinstance(func, _OffloadingCheckpoint) and func.offload is self:
                setattr(module, _FUNC, func.inner)
        self._wrapped.clear()
        for model, installed in list(_INSTALLED.items()):
            if installed is self:
                del _INSTALLED[model]


class _OffloadingCheckpoint:
    """HF's checkpoint function entered under the offload's saved-tensor hooks."""

    def __init__(self, inner: Any, offload: CheckpointOffload) -> None:
        self.inner, self.offload = inner, offload

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        """``inner(function, *args, **kwargs)`` with the region's inputs offloaded."""
        if not torch.is_grad_enabled():
            return self.inner(function, *args, **kwargs)
        hooks = torch.autograd.graph.saved_tensors_hooks(self.offload.pack, self.offload.unpack)
        with hooks:
            return self.inner(function, *args, **kwargs)


class CheckpointHiddenStatesOffload(CheckpointOffload):
    """DeepSpeed 0.19.8's context (``deepspeed.runtime.activation_checkpointing.
    offload_activations``): while it is active, the inputs of every HF gradient-checkpointed
    layer that runs are offloaded. Enter it around forward and backward as with DeepSpeed (the
    inputs it offloaded stay restorable after it exits). It wraps the checkpoint function of a
    module with a ``gradient_checkpointing`` flag, and of such modules below it, when the module
    is first called (a global forward pre-hook, removed on exit), instead of DeepSpeed's patch
    of ``GradientCheckpointingLayer.__call__``."""

    def __init__(
        self, pin: bool = True, side_stream: bool = True, min_bytes: int = 0, keep_last: int = 0
    ) -> None:
        super().__init__(pin, side_stream, min_bytes, keep_last)
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def _wrap_called(self, module: torch.nn.Module, _args: Any) -> None:
        if not hasattr(module, "gradient_checkpointing"):
            return
        self.wrap(module)
        if module not in self._seen:
            # A model's own flag is called before its layers: with transformers releases that
            # checkpoint in ``__call__``, a layer's pre-hook would run inside the checkpoint.
            self._seen.add(module)
            for below in module.modules():
                if hasattr(below, "gradient_checkpointing"):
                    self.wrap(below)

    def __enter__(self) -> CheckpointHiddenStatesOffload:
        if self._hooks:
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant")
        register = torch.nn.modules.module.register_module_forward_pre_hook
        self._hooks.append(register(self._wrap_called))
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
        self._seen = weakref.WeakSet()


def get_checkpoint_hidden_states_offloading_ctx_manager(
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_bytes: int = 1024,
    max_fwd_stash_count: int = 2,
    max_cpu_buffer_pool_count: int = 64,
    keep_last_count: int = 1,
) -> CheckpointHiddenStatesOffload:
    """DeepSpeed 0.19.8's factory, with its signature. `use_pin_memory`, `use_streams`,
    `min_offload_bytes` and `keep_last_count` apply; `max_fwd_stash_count` and
    `max_cpu_buffer_pool_count` tune DeepSpeed's own stash and buffer pool and are checked but
    unused: partita leaves buffer reuse to torch's caching host allocator."""
    for name, value in (
        ("min_offload_bytes", min_offload_bytes),
        ("max_fwd_stash_count", max_fwd_stash_count),
        ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
        ("keep_last_count", keep_last_count),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return CheckpointHiddenStatesOffload(
        use_pin_memory, use_streams, min_offload_bytes, keep_last_count
    )


_INSTALLED: weakref.WeakKeyDictionary[torch.nn.Module, CheckpointOffload] = (
    weakref.WeakKeyDictionary()
)


def has_hf_checkpointing(model: torch.nn.Module) -> bool:
    """Whether `model` has Hugging Face gradient-checkpointing layers (modules carrying a
    ``gradient_checkpointing`` flag)."""
    return any(hasattr(m, "gradient_checkpointing") for m in model.modules())


def offload_checkpoints(model: torch.nn.Module, keep_last: int = 0) -> CheckpointOffload:
    """Keeps the inputs of `model`'s gradient-checkpointed layers in host memory between
    forward and backward (see the module docstring). Works whether
    ``gradient_checkpointing_enable`` is called before or after; calling it twice returns the
    same offload. `keep_last`: the newest inputs left on the device (`CheckpointOffload`).
    Raises ValueError if `model` has no HF gradient-checkpointing layers."""
    installed = _INSTALLED.get(model)
    if installed is not None:
        return installed
    if not has_hf_checkpointing(model):
        raise ValueError(
            f"offload_checkpoints: {type(model).__name__} has no Hugging Face gradient-"
            "checkpointing layers (no module with a `gradient_checkpointing` flag); for your own "
            "layers use partita.activations.checkpoint with cpu_checkpointing"
        )
    offload = CheckpointOffload(keep_last=keep_last)
    modules = [weakref.ref(m) for m in model.modules() if hasattr(m, "gradient_checkpointing")]

    def wrap_all(*_: Any) -> None:
        # Each forward: ``gradient_checkpointing_enable`` may run after us and set new functions.
        for ref in modules:
            module = ref()
            if module is not None:
                offload.wrap(module)

    offload._hooks.append(model.register_forward_pre_hook(wrap_all))
    wrap_all()
    _INSTALLED[model] = offload
    return offload
