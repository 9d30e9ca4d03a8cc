"""`HostAdds`: reduced gradients added into host memory once their copies have landed.

On a GPU the queue holds device-to-host copies with events; here ``defer_host`` makes host
adds wait in the same queue (standing in for copies in flight), which shows the order and
the drain. The GPU check's offload cases show the device path (first-step masters against
no offload)."""

from __future__ import annotations

import pytest
import torch

from partita.offload import host_adds
from partita.offload.host_adds import HostAdds


def test_adds_wait_for_drain_and_keep_their_order() -> None:
    adds = HostAdds(defer_host=True)
    grad = torch.zeros(3)
    src = torch.ones(3)
    adds.add(grad, src)
    src.fill_(5.0)  # the source may be reused at once: the queue holds its own copy
    adds.add(grad, torch.full((3,), 2.0))
    assert adds.pending == 2 and torch.equal(grad, torch.zeros(3))
    adds.drain()
    assert adds.pending == 0 and torch.equal(grad, torch.full((3,), 3.0))


def test_at_most_the_byte_cap_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_adds, "MAX_PENDING_BYTES", 3 * 4 * 2)  # two adds of 3 fp32
    adds = HostAdds(defer_host=True)
    grad = torch.zeros(3)
    for k in range(4):
        adds.add(grad, torch.full((3,), float(k + 1)))
    assert adds.pending == 2 and torch.equal(grad, torch.full((3,), 3.0))  # 1 + 2 applied
    adds.drain()
    assert torch.equal(grad, torch.full((3,), 10.0))


def test_host_adds_without_deferral_apply_at_once() -> None:
    adds = HostAdds()
    grad = torch.zeros(2)
    adds.add(grad, torch.ones(2))
    assert adds.pending == 0 and torch.equal(grad, torch.ones(2))
