"""Stand-in for ``mpirun`` (OpenMPI or MPICH flavour), ``srun`` and ``pdsh`` in the launcher
tests: ``fake_scheduler.py TOOL ARGS...`` records its argv and the variables partita gave it
in ``$FAKE_LOG/<TOOL>.json``, then starts the ranks here, as the real tool would on the hosts,
with the variables the real tool sets for each (OpenMPI's ``OMPI_COMM_WORLD_*``, MPICH's
``PMI_*``/``MPI_LOCAL*``, Slurm's ``SLURM_*``), and exits with the highest rank status.

Only the options partita's commands use are understood; anything else is an error, so a
command partita builds wrongly fails here. Every rank runs on this machine: the "nodes" of a
test differ in ``--node_rank`` only. ``pdsh`` runs its command once per host of ``-w`` with
``%n`` replaced by the host's index, through ``bash -c`` as the remote shell would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_GUARD_S = 240  # a rank still running after this is a hang: the tool fails


def _mpirun(args: list[str], flavour: str) -> tuple[list[dict[str, str]], list[str]]:
    count, ppn, env = 0, 0, {}
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt in ("-n", "-np"):
            count = int(args.pop(0))
        elif opt == "-ppn" and flavour == "mpich":
            ppn = int(args.pop(0))
        elif opt in ("-hostfile", "-hosts"):
            args.pop(0)
        elif opt == "--mca" and flavour == "openmpi":
            args[:2] = []
        elif opt == "-x" and flavour == "openmpi":
            key, _, value = args.pop(0).partition("=")
            env[key] = value
        elif opt == "-genv" and flavour == "mpich":
            key, value = args.pop(0), args.pop(0)
            env[key] = value
        else:
            raise SystemExit(f"fake mpirun ({flavour}): unexpected option {opt!r}")
    ranks = []
    for rank in range(count):
        if flavour == "openmpi":
            ranks.append(
                {
                    **env,
                    "OMPI_COMM_WORLD_RANK": str(rank),
                    "OMPI_COMM_WORLD_SIZE": str(count),
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
                    "OMPI_COMM_WORLD_LOCAL_SIZE": str(count),
                }
            )
        else:
            ranks.append(
                {
                    **env,
                    "PMI_RANK": str(rank),
                    "PMI_SIZE": str(count),
                    "MPI_LOCALRANKID": str(rank % ppn),
                    "MPI_LOCALNRANKS": str(ppn),
                }
            )
    return ranks, args


def _srun(args: list[str]) -> tuple[list[dict[str, str]], list[str]]:
    count, nodes, env = 0, 1, {}
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt == "-n":
            count = int(args.pop(0))
        elif opt == "--nodes":
            nodes = int(args.pop(0))
        elif opt in ("--nodelist", "--gpus-per-node"):
            args.pop(0)
        elif opt.startswith("--export=ALL"):
            for pair in filter(None, opt.removeprefix("--export=ALL").split(",")):
                key, _, value = pair.partition("=")
                env[key] = value
        else:
            raise SystemExit(f"fake srun: unexpected option {opt!r}")
    per_node = count // nodes
    ranks = [
        {
            **env,
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(count),
            "SLURM_LOCALID": str(rank % per_node),
            "SLURM_NODEID": str(rank // per_node),
            "SLURM_NNODES": str(nodes),
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        }
        for rank in range(count)
    ]
    return ranks, args


def _pdsh(args: list[str]) -> list[subprocess.Popen[bytes]]:
    hosts: list[str] = []
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt == "-w":
            hosts = args.pop(0).split(",")
        elif opt == "-f":
            args.pop(0)
        elif opt != "-S":
            raise SystemExit(f"fake pdsh: unexpected option {opt!r}")
    command = " ".join(args)
    return [
        subprocess.Popen(["bash", "-c", command.replace("%n", str(index))])
        for index in range(len(hosts))
    ]


def main() -> int:
    """Records the call, runs the ranks, returns the highest status."""
    tool, args = sys.argv[1], sys.argv[2:]
    flavour = os.environ.get("FAKE_MPI_FLAVOUR", "openmpi")
    seen = {"argv": args, "PDSH_RCMD_TYPE": os.environ.get("PDSH_RCMD_TYPE")}
    Path(os.environ["FAKE_LOG"], f"{tool}.json").write_text(json.dumps(seen))
    if tool == "pdsh":
        procs = _pdsh(list(args))
    else:
        ranks, command = _mpirun(list(args), flavour) if tool == "mpirun" else _srun(list(args))
        procs = [subprocess.Popen(command, env={**os.environ, **env}) for env in ranks]
    status = 0
    for proc in procs:
        try:
            status = max(status, proc.wait(timeout=_GUARD_S))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            return 124
    return status


if __name__ == "__main__":
    sys.exit(main())
