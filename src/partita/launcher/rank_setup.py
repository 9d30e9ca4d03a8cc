"""Per-rank set-up in the worker process, before the script: cores, log file, scheduler ranks.

``python -u -m partita.launcher.rank_setup [--cores LIST] [--log PREFIX] [--local_rank]
-- WORKER_EXEC_ARGV...`` runs in the worker itself (the agent, ``mpirun`` or ``srun`` starts
it), does what DeepSpeed's ``launch.py`` does per rank, then hands over to
`partita.launcher.worker_exec` in this same interpreter (its parent-death check still sees
the agent as the parent):

- ``--cores LIST`` (DeepSpeed's ``--bind_cores_to_rank`` / ``--bind_core_list``): the node's
  cores are split evenly over its ranks in local-rank order, ``len(LIST) // ranks`` each, the
  rest left idle; this rank runs only on its share (``sched_setaffinity``, what ``numactl -C``
  does) and ``OMP_NUM_THREADS`` is that share's size;
- ``--log PREFIX`` (``--enable_each_rank_log DIR``): stdout and stderr go, appended, to
  ``PREFIX_rank<RANK>.log``;
- ranks started by a scheduler (OpenMPI's ``OMPI_COMM_WORLD_*``, MPICH's ``PMI_*``, Slurm's
  ``SLURM_*``) also get torch's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE`` (`partita.platform.cluster_env`), as DeepSpeed's MPICH helper and
  ``init_distributed`` set them; ``--local_rank`` passes ``--local_rank=<N>`` first to the
  script, as the agent does for its workers.

Imports nothing heavy: it runs once per worker start.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from partita.launcher import worker_exec
from partita.platform import cluster_env

__all__ = ["cores_for_rank", "format_core_list", "main", "parse_core_list", "physical_cores"]


def parse_core_list(text: str) -> list[int]:
    """CPU ids from DeepSpeed's ``--bind_core_list`` syntax: ``1,3-5,7`` is [1, 3, 4, 5, 7];
    items ascending and not overlapping. Raises ValueError naming the bad item."""
    cores: list[int] = []
    for item in text.split(","):
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"bad core range {item!r} in {text!r} (expected N or N-M)")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"core range {item!r} in {text!r} ends before it starts")
        if cores and first <= cores[-1]:
            raise ValueError(f"core ranges in {text!r} must ascend without overlapping")
        cores.extend(range(first, last + 1))
    return cores


def format_core_list(cores: Sequence[int]) -> str:
    """The shortest ``parse_core_list`` text for ascending ``cores``: [0, 1, 2, 5] is ``0-2,5``."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def physical_cores() -> list[int]:
    """One CPU id per physical core this process may run on: of the hyperthreads of a core,
    the lowest allowed (DeepSpeed takes ids 0..physical cores-1, which is that on Linux's
    usual numbering, but may name CPUs a container does not give it)."""
    allowed = sorted(os.sched_getaffinity(0))
    chosen = []
    for cpu in allowed:
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path, encoding="ascii") as handle:
                siblings = parse_core_list(handle.read().strip())
        except (OSError, ValueError):
            siblings = [cpu]
        if min(s for s in siblings if s in allowed or s == cpu) == cpu:
            chosen.append(cpu)
    return chosen


def cores_for_rank(cores: Sequence[int], local_world: int, local_rank: int) -> list[int]:
    """Local rank ``local_rank``'s share of ``cores``: ``len(cores) // local_world`` of them,
    in order (DeepSpeed's split). Raises ValueError when a rank would get none."""
    per_rank = len(cores) // local_world
    if per_rank < 1:
        raise ValueError(
            f"{len(cores)} core(s) ({format_core_list(cores)}) cannot be split over "
            f"{local_world} ranks of this node: each needs at least one"
        )
    return list(cores[per_rank * local_rank : per_rank * (local_rank + 1)])


def _scheduler_ranks() -> tuple[int, int]:
    """(rank, local rank); fills in torch's variables for a rank a scheduler started."""
    if "RANK" not in os.environ:
        where = cluster_env.detect()
        os.environ.update(
            RANK=str(where.rank),
            WORLD_SIZE=str(where.world_size),
            LOCAL_RANK=str(where.local_rank),
            LOCAL_WORLD_SIZE=str(where.local_world_size),
        )
    return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))


def _redirect(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _with_local_rank(argv: list[str], local_rank: int) -> list[str]:
    """``argv`` of worker_exec with ``--local_rank=N`` before the script's own arguments."""
    skip = 2 if argv[0] in (worker_exec.RUN_PATH, worker_exec.RUN_MODULE) else 1
    return [*argv[:skip], f"--local_rank={local_rank}", *argv[skip:]]


def main(argv: Sequence[str]) -> int:
    """Sets this rank up, then runs `partita.launcher.worker_exec` with the rest of ``argv``."""
    parser = argparse.ArgumentParser(prog="python -m partita.launcher.rank_setup")
    parser.add_argument("--cores", type=parse_core_list)
    parser.add_argument("--log")
    parser.add_argument("--local_rank", action="store_true")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    rank, local_rank = _scheduler_ranks()
    if args.log is not None:
        _redirect(f"{args.log}_rank{rank}.log")
    if args.cores is not None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        mine = cores_for_rank(args.cores, local_world, local_rank)
        os.sched_setaffinity(0, mine)
        os.environ["OMP_NUM_THREADS"] = str(len(mine))
    if args.local_rank:
        rest = _with_local_rank(rest, local_rank)
    return worker_exec.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
