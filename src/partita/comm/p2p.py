"""Point-to-point transfers between two ranks (pipeline stages pass activations and gradients).

Blocking `send` and `recv`, recorded in `COUNTERS` like the collectives (op ``"send"`` or
``"recv"``) and in `LAST_COLLECTIVE` for the hang watchdog. A pipeline schedule pairs every send
with the peer's receive in the same order ([Note: pipeline schedules] in
`partita.parallel.pipe_schedule`), so blocking calls cannot deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.comm.collectives import _record, _tracked
from partita.comm.pins import hold as _pin


def send(tensor: torch.Tensor, dst: int, tag: str = "") -> None:
    """Sends `tensor` (made contiguous) to global rank `dst`; returns once it is handed over."""
    t = tensor.contiguous()
    _record("send", tag, t, None)
    _pin(t)
    _tracked("send", tag, False, lambda a: dist.send(t, dst=dst))


def recv(tensor: torch.Tensor, src: int, tag: str = "") -> torch.Tensor:
    """Receives into `tensor` (contiguous) from global rank `src`; returns it."""
    if not tensor.is_contiguous():
        raise ValueError("recv needs a contiguous tensor to receive into")
    _record("recv", tag, tensor, None)
    _pin(tensor)
    _tracked("recv", tag, False, lambda a: dist.recv(tensor, src=src))
    return tensor


__all__ = ["recv", "send"]
