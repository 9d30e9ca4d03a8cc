"""Per-rank bodies for `test_checkpoint_hostile`: failed re-saves, `latest` fallback, hostile
checkpoint folders (paths leading out, wrong stored dtype or length, broken manifests
elsewhere) and clean-up next to another job's in-flight save. One world-2 spawn runs them all.

Every case records what happened as plain data (error class and message, which folder was
loaded, whether the loaded weights equal the ones saved) and the test asserts on it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import torch

import partita
from models import global_batches, make_model
from partita import comm

TAG = "ckpt"
BATCH = 4


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH // comm.get_world_size(),
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
    }


def _engine(seed: int) -> Any:
    model = make_model(seed=seed, frozen=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = partita.initialize(model=model, model_parameters=trainable, config=_config())
    return engine


def _train(engine: Any, steps: int, seed: int) -> None:
    rank, world = comm.get_rank(), comm.get_world_size()
    per = BATCH // world
    for tokens, targets in global_batches(steps, BATCH, seed=seed):
        sl = slice(rank * per, (rank + 1) * per)
        engine.backward(engine(tokens[sl], targets[sl]))
        engine.step()


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """("ok", repr of the result) or (exception class, message)."""
    try:
        return "ok", repr(fn())
    except Exception as e:
        return type(e).__name__, str(e)


class _Warnings(logging.Handler):
    """Collects the messages of the "partita" logger at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    handler = _Warnings()
    logging.getLogger("partita").addHandler(handler)
    try:
        yield handler.messages
    finally:
        logging.getLogger("partita").removeHandler(handler)


class _FullDisk:
    """A file object that fails with ENOSPC once `budget` bytes have been written."""

    def __init__(self, f: Any, budget: int) -> None:
        self._f, self._left = f, budget

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self._left:
            self._f.write(memoryview(data).cast("B")[: self._left])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= size
        return int(self._f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def _disk_full(ranks: set[int], name_part: str, budget: int = 100) -> Iterator[None]:
    """On `ranks`, every checkpoint file whose name contains `name_part` fails with ENOSPC
    after `budget` bytes (patches the one `open` the atomic writer uses)."""
    from partita.checkpoint import atomic

    real = open

    def fake_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real(path, mode, *args, **kwargs)
        if "w" in mode and name_part in os.path.basename(str(path)):
            return _FullDisk(f, budget)
        return f

    if comm.get_rank() in ranks:
        atomic.open = fake_open  # type: ignore[attr-defined]
    try:
        yield
    finally:
        atomic.__dict__.pop("open", None)


def _on_rank0(fn: Callable[[], Any]) -> None:
    if comm.get_rank() == 0:
        fn()
    comm.barrier()


def _load_fresh(load_dir: str, **kwargs: Any) -> tuple[tuple[str, str], dict[str, Any] | None]:
    """A fresh engine (other weights) loads; (outcome, its weights if it loaded)."""
    engine = _engine(seed=77)
    out = _outcome(lambda: engine.load_checkpoint(load_dir, **kwargs)[0])
    weights = _weights(engine) if out[0] == "ok" else None
    engine.destroy()
    return out, weights


# --- failed re-saves ----------------------------------------------------------------------
def resave_cases(root: str) -> dict[str, Any]:
    """Re-saving an existing tag fails (disk full on one rank, or in rank 0's manifest); the
    previous content of the tag must stay loadable; a successful re-save replaces it."""
    out: dict[str, Any] = {}
    engine = _engine(seed=0)
    _train(engine, 1, seed=1)
    save_dir = os.path.join(root, "resave")
    engine.save_checkpoint(save_dir, tag=TAG)
    first = _weights(engine)
    _train(engine, 1, seed=2)
    for case, ranks, part in [("shard_rank1", {1}, "rank00001"), ("manifest", {0}, "manifest")]:
        with _disk_full(ranks, part):
            out[f"{case}:save"] = _outcome(lambda: engine.save_checkpoint(save_dir, tag=TAG))
        loaded, weights = _load_fresh(save_dir)
        out[f"{case}:load"] = (loaded, weights is not None and _same(weights, first))
        out[f"{case}:listing"] = sorted(os.listdir(save_dir))
    # The reviewer's second path: a save right after a load writes the loaded global_stepN.
    step_dir = os.path.join(root, "after_load")
    engine.save_checkpoint(step_dir)
    second = _weights(engine)
    resumed = _engine(seed=5)
    resumed.load_checkpoint(step_dir)
    with _disk_full({0, 1}, "rank0000"):
        out["after_load:save"] = _outcome(lambda: resumed.save_checkpoint(step_dir))
    resumed.destroy()
    loaded, weights = _load_fresh(step_dir)
    out["after_load:load"] = (loaded, weights is not None and _same(weights, second))
    # A re-save that succeeds replaces the content and leaves nothing behind.
    _train(engine, 1, seed=3)
    engine.save_checkpoint(save_dir, tag=TAG)
    third = _weights(engine)
    loaded, weights = _load_fresh(save_dir, tag=TAG)
    out["replaced:load"] = (loaded, weights is not None and _same(weights, third))
    out["replaced:listing"] = sorted(os.listdir(save_dir))
    out["replaced:folder"] = sorted(os.listdir(os.path.join(save_dir, TAG)))
    engine.destroy()
    return out


# --- `latest` fallback --------------------------------------------------------------------
def fallback_cases(root: str, base: str, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`latest` names a missing folder, or one without a manifest: the newest complete
    checkpoint loads, with a warning naming both."""

    def missing(d: str) -> None:
        _write(os.path.join(d, "latest"), "global_step99")

    def incomplete(d: str) -> None:
        os.makedirs(os.path.join(d, "half"))
        _write(os.path.join(d, "half", "rank00000-of-00002.safetensors"), "partial")
        _write(os.path.join(d, "latest"), "half")

    out: dict[str, Any] = {}
    for name, corrupt in {"latest_missing": missing, "latest_incomplete": incomplete}.items():
        copy = os.path.join(root, "fallback", name)
        _on_rank0(lambda c=copy, f=corrupt: (shutil.copytree(base, c), f(c)))  # type: ignore[misc]
        with _warnings() as warned:
            loaded, got = _load_fresh(copy)
        out[name] = (loaded, got is not None and _same(got, weights), warned)
    return out


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# --- hostile folders ----------------------------------------------------------------------
def _edit_manifest(folder: str, edit: Callable[[dict[str, Any]], None]) -> None:
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest)
    _write(path, json.dumps(manifest))


def _rename_file(folder: str, old: str, new: str) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["files"][new] = m["files"].pop(old)

    _edit_manifest(folder, edit)


def _rewrite_shard(folder: str, fname: str, change: Callable[[str, torch.Tensor], Any]) -> None:
    """Rewrites shard `fname` with `change(key, tensor)` applied (None: unchanged) and
    updates its size and digest in the manifest, so only the content check can object."""
    from safetensors.torch import load_file, save_file

    from partita.checkpoint.digest import ALGORITHM, file_digest

    path = os.path.join(folder, fname)
    tensors = load_file(path)
    for key, value in list(tensors.items()):
        new = change(key, value)
        if new is not None:
            tensors[key] = new
            break
    save_file(tensors, path, metadata={"format": "pt"})

    def edit(m: dict[str, Any]) -> None:
        m["files"][fname].update(bytes=os.path.getsize(path), digest={ALGORITHM: file_digest(path)})

    _edit_manifest(folder, edit)


def _first_param(kind: str) -> Callable[[str, torch.Tensor], Any]:
    def change(key: str, value: torch.Tensor) -> Any:
        if not key.startswith("param::"):
            return None
        if kind == "dtype":
            return value.double()
        return torch.cat([value, value[:1]]) if kind == "longer" else value[:-1]

    return change


def _module_as_half(key: str, value: torch.Tensor) -> Any:
    return value.half() if key.startswith("module::") else None


def hostile_variants(root: str) -> dict[str, tuple[Callable[[str], None], dict[str, Any]]]:
    """name -> (what rank 0 does to a copy of the save directory, load_checkpoint kwargs)."""
    shard0 = "rank00000-of-00002.safetensors"
    outside = os.path.join(root, "outside")

    def move_out(d: str, new_name: str) -> None:
        """Moves rank 0's shard out of the checkpoint and names it `new_name` in the manifest."""
        target = os.path.join(os.path.dirname(d), "x.safetensors")
        shutil.move(os.path.join(d, TAG, shard0), target)
        _rename_file(os.path.join(d, TAG), shard0, new_name.replace("ABS", target))

    def symlinked_shard(d: str) -> None:
        target = os.path.join(os.path.dirname(d), "x.safetensors")
        shutil.move(os.path.join(d, TAG, shard0), target)
        os.symlink(target, os.path.join(d, TAG, shard0))

    def symlinked_tag(d: str) -> None:
        os.symlink(os.path.join(outside, TAG), os.path.join(d, "linked"))

    def broken_other(d: str) -> None:
        os.makedirs(os.path.join(d, "unrelated"))
        bad = {"format": "partita-checkpoint", "format_version": 1, "saved_at": "yesterday",
               "tensors": {}, "files": {}, "world_size": 2, "zero_stage": 2,
               "counters": {"global_steps": "many"}}  # fmt: skip
        _write(os.path.join(d, "unrelated", "manifest.json"), json.dumps(bad))

    def bad_ranges(d: str) -> None:
        def edit(m: dict[str, Any]) -> None:
            ranges = m["files"][shard0]["ranges"]
            name = sorted(ranges)[0]
            ranges[name] = [[-4, "10"]]

        _edit_manifest(os.path.join(d, TAG), edit)

    def shard(change: Callable[[str, torch.Tensor], Any]) -> Callable[[str], None]:
        return lambda d: _rewrite_shard(os.path.join(d, TAG), shard0, change)

    return {
        "manifest_dotdot": (lambda d: move_out(d, "../../x.safetensors"), {}),
        "manifest_absolute": (lambda d: move_out(d, "ABS"), {}),
        "manifest_symlink": (symlinked_shard, {}),
        "latest_absolute": (lambda d: _write(os.path.join(d, "latest"), f"{outside}/{TAG}"), {}),
        "latest_dotdot": (lambda d: _write(os.path.join(d, "latest"), f"../../outside/{TAG}"), {}),
        "tag_dotdot": (lambda d: None, {"tag": f"../../outside/{TAG}"}),
        "tag_absolute": (lambda d: None, {"tag": os.path.join(outside, TAG)}),
        "tag_symlink": (symlinked_tag, {"tag": "linked"}),
        "stored_dtype": (shard(_first_param("dtype")), {}),
        "stored_longer": (shard(_first_param("longer")), {}),
        "stored_shorter": (shard(_first_param("shorter")), {}),
        "module_dtype": (shard(_module_as_half), {}),
        "bad_ranges": (bad_ranges, {}),
        "broken_other:asked": (broken_other, {"tag": "unrelated"}),
        "broken_other:latest": (broken_other, {}),
    }


def hostile_cases(root: str, base: str, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each variant applied to a fresh copy of `base` (the save directory); what a load of it
    does, and (rank 0) what `get_fp32_state_dict_from_zero_checkpoint` does."""
    from partita.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    _on_rank0(lambda: shutil.copytree(base, os.path.join(root, "outside")))
    out: dict[str, Any] = {}
    for name, (corrupt, kwargs) in hostile_variants(root).items():
        copy = os.path.join(root, name.replace(":", "-"), "save")
        _on_rank0(lambda c=copy, f=corrupt: (shutil.copytree(base, c), f(c)))  # type: ignore[misc]
        loaded, got = _load_fresh(copy, **kwargs)
        exported = ("skipped", "")
        if comm.get_rank() == 0:
            exported = _outcome(
                lambda c=copy, k=kwargs: len(  # type: ignore[misc]
                    get_fp32_state_dict_from_zero_checkpoint(c, k.get("tag"))
                )
            )
        out[name] = (loaded, got is not None and _same(got, weights), exported)
    return out


# --- clean-up next to another job ---------------------------------------------------------
def _dead_pid() -> int:
    """The pid of a child process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def sharing_cases(root: str) -> dict[str, Any]:
    """Another job's in-flight save (its lock held) and a manifest-less folder with shard
    names survive this job's save; a killed job's staging folder (lock free) is removed."""
    from partita.checkpoint import atomic

    save_dir = os.path.join(root, "shared")
    live, dead = "a" * 16, "b" * 16
    held = None
    if comm.get_rank() == 0:
        os.makedirs(os.path.join(save_dir, "other_job_step3"))
        _write(os.path.join(save_dir, "other_job_step3", "rank00000-of-00002.safetensors"), "x")
        for nonce in (live, dead):
            staging = atomic.staging_path(save_dir, nonce, "global_step1")
            os.makedirs(staging)
            _write(os.path.join(staging, "rank00001-of-00002.safetensors"), "in flight")
            _write(atomic.lock_path(save_dir, nonce), "")
        # Arrival markers of an earlier call: one of a live process of another job (this
        # rank's parent, the test harness), one of a process that has exited.
        calls = os.path.join(save_dir, ".partita-calls")
        os.makedirs(calls)
        host = socket.gethostname()
        _write(os.path.join(calls, "save-00000099-rank00000"), f"{host} pid {os.getppid()}\n")
        _write(os.path.join(calls, "save-00000099-rank00001"), f"{host} pid {_dead_pid()}\n")
        # A separate open file description: flock conflicts with it even in this process.
        held = open(atomic.lock_path(save_dir, live), "a")  # noqa: SIM115
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    comm.barrier()
    engine = _engine(seed=0)
    out: dict[str, Any] = {"save": _outcome(lambda: engine.save_checkpoint(save_dir, tag=TAG))}
    out["listing"] = sorted(os.listdir(save_dir))
    other = os.path.join(save_dir, "other_job_step3")
    out["other_job_files"] = sorted(os.listdir(other)) if os.path.isdir(other) else None
    out["markers"] = sorted(os.listdir(os.path.join(save_dir, ".partita-calls")))
    out["live"] = os.path.basename(atomic.staging_path(save_dir, live, "global_step1"))
    out["dead"] = os.path.basename(atomic.staging_path(save_dir, dead, "global_step1"))
    engine.destroy()
    if held is not None:
        held.close()
    return out


# --- the two-rename fallback (no renameat2) -------------------------------------------------
@contextlib.contextmanager
def _no_exchange(fail_second_rename: bool = False) -> Iterator[None]:
    """Rank 0's commit as on a platform without ``renameat2``; optionally the rename of the
    staging folder to the tag fails (after the old folder was renamed aside)."""
    from partita.checkpoint import atomic

    real_exchange, real_rename = atomic.exchange_dirs, os.rename

    def rename(src: Any, dst: Any) -> None:
        if fail_second_rename and ".new." in os.path.basename(str(src)):
            raise OSError(errno.EIO, "injected failure between the two renames")
        real_rename(src, dst)

    if comm.get_rank() == 0:
        atomic.exchange_dirs = lambda a, b: False  # type: ignore[assignment]
        os.rename = rename  # type: ignore[assignment]
    try:
        yield
    finally:
        atomic.exchange_dirs, os.rename = real_exchange, real_rename  # type: ignore[assignment]


def two_rename_cases(root: str, base: str) -> dict[str, Any]:
    """Without the atomic exchange: a re-save that succeeds replaces the tag; one that fails
    between the two renames puts the old folder back; a save killed there (its leftovers
    built by hand: the old folder set aside, the lock free) is repaired by the next save."""
    from partita.checkpoint import atomic

    out: dict[str, Any] = {}
    engine = _engine(seed=0)
    save_dir = os.path.join(root, "two_rename")
    engine.save_checkpoint(save_dir, tag=TAG)
    _train(engine, 1, seed=4)
    with _no_exchange():
        out["ok:save"] = _outcome(lambda: engine.save_checkpoint(save_dir, tag=TAG))
    current = _weights(engine)
    loaded, weights = _load_fresh(save_dir, tag=TAG)
    out["ok:load"] = (loaded, weights is not None and _same(weights, current))
    _train(engine, 1, seed=5)
    with _no_exchange(fail_second_rename=True):
        out["failed:save"] = _outcome(lambda: engine.save_checkpoint(save_dir, tag=TAG))
    loaded, weights = _load_fresh(save_dir, tag=TAG)
    out["failed:load"] = (loaded, weights is not None and _same(weights, current))
    out["failed:listing"] = sorted(os.listdir(save_dir))
    nonce = "c" * 16

    def killed_between_renames() -> None:
        aside = os.path.join(save_dir, f"{atomic.SAVE_PREFIX}{nonce}.old.{TAG}")
        os.rename(os.path.join(save_dir, TAG), aside)
        # The staged folder holds other weights: promoting it instead would show.
        shutil.copytree(os.path.join(base, TAG), atomic.staging_path(save_dir, nonce, TAG))
        _write(atomic.lock_path(save_dir, nonce), "")

    _on_rank0(killed_between_renames)
    out["killed:load_before"] = _load_fresh(save_dir, tag=TAG)[0]
    engine.save_checkpoint(save_dir, tag="other")
    loaded, weights = _load_fresh(save_dir, tag=TAG)
    out["killed:load_after"] = (loaded, weights is not None and _same(weights, current))
    out["killed:listing"] = sorted(os.listdir(save_dir))
    engine.destroy()
    return out


def all_cases(root: str) -> dict[str, Any]:
    """Every case, in one world-2 spawn."""
    engine = _engine(seed=0)
    _train(engine, 2, seed=1)
    base = os.path.join(root, "base")
    engine.save_checkpoint(base, tag=TAG)
    weights = _weights(engine)
    engine.destroy()
    out = {"resave": resave_cases(root)}
    out["fallback"] = fallback_cases(root, base, weights)
    out["hostile"] = hostile_cases(root, base, weights)
    out["sharing"] = sharing_cases(root)
    out["two_rename"] = two_rename_cases(root, base)
    return out
