"""Collectives on CPU tensors over NCCL run on device copies (see [Note: staged collectives]).

The GPU check found it: with NCCL, `safe_get_full_fp32_param` of a CPU-offloaded master
raised torch's "No backend type associated with device type cpu". These tests run the
staging path on one CPU process: the staging device is the CPU itself, and a spy in place of
torch's collective shows that it receives a copy and that the result reaches the caller's
tensor only when the collective has finished.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from partita import comm
from partita.comm import collectives


@pytest.fixture
def world1() -> Iterator[None]:
    """A one-rank gloo group in this process."""
    store = dist.FileStore(tempfile.mktemp(prefix="partita-staging-"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_only_cpu_tensors_on_nccl_are_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    for backend, tensors, want in [
        ("nccl", (cpu,), torch.device("cuda", 0)),
        ("nccl", (meta, cpu), torch.device("cuda", 0)),  # an all-gather's CPU input
        ("nccl", (meta,), None),
        ("gloo", (cpu,), None),
    ]:
        monkeypatch.setattr(dist, "get_backend", lambda group, b=backend: b)
        assert collectives._staging_device(None, tensors) == want, (backend, tensors)


class _Spy:
    """Stands in for a torch collective: doubles the first tensor it gets, in place, and
    remembers it; async calls finish only when waited on."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, tensor: torch.Tensor, *args: Any, async_op: bool = False, **kw: Any) -> Any:
        self.seen.append(tensor)
        if not async_op:
            tensor.mul_(2)
            return None
        spy = self

        class Pending:
            def wait(self) -> bool:
                spy.seen[-1].mul_(2)
                return True

        return Pending()


@pytest.mark.parametrize("async_op", [False, True])
def test_staged_all_reduce_and_broadcast_copy_the_result_back(
    world1: None, monkeypatch: pytest.MonkeyPatch, async_op: bool
) -> None:
    monkeypatch.setattr(collectives, "_staging_device", lambda g, t: torch.device("cpu"))
    spy = _Spy()
    monkeypatch.setattr(dist, "all_reduce", spy)
    monkeypatch.setattr(dist, "broadcast", spy)
    for run in (
        lambda x: comm.all_reduce(x, async_op=async_op),
        lambda x: comm.broadcast(x, src=0, async_op=async_op),
    ):
        x = torch.arange(4.0)
        work = run(x)
        assert spy.seen[-1].data_ptr() != x.data_ptr()  # the collective got a copy
        if async_op:
            assert torch.equal(x, torch.arange(4.0))  # not before the collective finished
            work.wait()
        assert torch.equal(x, 2 * torch.arange(4.0))


def test_staged_all_gather_fills_the_callers_output(
    world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(collectives, "_staging_device", lambda g, t: torch.device("cpu"))
    monkeypatch.setenv("PARTITA_COLLECTIVES", "native")
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def gather(out: torch.Tensor, inp: torch.Tensor, **kw: Any) -> None:
        calls.append((out, inp))
        out.copy_(inp + 1)

    monkeypatch.setattr(collectives, "_all_gather_single", gather)
    out, inp = torch.zeros(3), torch.arange(3.0)
    comm.all_gather(out, inp)
    assert calls[0][0].data_ptr() != out.data_ptr()
    assert torch.equal(out, torch.arange(3.0) + 1)
