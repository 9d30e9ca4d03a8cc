"""How the harness starts rank processes: forked from a fork server that imported torch once
per session, or (fallback) spawned as fresh interpreters.

A spawned rank imports torch (about 2 s of CPU) and, at its first optimizer, torch._dynamo
(about 2 s more): on a 2-core machine a 4-rank test paid 8-15 s before its first collective, most
of a short test's time. Python's "forkserver" start method runs one server process that imports
`PRELOAD` once; each rank is then a `fork` of it (milliseconds).

What a forked rank still gets fresh, as a spawned one does:
- partita and the test's own modules are imported in the rank (only `PRELOAD` is not);
- the environment is this process's at the call (`rank_environ`: the rank replaces the
  server's whole environment with it), not the server's from when it started;
- stdout and stderr are this process's at the call (`InheritedStdio`), so pytest's capture of
  the calling test holds the ranks' output;
- the working directory and `sys.path` (multiprocessing's preparation data, as for spawn).

The server never runs a tensor op (no OpenMP pool exists to be forked) and is single-threaded
in Python. Variables that torch and its libraries read at import (`_IMPORT_TIME_ENV`) cannot
reach a rank forked from a server that imported torch under other values: a run whose
environment differs there from the server's starts by spawn instead.
``PARTITA_TEST_START_METHOD=spawn`` spawns every run (for comparison, or when a fork server
misbehaves).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
from collections.abc import Callable
from multiprocessing import forkserver, reduction
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

from partita.platform import env as env_vars

PRELOAD = ["torch", "torch._dynamo"]
"""Modules the fork server imports once (torch's optimizers import torch._dynamo lazily)."""

# Read by torch, oneDNN, MKL, OpenMP, OpenBLAS or the interpreter when they load, or by a
# start-up hook (partita-as-deepspeed.pth reads PARTITA_AS_DEEPSPEED). The thread
# counts are left out: the harness sets them per world size and each rank applies them with
# torch.set_num_threads, which overrides what OpenMP and MKL read at load.
_IMPORT_TIME_ENV = re.compile(
    r"^(ATEN_|ONEDNN_|DNNL_|MKL_|OMP_|KMP_|GOMP_|OPENBLAS_|TORCH|PYTORCH_|CUDA_|LD_|PYTHON"
    rf"|{re.escape(env_vars.AS_DEEPSPEED.name)}$)"
)
_SET_PER_RANK = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS"})
# Set by torch itself in whatever process first asks inductor for its cache folder (always the
# same default path), and read then, not at import: a caller that had not yet asked when the
# server started must not make every later run spawn.
_SET_LAZILY_BY_TORCH = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
_NOT_COMPARED = _SET_PER_RANK | _SET_LAZILY_BY_TORCH

_server_env: tuple[int, dict[str, str]] | None = None
"""(fork server pid, the environment it was started with)."""
_server_lock = threading.Lock()
"""Held while the server is checked or started (runs may start from several threads)."""


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if _IMPORT_TIME_ENV.match(k) and k not in _NOT_COMPARED}


def start_context(env: dict[str, str]) -> tuple[SpawnContext | ForkServerContext, int]:
    """The multiprocessing context that starts this run's ranks, and the pid their parent
    will have (this process for spawn, the fork server for forkserver). `env`: the ranks'
    environment, from `rank_environ`."""
    spawn_ctx = multiprocessing.get_context("spawn")
    assert isinstance(spawn_ctx, SpawnContext)
    spawn = spawn_ctx, os.getpid()
    if env_vars.harness_start_method() == "spawn":
        return spawn
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:  # a platform without it
        return spawn
    assert isinstance(ctx, ForkServerContext)
    with _server_lock:
        server = _ensure_server(ctx)
    if server is None or _import_time_env(env) != _import_time_env(server[1]):
        return spawn
    return ctx, server[0]


def _ensure_server(ctx: ForkServerContext) -> tuple[int, dict[str, str]] | None:
    """Starts the fork server if it is not running (waiting until it has imported `PRELOAD`);
    its pid and the environment it started with (None if it has no pid)."""
    global _server_env
    ctx.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    if not isinstance(pid, int):
        return None
    if _server_env is None or _server_env[0] != pid:  # started (again) just now
        _server_env = (pid, dict(os.environ))
        # The first start waits while the server imports PRELOAD (seconds). Waited for here,
        # on a process that exits at once, rather than inside a rank's start: a test
        # interrupted there would leave a rank the harness never learnt the pid of.
        warm = ctx.Process(target=_noop, name="partita-forkserver-warm-up")
        warm.start()
        warm.join()
    return _server_env


def _noop() -> None:
    """Target of the warm-up process."""


def start_process(target: Callable[..., Any], *args: Any, name: str | None = None) -> BaseProcess:
    """Starts ``target(*args)`` in a new process as the harness starts ranks (forked from the
    fork server when it can), with this process's environment and stdout/stderr, and returns
    it started; no process group, no supervision. For tests that run their own processes
    (`target` and `args` must be picklable)."""
    env = rank_environ({})
    ctx, _ = start_context(env)
    proc = ctx.Process(target=_process_main, args=(target, args, env, InheritedStdio()), name=name)
    proc.start()
    return proc


def _process_main(
    target: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str], stdio: Any
) -> None:
    """`start_process`'s process: this harness's output and environment, then the target."""
    stdio.install()
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def server_pid() -> int | None:
    """The pid of the harness's fork server, once started (None before, or under spawn)."""
    return None if _server_env is None else _server_env[0]


def rank_environ(env: dict[str, str]) -> dict[str, str]:
    """A rank's whole environment: this process's now, with `env` on top."""
    return {**os.environ, **env}


class InheritedStdio:
    """This process's stdout and stderr file descriptors, handed to a rank as it starts.

    Pickled while multiprocessing starts the process, it passes duplicates of fds 1 and 2
    (`reduction.DupFd`; spawn and forkserver both can), and the rank's `install` puts them
    on its own 1 and 2: a forked rank would otherwise write wherever the fork server's
    stdout pointed when it started (an earlier test's capture).
    """

    def __init__(self) -> None:
        self.fds = [fd for fd in (1, 2) if _is_open(fd)]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ReceivedStdio, ([(fd, reduction.DupFd(fd)) for fd in self.fds],))


class _ReceivedStdio:
    """`InheritedStdio` on the rank's side."""

    def __init__(self, handles: list[tuple[int, Any]]) -> None:
        self.handles = handles

    def install(self) -> None:
        """Makes the received descriptors this process's stdout and stderr."""
        for target, handle in self.handles:
            fd = handle.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
