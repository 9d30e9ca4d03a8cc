"""What a failed job prints: a user error's message once, a crash's first traceback once.

[Note: failure reports]
Left alone, every rank of a failing job prints its own traceback (ranks usually fail alike, so
the same one N times), torchrun's agent logs each failure, and its summary block follows: some
50 lines for a one-key typo in ``ds_config.json``. Instead:

- every Python worker runs its script inside `partita.launcher.worker_exec`, which hands an
  exception that ends the script to `report_failure`;
- `report_failure` records it (`FailureRecord`: rank, kind, a one-line summary, the message)
  in ``$PARTITA_FAILURE_DIR/rank<R>.<attempt>.json``, then claims ``first.<attempt>`` with an
  exclusive create. Only the rank that wins prints, at once: a `PartitaUserError`'s message
  (``partita: error: ...``), or any other exception's traceback (through ``sys.excepthook``,
  as Python would). The others print nothing. The worker exits `USAGE_EXIT` (2) for a user
  error, 1 otherwise;
- the launcher, once the agent has stopped the job, reads the records (`summarize`), prints
  one line naming the first failing rank, and exits 2 for a user error, 1 for anything else;
  it prints neither torch's failure block nor the agent's log lines.

``attempt`` is the agent's restart count, so every restart of the worker group has its own
first rank. ``PARTITA_DEBUG=1`` prints everything again (every rank's traceback, torch's
summary) and keeps the exit statuses. A worker killed by a signal or ``os._exit`` leaves no
record; the launcher then names the agent's first failure with its exit code.

Imports nothing heavy: this runs in every worker before its script.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from partita.platform import env

__all__ = [
    "CRASH_EXIT",
    "USAGE_EXIT",
    "FailureRecord",
    "ProcessFailureLike",
    "is_user_error",
    "ranks_phrase",
    "read_records",
    "report_failure",
    "summarize",
]

#: Exit status of a worker (and of the launcher) stopped by a `PartitaUserError`: the usage
#: error status of argparse and of the ``partita`` command's own flags.
USAGE_EXIT = 2
#: Exit status of a worker (and of the launcher) whose script raised anything else.
CRASH_EXIT = 1

_SUMMARY_CHARS = 300  # a one-line summary stays a line, whatever the exception's message holds
# How long a rank that failed second waits for the first to finish printing: the agent stops
# every worker once one has exited, which could cut the first one's traceback short.
_PRINT_WAIT_S = 5.0


@dataclass(frozen=True)
class FailureRecord:
    """One rank's exception, as its worker recorded it.

    Attributes:
        rank: global rank of the worker.
        attempt: the agent's restart count when it failed (0 for the first start).
        user_error: the exception was a `PartitaUserError` (fixed in the config, not the code).
        status: the exit status the worker chose (`USAGE_EXIT` or `CRASH_EXIT`); the agent may
            see another, having stopped the worker while it was still exiting.
        summary: ``Type: first line of the message``.
        message: the whole message.
        time: ``time.time()`` when the worker caught it.
    """

    rank: int
    attempt: int
    user_error: bool
    status: int
    summary: str
    message: str
    time: float


class ProcessFailureLike(Protocol):
    """What `summarize` reads of torch's ``ProcessFailure`` (kept torch-free for tests)."""

    local_rank: int
    exitcode: int
    timestamp: int

    def signal_name(self) -> str:
        """The signal's name for a negative exit code."""
        ...


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a `partita.config.errors.PartitaUserError`.

    Reads the class from ``sys.modules``: if partita's config package was never imported, the
    exception cannot be one, and a worker need not pay for importing it.
    """
    errors = sys.modules.get("partita.config.errors")
    base = getattr(errors, "PartitaUserError", None)
    return isinstance(base, type) and isinstance(exc, base)


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= _SUMMARY_CHARS else text[: _SUMMARY_CHARS - 3] + "..."


def _env_int(name: str, environ: Mapping[str, str]) -> int:
    try:
        return int(environ.get(name, "0"))
    except ValueError:
        return 0


def _record_path(directory: Path, rank: int, attempt: int) -> Path:
    return directory / f"rank{rank}.{attempt}.json"


def _first_path(directory: Path, attempt: int) -> Path:
    return directory / f"first.{attempt}"


def _printed_path(directory: Path, attempt: int) -> Path:
    return directory / f"printed.{attempt}"


def _wait_for_print(directory: Path, attempt: int) -> None:
    deadline = time.monotonic() + _PRINT_WAIT_S
    while not _printed_path(directory, attempt).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _claim_first(directory: Path, record: FailureRecord) -> bool:
    """True for exactly one rank per attempt: the first to create the marker file."""
    try:
        fd = os.open(_first_path(directory, record.attempt), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as marker:
        marker.write(str(record.rank))
    return True


def _write_record(directory: Path, record: FailureRecord) -> None:
    path = _record_path(directory, record.rank, record.attempt)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(asdict(record)))
    os.replace(partial, path)  # the launcher never reads half a record


def report_failure(exc: BaseException, environ: Mapping[str, str] | None = None) -> int:
    """Records the exception that ended this worker's script, prints it if this rank failed
    first (or always, under ``PARTITA_DEBUG``), and returns the worker's exit status.

    Without ``PARTITA_FAILURE_DIR`` (a worker not started by the launcher), or when the record
    cannot be written, the exception is printed as Python would.
    """
    environ = os.environ if environ is None else environ
    user_error = is_user_error(exc)
    status = USAGE_EXIT if user_error else CRASH_EXIT
    directory = env.failure_dir(environ)
    first = True
    if directory is not None:
        record = FailureRecord(
            # RANK and TORCHELASTIC_RESTART_COUNT: set for each worker by torchrun's agent.
            rank=_env_int("RANK", environ),
            attempt=_env_int("TORCHELASTIC_RESTART_COUNT", environ),
            user_error=user_error,
            status=status,
            summary=_summary(exc),
            message=str(exc),
            time=time.time(),
        )
        try:
            _write_record(Path(directory), record)
            first = _claim_first(Path(directory), record)
        except OSError:
            first = True  # printing twice beats staying silent
    if env.debug(environ) or directory is None or (first and not user_error):
        sys.excepthook(type(exc), exc, exc.__traceback__)
    elif first:
        print(f"partita: error: {exc}", file=sys.stderr, flush=True)
    if directory is not None:
        _after_print(Path(directory), record, first)
    return status


def _after_print(directory: Path, record: FailureRecord, first: bool) -> None:
    """The first rank says it has printed; the others wait for that (bounded) before exiting."""
    try:
        if first:
            sys.stderr.flush()
            _printed_path(directory, record.attempt).touch()
        else:
            _wait_for_print(directory, record.attempt)
    except OSError:
        pass  # the wait only orders output; the record is already written


def read_records(directory: Path) -> list[FailureRecord]:
    """Every record of the last attempt that has any, in the order the ranks failed."""
    records = []
    for path in directory.glob("rank*.json"):
        try:
            records.append(FailureRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a record we cannot read changes nothing the others say
    if not records:
        return []
    last = max(r.attempt for r in records)
    return sorted((r for r in records if r.attempt == last), key=lambda r: (r.time, r.rank))


def _first_record(directory: Path, records: list[FailureRecord]) -> FailureRecord:
    try:
        winner = int(_first_path(directory, records[0].attempt).read_text())
    except (OSError, ValueError):
        return records[0]
    return next((r for r in records if r.rank == winner), records[0])


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0 and 1``, ``ranks 0-7, 9 and 10``: runs of three or more
    consecutive ranks joined."""
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = []
    for run in runs:
        parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(r) for r in run]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"rank {text}" if len(ordered) == 1 else f"ranks {text}"


def _where(failure: ProcessFailureLike | None, node_rank: int, num_nodes: int) -> str:
    if failure is None or num_nodes == 1:
        return ""
    return f" (local_rank {failure.local_rank} on node {node_rank})"


def _exit_text(failure: ProcessFailureLike) -> str:
    if failure.exitcode < 0:
        return f"exit {failure.exitcode}, {failure.signal_name()}"
    return f"exit {failure.exitcode}"


def summarize(
    directory: Path,
    failures: Mapping[int, Any],
    node_rank: int = 0,
    num_nodes: int = 1,
) -> tuple[str, int]:
    """The launcher's line about a failed job and its exit status (2: a user error, else 1).

    ``failures`` is torch's ``ChildFailedError.failures`` (global rank -> ``ProcessFailure``,
    see `ProcessFailureLike`); ``directory`` holds the workers' records.
    """
    records = read_records(directory)
    if not records:
        rank = min(failures, key=lambda r: (failures[r].timestamp, r))
        failure = failures[rank]
        where = _where(failure, node_rank, num_nodes)
        return (
            f"partita: rank {rank}{where} failed ({_exit_text(failure)}); "
            "the other workers were stopped",
            CRASH_EXIT,
        )
    first = _first_record(directory, records)
    if first.user_error:
        alike = [r.rank for r in records if r.user_error and r.message == first.message]
        return (
            f"partita: {ranks_phrase(alike)} stopped on this error; "
            f"{env.DEBUG.name}=1 shows the traceback",
            USAGE_EXIT,
        )
    # The record's status, not the agent's: a worker stopped while it exited shows SIGTERM.
    where = _where(failures.get(first.rank), node_rank, num_nodes)
    line = f"partita: rank {first.rank}{where} failed (exit {first.status}): {first.summary}"
    others = [r.rank for r in records if r.rank != first.rank]
    if others:
        line += f"; {ranks_phrase(others)} failed too ({env.DEBUG.name}=1 shows every traceback)"
    return line, CRASH_EXIT
