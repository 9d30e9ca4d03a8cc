"""Two processes sharing one device: the backend choice and a small process launcher.

NCCL refuses two ranks on one GPU in recent versions ("Duplicate GPU detected"), so the check
first tries NCCL with a one-element all-reduce and falls back to gloo, which moves CUDA tensors
through host memory. On gloo with CUDA tensors partita's reduce-scatter and all-gather run as
all-reduces (``PARTITA_COLLECTIVES=all_reduce``): gloo's all-reduce takes CUDA tensors, while
the two-rank exchange of halves (send/recv) wants host tensors.

`spawn` is `partita.testing.run_distributed` cut down to what this needs, but with the backend
and the accelerator chosen by the caller (the test harness pins gloo on CPU).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


def _child(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world: int,
    backend: str,
    env: dict,
    run_dir: str,
) -> None:
    os.environ.update({**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    out = os.path.join(run_dir, f"rank{rank}.pkl")
    try:
        import torch

        from partita import comm

        if torch.cuda.is_available() and env.get("PARTITA_ACCELERATOR") != "cpu":
            torch.cuda.set_device(0)  # both ranks on the one device
        store = torch.distributed.FileStore(os.path.join(run_dir, "store"), world)
        # torch.distributed directly, not comm.init_distributed: that binds a device_id, which
        # only NCCL takes. partita's comm finds the group either way.
        extra = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
        timeout = datetime.timedelta(seconds=120)
        torch.distributed.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timeout, **extra
        )
        result: Any = ("ok", fn(*args))
        comm.destroy_process_group()
    except BaseException:
        result = ("error", traceback.format_exc()[-3000:])
    with open(out + ".tmp", "wb") as fh:
        pickle.dump(result, fh)
    os.replace(out + ".tmp", out)
    os._exit(0)


def spawn(
    fn: Callable[..., Any],
    args: tuple,
    world: int,
    backend: str,
    env: dict[str, str],
    timeout: float,
) -> list[Any]:
    """``fn(*args)`` on ``world`` spawned ranks joined on ``backend``; their results in rank
    order. Raises RuntimeError with the first rank's traceback, or on a timeout."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as run_dir:
        procs = [
            ctx.Process(target=_child, args=(fn, args, r, world, backend, env, run_dir))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        if alive:
            raise RuntimeError(
                f"{backend}: {len(alive)} of {world} ranks still running after {timeout:.0f} s"
            )
        results = []
        for r in range(world):
            path = os.path.join(run_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(
                    f"{backend}: rank {r} exited {procs[r].exitcode} without a result"
                )
            with open(path, "rb") as fh:
                status, value = pickle.load(fh)
            if status != "ok":
                raise RuntimeError(f"{backend}: rank {r} failed:\n{value}")
            results.append(value)
        return results


def probe_all_reduce() -> float:
    """One all-reduce of a one-element tensor on this rank's device; returns the sum."""
    import torch

    from partita import comm
    from partita.platform.accelerator import get_accelerator

    t = torch.ones(1, device=get_accelerator().current_device())
    comm.all_reduce(t, tag="probe")
    return float(t)


def choose_backend(
    cuda: bool, env: dict[str, str], timeout: float
) -> tuple[str, dict[str, str], str]:
    """The backend two ranks on one device can use, the environment they need, and why."""
    if not cuda:
        return "gloo", env, "gloo (CPU dry run)"
    try:
        spawn(probe_all_reduce, (), 2, "nccl", env, timeout)
        return "nccl", env, "nccl: two ranks on one GPU accepted"
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1][:200]
    env = {**env, "PARTITA_COLLECTIVES": "all_reduce"}
    return (
        "gloo",
        env,
        f"gloo (NCCL refused two ranks on one GPU: {reason}); reduce-scatter and all-gather as all-reduces",
    )
