"""Gradients that exist only while a step needs them.

[Note: released gradients]
torch's own loop frees gradients after the optimizer step (``zero_grad(set_to_none=True)``, the
default), so the activations of the next forward never sit beside them. partita's strategies do
the same with every gradient they own: stage 0's bucket buffers and fp32 master gradients,
stage 1's full-gradient buckets, and the fp32 gradient shards of stages 1-3 (in host memory
under CPU offload), and the free buffers of the stage 2-3 reduction pools
(``zero/buffer_pool.py``: reused within a backward, not kept beside the next forward's
activations). ``zero_grad`` (the engine calls it after every step, applied or skipped)
drops them; they are made again, zeroed, when backward first writes into them (bucket by
bucket, as their gradients arrive, so the whole set never joins the activations at the start
of backward) or when the step reads them (a step with no backward steps zeros, as before).
While released, the ``.grad`` of the tensor that owned the memory is None, never a view of
freed memory; a ``.grad`` a caller kept stays the tensor it was. Nothing is released between
the micro-batches of a step, so gradients accumulate as before, and the accessors
(``safe_get_full_grad``...) read them between the boundary backward and ``engine.step()``.
NVMe-swapped gradients are not held in memory between uses anyway ([Note: swapped gradients]).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from partita.platform.accelerator import get_accelerator, pin_if


def zeros_like(tensor: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """Zeros shaped like `tensor` on its device, page-locked when `pin` and in host memory."""
    if pin and tensor.device.type == "cpu" and get_accelerator().is_cuda:
        # Page-locked from the start: `pin_if` would page-lock a copy, every step. torch's
        # caching host allocator serves the block again after the first step.
        return torch.zeros(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pin_if(pin, torch.zeros_like(tensor))


def ensure_grad(param: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """``param.grad``, made (zeroed, page-locked with `pin`) when it was released."""
    grad = param.grad
    if grad is None:
        grad = zeros_like(param, pin)
        param.grad = grad
    return grad


def release_grads(params: Iterable[torch.Tensor]) -> None:
    """Drops the gradients of `params` (see [Note: released gradients])."""
    for p in params:
        p.grad = None


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of memory `tensors` hold (None and released storage hold none); a storage shared
    by several of them counts once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
