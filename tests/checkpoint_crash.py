"""Crash-safety trials: SIGKILL one rank of a 2-rank job at a random moment of a save.

Spawning fresh interpreters per trial would cost seconds each, so a spawned "zygote" process
imports torch and partita once (and runs no torch op, so no thread pool exists yet) and forks
the two ranks of every trial; each pair joins a new gloo group over a fresh FileStore. A trial's
ranks load the newest checkpoint (tag=None), then train and save after every step. The zygote
picks one of the trial's saves, waits for the chosen rank to report entering it, sleeps a random
fraction of that rank's mean save time, and SIGKILLs it (the survivor is killed after a grace
period if it has not failed by itself). Every rank reports over its own pipe (a killed writer
cannot wedge a shared lock): the step and path it loaded, its per-step losses, and, after its
first save in a trial, any leftovers of earlier interrupted saves it still sees.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import Any

STEPS_PER_TRIAL = 4
SURVIVOR_GRACE_S = 0.3


def _child(rank: int, store_path: str, ckpt: str, steps: int, conn: Connection) -> None:
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
    conn.send(("ready",))
    if ckpt:
        path, _ = engine.load_checkpoint(ckpt)
        conn.send(("loaded", engine.global_steps, path))
    batches = cw._batches(loader)
    target = engine.global_steps + steps
    saves = 0
    while engine.global_steps < target:
        step = engine.global_steps
        conn.send(("loss", step, cw._train_steps(engine, batches, 1)))
        if not ckpt:
            continue  # the reference run: no saves
        saves += 1
        conn.send(("save_start", saves, time.perf_counter()))
        start = time.perf_counter()
        engine.save_checkpoint(ckpt)
        conn.send(("save_end", saves, time.perf_counter() - start))
        if saves == 1 and rank == 0:
            conn.send(("leftovers", leftovers(ckpt)))
    conn.send(("done",))
    conn.close()


def leftovers(ckpt: str) -> list[str]:
    """Temporary files, folders without a manifest and stale call markers in `ckpt`."""
    found = []
    for name in os.listdir(ckpt):
        path = os.path.join(ckpt, name)
        if name.startswith(".partita-tmp-"):
            found.append(name)
        elif name == ".partita-calls":
            found += [f"{name}/{m}" for m in os.listdir(path)]
        elif os.path.isdir(path):
            inner = os.listdir(path)
            if "manifest.json" not in inner:
                found.append(f"{name}/ (no manifest)")
            found += [f"{name}/{m}" for m in inner if m.startswith(".partita-tmp-")]
    return found


def complete_checkpoints(ckpt: str) -> list[list[Any]]:
    """[saved_at, tag, global_steps] of every folder with a manifest, oldest first."""
    found = []
    for name in os.listdir(ckpt) if ckpt else []:
        manifest = os.path.join(ckpt, name, "manifest.json")
        if os.path.isfile(manifest):
            with open(manifest) as f:
                m = json.load(f)
            found.append([m["saved_at"], name, m["counters"]["global_steps"]])
    return sorted(found)


def _run_pair(
    root: str,
    trial: int,
    ckpt: str,
    kill: tuple[int, int, float] | None,
    save_times: list[float],
    steps: int = STEPS_PER_TRIAL,
) -> dict[str, Any]:
    """Forks one trial's two ranks; `kill` = (rank, save index, fraction of a mean save)."""
    ctx = multiprocessing.get_context("fork")
    complete_before = complete_checkpoints(ckpt)
    began = time.perf_counter()
    store = os.path.join(root, f"store-{trial}")
    procs, conns = [], []
    for rank in range(2):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(rank, store, ckpt, steps, child), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    report: dict[str, Any] = {"trial": trial, "loaded": {}, "losses": {}, "leftovers": None,
                              "killed": None, "complete_before": complete_before}  # fmt: skip
    open_conns = {id(c): (r, c) for r, c in enumerate(conns)}
    deadline = time.monotonic() + 120
    killed_at = None
    while open_conns and time.monotonic() < deadline:
        if killed_at is not None and time.monotonic() - killed_at > SURVIVOR_GRACE_S:
            break
        for c in wait([c for _, c in open_conns.values()], timeout=0.2):
            rank = next(r for r, cc in open_conns.values() if cc is c)
            try:
                msg = c.recv()
            except (EOFError, OSError):
                del open_conns[id(c)]
                continue
            kind = msg[0]
            if kind == "loaded":
                report["loaded"][rank] = [msg[1], msg[2]]
            elif kind == "ready":
                report.setdefault("ready", time.perf_counter() - began)
            elif kind == "loss":
                report["losses"].setdefault(rank, {})[msg[1]] = msg[2]
            elif kind == "leftovers":
                report["leftovers"] = msg[1]
            elif kind == "save_end":
                save_times.append(msg[2])
            elif kind == "save_start" and kill and rank == kill[0] and msg[1] == kill[1]:
                mean = sum(save_times[-20:]) / max(1, len(save_times[-20:])) or 0.05
                time.sleep(kill[2] * mean)
                os.kill(procs[rank].pid, signal.SIGKILL)
                killed_at = time.monotonic()
                report["killed"] = [rank, msg[1], kill[2] * mean]
    for p in procs:
        p.join(None if killed_at is None and not open_conns else 0)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join()
    report["exitcodes"] = [p.exitcode for p in procs]
    report["seconds"] = time.perf_counter() - began
    return report


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
    save_times: list[float] = []
    ref_steps = (trials + 2) * STEPS_PER_TRIAL
    reports = {"reference": _run_pair(root, 0, "", None, save_times, ref_steps), "trials": []}
    for t in range(1, trials + 1):
        kill = (rng.randrange(2), rng.randint(1, STEPS_PER_TRIAL), rng.random())
        reports["trials"].append(_run_pair(root, t, ckpt, kill, save_times))
    reports["final"] = _run_pair(root, trials + 1, ckpt, None, save_times)
    reports["final_leftovers"] = leftovers(ckpt)
    reports["save_times"] = save_times
    path = os.path.join(root, "reports.json")
    with open(path, "w") as f:
        json.dump(reports, f)
    return path


def run_crash_trials(root: str, trials: int, seed: int, timeout: float) -> dict[str, Any]:
    """Spawns the zygote, waits for it, returns the reports."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=crash_trials, args=(root, trials, seed))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"crash trials did not finish in {timeout} s")
    if proc.exitcode != 0:
        raise RuntimeError(f"crash-trial zygote exited with {proc.exitcode}")
    with open(os.path.join(root, "reports.json")) as f:
        return json.load(f)  # type: ignore[no-any-return]
