"""The engine's monitor: one object that fans events out to the enabled backends on rank 0.

The engine builds it once with `build_monitor` from the ``tensorboard``, ``csv_monitor`` and
``wandb`` config sections and calls `Monitor.write_events` with ``(name, value, step)`` tuples
(names in `partita.monitor.events`).

[Note: two flags, two uses]
``Monitor.enabled`` says whether the *config* enables any backend; it is the same on every rank,
so the engine may gate work that involves collectives on it (reducing a loss for logging, say)
without one rank waiting on another that skipped it. ``Monitor.is_writer`` says whether *this*
rank writes anything (rank 0 with a backend enabled); gate purely local work on it, such as
calling ``.item()`` to build events, which syncs the device for nothing on the other ranks.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import operator
import os
import sys
from collections.abc import Iterable, Sequence
from types import ModuleType, TracebackType
from typing import Protocol, SupportsFloat, SupportsIndex

from partita.monitor.backends import (
    CsvSink,
    Event,
    Sink,
    TensorBoardSink,
    WandbSink,
    job_dir,
    make_log_dir,
)

__all__ = ["FileMonitorSection", "Monitor", "WandbSection", "build_monitor"]

# The Protocols declare read-only properties so that frozen pydantic models (whose fields mypy
# treats as read-only) and plain objects with attributes both satisfy them.


class FileMonitorSection(Protocol):
    """What the monitor reads from the ``tensorboard`` and ``csv_monitor`` config sections."""

    @property
    def enabled(self) -> bool:
        """Whether this backend is on."""
        ...

    @property
    def output_path(self) -> str | os.PathLike[str] | None:
        """Parent directory of the job directory; empty means the working directory."""
        ...

    @property
    def job_name(self) -> str:
        """Name of the job directory inside ``output_path``."""
        ...


class WandbSection(Protocol):
    """What the monitor reads from the ``wandb`` config section."""

    @property
    def enabled(self) -> bool:
        """Whether W&B logging is on."""
        ...

    @property
    def team(self) -> str | None:
        """W&B entity (team or user) that owns the project."""
        ...

    @property
    def group(self) -> str | None:
        """W&B group that collects related runs."""
        ...

    @property
    def project(self) -> str | None:
        """W&B project name."""
        ...


class Monitor:
    """Fans ``(name, value, step)`` events out to the backends of this rank.

    Built by `build_monitor`; on ranks other than 0, or when no backend is enabled, it has no
    backends and every method is a no-op. See [Note: two flags, two uses] for `enabled` vs
    `is_writer`.
    """

    def __init__(self, sinks: Sequence[Sink], *, enabled: bool, rank: int) -> None:
        """Wrap ``sinks``; ``enabled`` is the config-level flag (identical on every rank)."""
        self._sinks: tuple[Sink, ...] = tuple(sinks)
        self._enabled = enabled
        self._rank = rank
        self._closed = False

    @property
    def enabled(self) -> bool:
        """True when the config enables any backend, on every rank alike: safe to gate
        collectives on (see [Note: two flags, two uses])."""
        return self._enabled

    @property
    def is_writer(self) -> bool:
        """True when this rank writes events (rank 0 with at least one backend enabled): gate
        local work only on it (see [Note: two flags, two uses])."""
        return bool(self._sinks)

    @property
    def backends(self) -> tuple[str, ...]:
        """Class names of this rank's backends, e.g. ``("TensorBoardSink", "CsvSink")``."""
        return tuple(type(sink).__name__ for sink in self._sinks)

    def write_events(self, events: Iterable[tuple[str, SupportsFloat, SupportsIndex]]) -> None:
        """Write ``events`` (name, value, step) to every backend of this rank, in order.

        Values may be anything ``float()`` accepts (Python numbers, NumPy scalars, one-element
        tensors); steps anything with ``__index__``. Non-finite values are written as they are:
        a NaN loss is exactly what a dashboard should show. The whole batch is checked before
        any backend sees it, so a malformed event writes nothing rather than half a batch.
        """
        if self._closed:
            raise RuntimeError(f"write_events called on a closed Monitor (rank {self._rank})")
        if not self._sinks:
            return
        batch = [_check_event(i, event) for i, event in enumerate(events)]
        if not batch:
            return
        for sink in self._sinks:
            sink.write(batch)

    def flush(self) -> None:
        """Push buffered events of every backend to disk or to the W&B process."""
        if self._closed:
            return
        for sink in self._sinks:
            sink.flush()

    def close(self) -> None:
        """Flush and close every backend; later calls do nothing.

        Every backend is closed even if an earlier one fails; the first failure is re-raised.
        """
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as exc:  # close the rest before reporting
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Monitor:
        """Return self; the monitor is closed when the ``with`` block ends."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the monitor."""
        self.close()


def _check_event(index: int, event: tuple[str, SupportsFloat, SupportsIndex]) -> Event:
    """Return ``event`` as ``(str, float, int)``, or raise naming its position and field."""
    try:
        name, value, step = event
    except (TypeError, ValueError):
        raise ValueError(
            f"monitor event #{index} must be a (name, value, step) tuple, got {event!r}"
        ) from None
    if not isinstance(name, str) or not name:
        raise ValueError(f"monitor event #{index}: name must be a non-empty str, got {name!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"monitor event #{index} ('{name}'): value must be a real scalar, got {value!r}"
        ) from None
    try:
        step_int = operator.index(step)
    except TypeError:
        raise ValueError(
            f"monitor event #{index} ('{name}'): step must be an integer, got {step!r}"
        ) from None
    return name, number, step_int


def _package_available(name: str) -> bool:
    """Whether ``import name`` can find the package, without importing it."""
    if name in sys.modules:
        # None in sys.modules is Python's "import of this name is blocked" marker.
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _missing_package(key: str, package: str, rank: int, detail: str = "") -> ImportError:
    """Build the error for an enabled backend whose package is not importable."""
    return ImportError(
        f"{key} is true in the config, but the '{package}' package is not importable on "
        f"rank {rank}{detail}. Install it (`pip install {package}`) or set {key} to false.",
        name=package,
    )


def _import_wandb(rank: int) -> ModuleType:
    """Import wandb, turning any import failure into an error naming ``wandb.enabled``."""
    try:
        return importlib.import_module("wandb")
    except ImportError as exc:
        raise _missing_package("wandb.enabled", "wandb", rank, f" ({exc})") from exc


def _open_tensorboard(section: FileMonitorSection, rank: int) -> TensorBoardSink:
    """Create the TensorBoard backend in ``<output_path>/<job_name>``."""
    log_dir = make_log_dir(
        job_dir(section.output_path, section.job_name), "tensorboard.output_path", rank
    )
    try:
        return TensorBoardSink(log_dir)
    except ImportError as exc:  # tensorboard present but torch.utils.tensorboard unusable
        raise _missing_package("tensorboard.enabled", "tensorboard", rank, f" ({exc})") from exc


def _open_csv(section: FileMonitorSection, rank: int) -> CsvSink:
    """Create the CSV backend in ``<output_path>/<job_name>``."""
    log_dir = job_dir(section.output_path, section.job_name)
    return CsvSink(make_log_dir(log_dir, "csv_monitor.output_path", rank))


def _open_wandb(section: WandbSection, rank: int) -> WandbSink:
    """Create the W&B backend with DeepSpeed's ``wandb.init`` arguments."""
    return WandbSink(
        _import_wandb(rank), project=section.project, group=section.group, team=section.team
    )


def build_monitor(
    tensorboard: FileMonitorSection | None,
    csv_monitor: FileMonitorSection | None,
    wandb: WandbSection | None,
    *,
    rank: int,
) -> Monitor:
    """Build the monitor for global rank ``rank`` from the three config sections.

    ``None`` means the section is absent (that backend is off). Only rank 0 opens backends,
    like DeepSpeed; other ranks get a monitor that writes nothing but reports the same
    `Monitor.enabled`. A missing ``tensorboard``/``wandb`` package is reported on every rank,
    before anything is opened, so a bad environment fails the whole job rather than rank 0 alone.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"build_monitor: rank must be an int >= 0, got {rank!r}")
    tb_on = tensorboard is not None and bool(tensorboard.enabled)
    csv_on = csv_monitor is not None and bool(csv_monitor.enabled)
    wandb_on = wandb is not None and bool(wandb.enabled)
    if tb_on and not _package_available("tensorboard"):
        raise _missing_package("tensorboard.enabled", "tensorboard", rank)
    if wandb_on and not _package_available("wandb"):
        raise _missing_package("wandb.enabled", "wandb", rank)
    enabled = tb_on or csv_on or wandb_on
    if rank != 0 or not enabled:
        return Monitor((), enabled=enabled, rank=rank)

    sinks: list[Sink] = []
    try:
        if tb_on and tensorboard is not None:
            sinks.append(_open_tensorboard(tensorboard, rank))
        if csv_on and csv_monitor is not None:
            sinks.append(_open_csv(csv_monitor, rank))
        if wandb_on and wandb is not None:
            sinks.append(_open_wandb(wandb, rank))
    except BaseException:
        # Do not leak open event files or a W&B run when a later backend fails to start; the
        # start-up error is the one to report, so a failure while closing is dropped.
        with contextlib.suppress(Exception):
            Monitor(sinks, enabled=enabled, rank=rank).close()
        raise
    return Monitor(sinks, enabled=enabled, rank=rank)
