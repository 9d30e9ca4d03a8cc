"""Crash-safety trials: SIGKILL one rank of a 2-rank job at a random point inside a save.

Spawning fresh interpreters per trial would cost seconds each, so a "zygote" process (started by
`partita.testing.start_process`: forked from the harness's fork server, torch already imported)
imports partita once (and runs no torch op, so no thread pool exists yet) and forks the two
ranks of every trial; each pair joins a new gloo group over a fresh FileStore. A trial's
ranks load the newest checkpoint (tag=None), save at once (a re-save of the tag just loaded, as
a job restarted at global_stepN does), then train and save after every step, alternating
between the default tag (global_stepN, new) and a fixed tag "rolling" (re-saved every other
step). Every rank reports over its own pipe (a killed writer cannot wedge a shared lock): the
step and path it loaded, its per-step losses, and, after its first save in a trial, any
leftovers of earlier interrupted saves it still sees.

[Note: where kills land]
The victim kills itself, so every kill counted lands inside a save: while it is inside
``engine.save_checkpoint`` (a flag set just before the call and cleared just after it returns),
a profile hook counts Python and C function calls, and at the chosen count sends ("dying",
where) and SIGKILLs its own process. The count is a random fraction of the fewest calls a save
of the same kind made so far (a re-save of an existing tag and a save of a new tag differ;
counted by a calibration trial and every completed save since), so the kill lands inside the
save the trial chose, whatever the machine's speed does to the number of calls (waits for the
writer threads poll). Half the trials count every call (most of them build the manifest and the shards), half
only filesystem calls (writes, fsync, renames, the swap, `latest`, lock and clean-up), so kills
land between every pair of filesystem steps too. If the save makes fewer calls than chosen,
the count carries over into the next save of the trial; a kill that never happens is reported
as not landed. A kill between two calls leaves the files as a kill at any instant of that
interval would (writes are chunked, commits are renames).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Any

STEPS_PER_TRIAL = 4
SURVIVOR_GRACE_S = 0.3
ROLLING = "rolling"


def _is_io(func: Any) -> bool:
    """True for a C call that touches the filesystem: an ``os``/``fcntl`` function, a method
    of an open file, or a ctypes function (``renameat2``)."""
    if getattr(func, "__module__", None) in ("posix", "fcntl"):
        return getattr(func, "__name__", "") not in _NOT_IO
    owner = getattr(func, "__self__", None)
    return type(owner).__name__ in _FILES or type(func).__name__ == "_FuncPtr"


_NOT_IO = {"fspath", "getpid", "urandom", "strerror", "fsencode", "fsdecode"}
_FILES = {"BufferedWriter", "BufferedReader", "FileIO", "TextIOWrapper"}


class _Killer:
    """Counts calls (and filesystem calls) inside saves; SIGKILLs this process at the chosen
    one (see the module note)."""

    def __init__(
        self, conn: Connection, arm: tuple[int, float, dict[bool, float], str] | None
    ) -> None:
        self.conn, self.inside, self.save, self.resave = conn, False, 0, False
        self.counts = {"call": 0, "io": 0}
        # arm = (save index, fraction, {re-save?: fewest calls of such a save}, "call"/"io").
        self.arm = arm
        self.left: int | None = None

    def enter(self, save: int, resave: bool) -> None:
        self.save, self.inside, self.resave = save, True, resave
        self.counts = {"call": 0, "io": 0}
        if self.arm is not None and save == self.arm[0]:
            self.left = max(1, int(self.arm[1] * self.arm[2][resave]))

    def leave(self) -> dict[str, int]:
        self.inside = False
        return self.counts

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.inside or event not in ("call", "c_call"):
            return
        io = event == "c_call" and _is_io(arg)
        self.counts["call"] += 1
        self.counts["io"] += io
        if self.left is None or self.arm is None or (self.arm[3] == "io" and not io):
            return
        self.left -= 1
        if self.left <= 0:
            where = frame.f_code.co_name if event == "call" else getattr(arg, "__name__", "?")
            self.conn.send(("dying", self.save, self.arm[3], where, self.resave))
            os.kill(os.getpid(), signal.SIGKILL)


def _child(rank: int, store_path: str, ckpt: str, steps: int, conn: Connection, arm: Any) -> None:
    """One rank of one trial (runs in a forked process)."""
    import torch
    import torch.distributed as dist

    import checkpoint_workers as cw
    from partita import comm

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    store = dist.FileStore(store_path, 2)
    comm.init_distributed(dist_backend="gloo", rank=rank, world_size=2, store=store, timeout=60)
    engine, loader = cw._resume_engine(2, seed=11)
    killer = _Killer(conn, arm)
    sys.setprofile(killer)
    conn.send(("ready",))
    saves = 0

    def save(tag: str | None) -> None:
        nonlocal saves
        saves += 1
        name = tag or f"global_step{engine.global_steps}"
        resave = os.path.isfile(os.path.join(ckpt, name, "manifest.json"))
        start = time.perf_counter()
        killer.enter(saves, resave)
        engine.save_checkpoint(ckpt, tag=tag)
        counts = killer.leave()
        conn.send(("save_end", saves, time.perf_counter() - start, counts, resave))
        if saves == 1 and rank == 0:
            conn.send(("leftovers", leftovers(ckpt)))

    if ckpt:
        path, _ = engine.load_checkpoint(ckpt)
        conn.send(("loaded", engine.global_steps, path))
        save(None)
    batches = cw._batches(loader)
    target = engine.global_steps + steps
    while engine.global_steps < target:
        step = engine.global_steps
        conn.send(("loss", step, cw._train_steps(engine, batches, 1)))
        if ckpt:
            save(None if engine.global_steps % 2 else ROLLING)
    sys.setprofile(None)
    conn.send(("done",))
    conn.close()


def leftovers(ckpt: str) -> list[str]:
    """Staging folders, lock and temporary files, folders without a manifest, hidden files in
    checkpoint folders and stale call markers in `ckpt`."""
    found = []
    for name in os.listdir(ckpt):
        path = os.path.join(ckpt, name)
        if name == ".partita-calls":
            found += [f"{name}/{m}" for m in os.listdir(path)]
        elif name.startswith("."):
            found.append(name)
        elif os.path.isdir(path):
            inner = os.listdir(path)
            if "manifest.json" not in inner:
                found.append(f"{name}/ (no manifest)")
            found += [f"{name}/{m}" for m in inner if m.startswith(".")]
    return found


def complete_checkpoints(ckpt: str) -> list[list[Any]]:
    """[saved_at, tag, global_steps] of every folder with a manifest, oldest first."""
    found = []
    for name in os.listdir(ckpt) if ckpt else []:
        manifest = os.path.join(ckpt, name, "manifest.json")
        if not name.startswith(".") and os.path.isfile(manifest):
            with open(manifest) as f:
                m = json.load(f)
            found.append([m["saved_at"], name, m["counters"]["global_steps"]])
    return sorted(found)


def _run_pair(
    root: str,
    trial: int,
    ckpt: str,
    kill: tuple[int, int, float, str] | None,
    calls: list[dict[str, int]],
    steps: int = STEPS_PER_TRIAL,
) -> dict[str, Any]:
    """Forks one trial's two ranks; `kill` = (rank, save index, fraction of a save's calls,
    "call" or "io": which calls, see the module note); `calls` collects the counts of each
    completed save."""
    ctx = multiprocessing.get_context("fork")
    complete_before = complete_checkpoints(ckpt)
    began = time.perf_counter()
    store = os.path.join(root, f"store-{trial}")
    procs, conns = [], []
    for rank in range(2):
        parent, child = ctx.Pipe(duplex=False)
        arm = None
        if kill and kill[0] == rank:
            arm = (kill[1], kill[2], _fewest_calls(calls, kill[3]), kill[3])
        p = ctx.Process(target=_child, args=(rank, store, ckpt, steps, child, arm), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    report: dict[str, Any] = {"trial": trial, "loaded": {}, "losses": {}, "leftovers": None,
                              "killed": None, "complete_before": complete_before,
                              "armed": kill}  # fmt: skip
    _collect(conns, report, calls)
    for p in procs:
        p.join(None if report["killed"] is None else SURVIVOR_GRACE_S)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join()
    report["exitcodes"] = [p.exitcode for p in procs]
    report["seconds"] = time.perf_counter() - began
    return report


def _fewest_calls(calls: list[dict[str, int]], kind: str) -> dict[bool, float]:
    """Per kind of save (re-save or not), the fewest `kind` calls a completed save made (of
    either kind while none of that one completed yet)."""
    every = [c[kind] for c in calls]
    out = {}
    for resave in (False, True):
        same = [c[kind] for c in calls if bool(c["resave"]) == resave]
        out[resave] = float(min(same or every or [1]))
    return out


def _collect(conns: list[Connection], report: dict[str, Any], calls: list[dict[str, int]]) -> None:
    """Reads every rank's messages until both pipes close (or 120 s pass)."""
    open_conns = dict(enumerate(conns))
    deadline = time.monotonic() + 120
    while open_conns and time.monotonic() < deadline:
        for c in wait(list(open_conns.values()), timeout=0.2):
            rank = next(r for r, cc in open_conns.items() if cc is c)
            try:
                msg = c.recv()
            except (EOFError, OSError):
                del open_conns[rank]
                continue
            kind = msg[0]
            if kind == "loaded":
                report["loaded"][rank] = [msg[1], msg[2]]
            elif kind == "loss":
                report["losses"].setdefault(rank, {})[msg[1]] = msg[2]
            elif kind == "leftovers":
                report["leftovers"] = msg[1]
            elif kind == "save_end":
                calls.append({**msg[3], "resave": msg[4]})
            elif kind == "dying":  # [rank, save index, "call"/"io", function, re-save?]
                report["killed"] = [rank, *msg[1:]]


def crash_trials(root: str, trials: int, seed: int) -> str:
    """Runs the reference pair, `trials` killed pairs and a final clean pair; writes the
    reports to ``root/reports.json`` and returns its path (runs in the spawned zygote)."""
    os.environ["PARTITA_ACCELERATOR"] = "cpu"
    os.environ["PARTITA_CHECKPOINT_TIMEOUT_S"] = "5"
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: seconds per fork)

    import checkpoint_workers  # noqa: F401
    import partita.api
    import partita.checkpoint
    import partita.optim  # noqa: F401

    rng = random.Random(seed)
    ckpt = os.path.join(root, "ckpt")
    os.makedirs(ckpt)
    calls: list[dict[str, int]] = []
    ref_steps = (trials + 2) * STEPS_PER_TRIAL
    reports = {"reference": _run_pair(root, 0, "", None, calls, ref_steps), "trials": []}
    # Calibration: one clean trial measures how many calls a save makes (then every trial's
    # completed saves refine it).
    os.makedirs(os.path.join(root, "calibration"))
    reports["calibration"] = _run_pair(root, -1, os.path.join(root, "calibration"), None, calls)
    for t in range(1, trials + 1):
        kill = (
            rng.randrange(2),
            rng.randint(1, STEPS_PER_TRIAL + 1),
            rng.random(),
            rng.choice(["call", "io"]),
        )
        reports["trials"].append(_run_pair(root, t, ckpt, kill, calls))
    reports["final"] = _run_pair(root, trials + 1, ckpt, None, calls)
    reports["final_leftovers"] = leftovers(ckpt)
    reports["save_calls"] = calls
    path = os.path.join(root, "reports.json")
    with open(path, "w") as f:
        json.dump(reports, f)
    return path


def run_crash_trials(root: str, trials: int, seed: int, timeout: float) -> dict[str, Any]:
    """Starts the zygote (forked from the harness's fork server, which has imported torch),
    waits for it, returns the reports."""
    from partita.testing import start_process

    proc = start_process(crash_trials, root, trials, seed, name="crash-trial-zygote")
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"crash trials did not finish in {timeout} s")
    if proc.exitcode != 0:
        raise RuntimeError(f"crash-trial zygote exited with {proc.exitcode}")
    with open(os.path.join(root, "reports.json")) as f:
        return json.load(f)  # type: ignore[no-any-return]
