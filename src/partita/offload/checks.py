"""Checks of the offload config against the machine, run on every rank before training starts.

The config package already checks what needs no machine (``rules.py``: an NVMe device without
``nvme_path``, parameter offload below stage 3, optimizer offload at stage 0). What needs the
file system is here: the ``nvme_path`` of each NVMe offload block must exist, be a directory,
be writable by this process, have room for the swap files, and - preferably - support direct
I/O; and ``aio.block_size`` must suit direct I/O.

Decision on direct I/O: a filesystem without ``O_DIRECT`` (some network or FUSE filesystems)
still works through buffered I/O - correct, only slower, and its page cache is charged to the
process's memory cgroup - so by default it is a warning. It is an error when the user asked
for direct I/O: ``aio.use_gds`` (GPUDirect Storage needs it) or ``require_direct_io=True``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from partita.config.errors import ConfigError, Problem

from .aio import ALIGNMENT, aligned_empty, byte_view

if TYPE_CHECKING:
    from partita.config import AioConfig, ZeroConfig

__all__ = ["DirectoryProbe", "check_offload_config", "probe_directory"]

logger = logging.getLogger(__name__)

_BLOCKS = ("offload_optimizer", "offload_param")


@dataclass(frozen=True)
class DirectoryProbe:
    """What writing a small file in a directory showed.

    Attributes:
        write_error: the OSError creating or writing the file raised, or None (writable).
        direct_io: True when an aligned ``O_DIRECT`` write and read of one block worked.
    """

    write_error: OSError | None
    direct_io: bool


def probe_directory(path: str | os.PathLike[str]) -> DirectoryProbe:
    """Create, write and delete a one-block file in ``path``, first with ``O_DIRECT``.

    A real write, not ``os.access``: access bits say nothing of read-only mounts, quotas or a
    root process, and only an actual aligned write shows that ``O_DIRECT`` works.
    """
    import torch

    probe = Path(path) / f".partita-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    block = aligned_empty(ALIGNMENT, torch.uint8)
    block.fill_(0x5A)
    base = os.O_RDWR | os.O_CREAT | os.O_EXCL
    o_direct = getattr(os, "O_DIRECT", 0)
    try:
        if o_direct:
            try:
                fd = os.open(probe, base | o_direct, 0o600)
                try:
                    view = byte_view(block, 0, ALIGNMENT)
                    ok = os.pwritev(fd, [view], 0) == ALIGNMENT
                    ok = ok and os.preadv(fd, [view], 0) == ALIGNMENT
                finally:
                    os.close(fd)
                return DirectoryProbe(None, ok)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    return DirectoryProbe(exc, False)
                probe.unlink(missing_ok=True)  # O_CREAT may have succeeded before EINVAL
        fd = os.open(probe, base, 0o600)
        try:
            os.write(fd, b"\0" * ALIGNMENT)
        finally:
            os.close(fd)
        return DirectoryProbe(None, False)
    except OSError as exc:
        return DirectoryProbe(exc, False)
    finally:
        probe.unlink(missing_ok=True)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _check_directory(
    key: str, path: Path, rank: int
) -> tuple[list[Problem], DirectoryProbe | None]:
    where = f"rank {rank}: nvme_path '{path}'"
    if not path.exists():
        return [
            Problem(key, f"{where} does not exist; create it or point nvme_path at a directory")
        ], None
    if not path.is_dir():
        return [Problem(key, f"{where} is not a directory")], None
    probe = probe_directory(path)
    if probe.write_error is not None:
        err = probe.write_error
        reason = f"[errno {err.errno}] {err.strerror}"
        return [Problem(key, f"{where} is not writable by this process ({reason})")], None
    return [], probe


def check_offload_config(
    zero: ZeroConfig,
    aio: AioConfig,
    rank: int,
    *,
    required_bytes: Mapping[str, int] | None = None,
    require_direct_io: bool = False,
) -> list[str]:
    """Check the NVMe offload blocks of ``zero`` (and ``aio``) against this machine.

    Args:
        zero: the ``zero_optimization`` section.
        aio: the ``aio`` section.
        rank: this process's global rank (named in every message).
        required_bytes: swap bytes this rank will write per block, keyed ``"offload_optimizer"``
            / ``"offload_param"``; blocks on the same filesystem are summed against its free
            space. None skips the space check.
        require_direct_io: make a filesystem without ``O_DIRECT`` an error (also implied by
            ``aio.use_gds``).

    Returns:
        Warnings (also logged): e.g. a filesystem without direct I/O.

    Raises:
        ConfigError: every problem found, each with its dotted key path.
    """
    problems: list[Problem] = []
    warnings: list[str] = []
    need_direct = require_direct_io or aio.use_gds
    demand: dict[int, tuple[int, list[str], Path]] = {}  # st_dev -> (bytes, keys, a path)
    any_nvme = False
    for name in _BLOCKS:
        block = getattr(zero, name)
        # No nvme_path is rules.py's error already; checked there before this runs.
        if block is None or block.device != "nvme" or not block.nvme_path:
            continue
        any_nvme = True
        key = f"zero_optimization.{name}.nvme_path"
        path = Path(block.nvme_path).absolute()
        found, probe = _check_directory(key, path, rank)
        problems += found
        if probe is None:
            continue
        if not probe.direct_io:
            text = (
                f"rank {rank}: nvme_path '{path}' does not support direct I/O (O_DIRECT); "
                "swapping falls back to buffered I/O, which is slower and fills the page cache"
            )
            if need_direct:
                why = "aio.use_gds" if aio.use_gds else "direct I/O was required"
                problems.append(Problem(key, f"{text} ({why})"))
            else:
                warnings.append(text)
        if required_bytes is not None and name in required_bytes:
            dev = path.stat().st_dev
            total, keys, _ = demand.get(dev, (0, [], path))
            demand[dev] = (total + int(required_bytes[name]), [*keys, key], path)
    for total, keys, path in demand.values():
        free = shutil.disk_usage(path).free
        if free < total:
            problems.append(
                Problem(
                    keys[0],
                    f"rank {rank}: nvme_path '{path}' has {_gib(free)} free, swap files need "
                    f"{_gib(total)} ({total} bytes"
                    + (f", shared with {', '.join(keys[1:])}" if keys[1:] else "")
                    + ")",
                )
            )
    if any_nvme and aio.block_size % ALIGNMENT:
        problems.append(
            Problem(
                "aio.block_size",
                f"must be a multiple of {ALIGNMENT} bytes for direct I/O, got {aio.block_size}",
            )
        )
    if problems:
        raise ConfigError(problems)
    for text in warnings:
        logger.warning(text)
    return warnings
