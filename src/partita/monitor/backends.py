"""The three places monitor events can go: TensorBoard, CSV files and Weights & Biases.

Each backend is a small sink with ``write``/``flush``/``close`` that receives already-validated
``(name, value, step)`` events; choosing backends, rank filtering and validation live in
`partita.monitor.monitor`. The on-disk layout is DeepSpeed's, so scripts that read DeepSpeed's
output keep working:

* TensorBoard: one event file written straight into ``<output_path>/<job_name>/``.
* CSV: ``<output_path>/<job_name>/<event name with "/" and " " replaced by "_">.csv``, header
  ``step,<last "/"-part of the event name>``, then one ``step,value`` row per event.
* W&B: ``wandb.init(project=, group=, entity=team)``, events logged with their step.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, TextIO

Event = tuple[str, float, int]
"""One monitor event: (name, value, step)."""


class Sink(Protocol):
    """A destination for monitor events (one per enabled backend, on the writing rank only)."""

    def write(self, events: Sequence[Event]) -> None:
        """Record ``events`` in order; names are non-empty, values floats, steps ints."""
        ...

    def flush(self) -> None:
        """Push buffered events to their destination."""
        ...

    def close(self) -> None:
        """Flush and release files or runs; called once."""
        ...


def job_dir(output_path: str | os.PathLike[str] | None, job_name: str) -> Path:
    """Return DeepSpeed's log directory ``<output_path>/<job_name>``.

    An empty or missing ``output_path`` means the current working directory, as in DeepSpeed
    (whose default ``output_path`` is ``""``). ``~`` is expanded, which DeepSpeed does not do;
    a directory literally named ``~`` is never what a user means.
    """
    base = Path(output_path).expanduser() if output_path else Path()
    return base / job_name


def make_log_dir(path: Path, key: str, rank: int) -> Path:
    """Create ``path`` (and parents), turning a failure into an error naming the config key."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(
            f"cannot create the monitor directory '{path}' from {key} on rank {rank}: {exc}"
        ) from exc
    return path


class TensorBoardSink:
    """Writes scalar events with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, log_dir: Path) -> None:
        """Open a SummaryWriter whose event file lives directly in ``log_dir``."""
        # Imported here: torch.utils.tensorboard needs the optional tensorboard package, and
        # ranks that never write must not pay for (or depend on) it.
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, events: Sequence[Event]) -> None:
        """Add each event as a scalar, then flush so curves update while training runs."""
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        # DeepSpeed flushes after every batch of events; one flush per optimizer step is cheap
        # and means a crash loses at most the current step.
        self._writer.flush()

    def flush(self) -> None:
        """Flush the event file."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def csv_file_name(event_name: str) -> str:
    """Return the CSV file name DeepSpeed uses for ``event_name`` ("/" and " " become "_")."""
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


def csv_column_name(event_name: str) -> str:
    """Return the value column header DeepSpeed uses: the last "/"-separated part of the name."""
    return event_name.rsplit("/", 1)[-1]


class CsvSink:
    """Appends each event as a ``step,value`` row to one CSV file per event name."""

    def __init__(self, log_dir: Path) -> None:
        """Write files into ``log_dir``, which must exist."""
        self.log_dir = log_dir
        self._files: dict[str, tuple[TextIO, Any]] = {}  # event name -> (file, csv writer)
        self._owners: dict[str, str] = {}  # file name -> event name, to catch collisions

    def _writer_for(self, name: str) -> Any:
        """Return the csv writer of event ``name``, opening its file on first use."""
        entry = self._files.get(name)
        if entry is not None:
            return entry[1]
        file_name = csv_file_name(name)
        owner = self._owners.get(file_name)
        if owner is not None:
            raise ValueError(
                f"monitor events '{owner}' and '{name}' would both be written to "
                f"'{self.log_dir / file_name}' (csv_monitor replaces '/' and ' ' with '_'); "
                "rename one of them"
            )
        path = self.log_dir / file_name
        # Append, so a resumed job continues its curves; newline="" is what the csv module
        # needs (rows end in "\r\n", as DeepSpeed's files do).
        handle = path.open("a", newline="", encoding="utf-8")
        writer = csv.writer(handle)
        # Departure from DeepSpeed, which writes the header once per process even into a file
        # that already has one (leaving a stray header row mid-file after a restart): write it
        # only into an empty file, so the file stays one clean table.
        if handle.tell() == 0:
            writer.writerow(["step", csv_column_name(name)])
        self._files[name] = (handle, writer)
        self._owners[file_name] = name
        return writer

    def write(self, events: Sequence[Event]) -> None:
        """Append one row per event, then flush the touched files."""
        touched: set[str] = set()
        for name, value, step in events:
            self._writer_for(name).writerow([step, value])
            touched.add(name)
        # DeepSpeed reopens (and so flushes) the file per event; flushing once per batch gives
        # the same visibility to readers with far fewer system calls.
        for name in touched:
            self._files[name][0].flush()

    def flush(self) -> None:
        """Flush every open CSV file."""
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        """Close every open CSV file."""
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()


class WandbSink:
    """Logs events to a Weights & Biases run."""

    def __init__(
        self, wandb: ModuleType, *, project: str | None, group: str | None, team: str | None
    ) -> None:
        """Start a run with DeepSpeed's arguments, or reuse the run the script already started.

        DeepSpeed calls ``wandb.init`` unconditionally; what that does to a run the user
        started first depends on the wandb version. Reusing ``wandb.run`` keeps the user's run
        (and its settings) and leaves finishing it to the user.
        """
        existing = getattr(wandb, "run", None)
        self._owns_run = existing is None
        self._run = (
            wandb.init(project=project, group=group, entity=team) if existing is None else existing
        )

    def write(self, events: Sequence[Event]) -> None:
        """Log events, one ``run.log`` call per run of consecutive events sharing a step.

        DeepSpeed logs every event on its own; merging same-step events gives the same
        history with fewer calls. A name repeated within a step starts a new call so that no
        value is overwritten.
        """
        batch: dict[str, float] = {}
        batch_step = 0
        for name, value, step in events:
            if batch and (step != batch_step or name in batch):
                self._run.log(batch, step=batch_step)
                batch = {}
            batch[name] = value
            batch_step = step
        if batch:
            self._run.log(batch, step=batch_step)

    def flush(self) -> None:
        """Nothing to do: wandb streams logged data from its own background process."""

    def close(self) -> None:
        """Finish the run if this sink started it, so its data is uploaded or synced."""
        if self._owns_run:
            self._run.finish()
