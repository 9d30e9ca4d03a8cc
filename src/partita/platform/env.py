"""Every ``PARTITA_*`` environment variable partita reads, defined once: its name, what values it
takes, its default and what it does, with a typed accessor for each.

Accessors read at call time, not at import, so a test that sets ``os.environ`` (or a launcher
that sets it before starting workers) is seen; each takes an optional mapping in place of
``os.environ``. A value that does not parse is a ValueError naming the variable and the value.
Code that sets a variable for a child process (the launcher, the test harness) uses
`EnvVar.name`. docs/environment.md's table is `markdown_table()`'s output (tests/test_env.py compares).

Imported by the launcher CLI (whose ``--help`` must not import torch) and by the start-up hook's
`partita.compat.alias`, which runs at interpreter start: keep this module's imports to ``os``
and ``typing``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

__all__ = [
    "ACCELERATOR",
    "AS_DEEPSPEED",
    "CACHE_DIR",
    "CHECKPOINT_TIMEOUT",
    "COLLECTIVES",
    "CPU_ADAM",
    "DATA_SEED",
    "DEBUG",
    "DEFAULT_HANG_TIMEOUT",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_HOST_CACHE_HEADROOM",
    "DEFAULT_MMAP_THRESHOLD",
    "FAILURE_DIR",
    "HANG_TIMEOUT",
    "HEARTBEAT_DIR",
    "HEARTBEAT_INTERVAL",
    "HOST_CACHE",
    "HOST_CACHE_HEADROOM",
    "LAUNCHER_PID",
    "MMAP_THRESHOLD",
    "OFF_VALUES",
    "TEST_RUN_DIR",
    "TEST_START_METHOD",
    "VARIABLES",
    "EnvVar",
    "as_deepspeed",
    "cache_dir",
    "checkpoint_timeout_s",
    "collectives",
    "cpu_adam_enabled",
    "data_seed",
    "debug",
    "failure_dir",
    "forced_accelerator",
    "hang_timeout",
    "harness_run_dir",
    "harness_start_method",
    "heartbeat_dir",
    "heartbeat_interval",
    "host_cache_enabled",
    "host_cache_headroom",
    "launcher_pid",
    "markdown_table",
    "mmap_threshold",
]

Environ = Mapping[str, str]


class EnvVar(NamedTuple):
    """One environment variable: its name, the values it takes, its default, who sets it and
    what it does (one row each in docs/environment.md)."""

    name: str
    values: str
    default: str
    set_by: str
    doc: str

    def raw(self, environ: Environ | None = None) -> str | None:
        """The value as set (None when unset), from ``environ`` or else ``os.environ`` now."""
        return (os.environ if environ is None else environ).get(self.name)


_USER = "you"
_LAUNCHER = "the `partita` launcher, for its workers"
_HARNESS = "partita's test harness"

#: Seconds a rank may go without progress before the job counts as hung. A hang is noticed at
#: most one poll (5 s) after the bound and the agent then needs seconds to stop the workers,
#: so 240 s keeps a hung job's end within 5 minutes of the hang.
DEFAULT_HANG_TIMEOUT = 240.0
#: Seconds between two heartbeats when the launcher names a directory but no interval.
DEFAULT_HEARTBEAT_INTERVAL = 5.0
#: Idle host-cache blocks are kept while the mapped total stays within (1 + this) x the peak of
#: the bytes tensors asked for (see `partita.platform.host_cache`).
DEFAULT_HOST_CACHE_HEADROOM = 0.05
#: glibc's mmap threshold partita fixes
#: (see `partita.platform.accelerator.configure_host_allocator`).
DEFAULT_MMAP_THRESHOLD = 1 << 20
#: Values of a yes/no switch that mean "off" (after strip and lower-casing).
OFF_VALUES = ("", "0", "false", "no", "off")

ACCELERATOR = EnvVar(
    "PARTITA_ACCELERATOR",
    "`cpu` or `cuda`",
    "unset: `DS_ACCELERATOR`, else CUDA when available",
    f"{_LAUNCHER}; or {_USER}",
    "the device partita uses; `cpu` forces CPU on a GPU machine",
)
AS_DEEPSPEED = EnvVar(
    "PARTITA_AS_DEEPSPEED",
    "`1` (on) or `0`/`false`/`no`/`off`/empty",
    "off",
    f"{_LAUNCHER} (`1`); or {_USER}",
    "`import deepspeed` resolves to partita in every interpreter that sees it "
    "(start-up hook `partita-as-deepspeed.pth`)",
)
CACHE_DIR = EnvVar(
    "PARTITA_CACHE_DIR",
    "a directory",
    "`$XDG_CACHE_HOME/partita`, else `~/.cache/partita`",
    _USER,
    "where the C++ helpers (CPU Adam kernel, host cache) are built and kept; used only when "
    "private to this user",
)
CHECKPOINT_TIMEOUT = EnvVar(
    "PARTITA_CHECKPOINT_TIMEOUT_S",
    "seconds",
    "the process group's timeout (30 min)",
    _USER,
    "how long a rank waits for the others to call save/load before failing, naming them",
)
COLLECTIVES = EnvVar(
    "PARTITA_COLLECTIVES",
    "`auto`, `native` or `all_reduce`",
    "`auto`",
    _USER,
    "on gloo: `native` uses gloo's reduce-scatter/all-gather, `all_reduce` emulates them with "
    "all-reduces; `auto` pairs two ranks, else all-reduces. NCCL always uses its own",
)
CPU_ADAM = EnvVar(
    "PARTITA_CPU_ADAM",
    "`0` (off), else on",
    "on",
    _USER,
    "`0`: CPU Adam uses torch's kernel instead of partita's vectorised C++ kernel",
)
DATA_SEED = EnvVar(
    "PARTITA_DATA_SEED",
    "an integer",
    "`0`",
    _USER,
    "shuffling seed of the data loader `initialize(training_data=...)` builds",
)
DEBUG = EnvVar(
    "PARTITA_DEBUG",
    "`1` (on) or `0`/`false`/`no`/`off`/empty",
    "off",
    _USER,
    "a failed job shows every rank's traceback and torch's failure summary (by default the "
    "launcher shows a configuration error's message once, a crash's first traceback once)",
)
FAILURE_DIR = EnvVar(
    "PARTITA_FAILURE_DIR",
    "a directory",
    "unset: a failing rank prints its traceback",
    _LAUNCHER,
    "where a rank whose script raised records the error; only the first to fail prints it",
)
HANG_TIMEOUT = EnvVar(
    "PARTITA_HANG_TIMEOUT",
    "seconds >= 0",
    f"`{DEFAULT_HANG_TIMEOUT:g}`",
    _USER,
    "the launcher ends a job whose rank makes no progress this long (`--hang_timeout` wins; "
    "`0` disables the watchdog)",
)
HEARTBEAT_DIR = EnvVar(
    "PARTITA_HEARTBEAT_DIR",
    "a directory",
    "unset: no heartbeat",
    _LAUNCHER,
    "where each rank writes the heartbeat the launcher's hang watchdog reads",
)
HEARTBEAT_INTERVAL = EnvVar(
    "PARTITA_HEARTBEAT_INTERVAL",
    "seconds > 0",
    f"`{DEFAULT_HEARTBEAT_INTERVAL:g}`",
    _LAUNCHER,
    "seconds between two heartbeats of a rank (a tenth of the hang timeout, within 0.2-5)",
)
HOST_CACHE = EnvVar(
    "PARTITA_HOST_CACHE",
    "`0` (off), else on",
    "on",
    _USER,
    "`0`: no caching host allocator (torch's CPU allocator stays)",
)
HOST_CACHE_HEADROOM = EnvVar(
    "PARTITA_HOST_CACHE_HEADROOM",
    "a fraction",
    f"`{DEFAULT_HOST_CACHE_HEADROOM:g}`",
    _USER,
    "the host cache keeps idle blocks while mapped bytes stay within (1 + this) x the peak "
    "requested",
)
LAUNCHER_PID = EnvVar(
    "PARTITA_LAUNCHER_PID",
    "a process id",
    "unset: no check",
    _LAUNCHER,
    "a worker whose parent is not this process does not start (the launcher died first)",
)
MMAP_THRESHOLD = EnvVar(
    "PARTITA_MMAP_THRESHOLD",
    "bytes (`0`: glibc's default)",
    f"`{DEFAULT_MMAP_THRESHOLD}`",
    _USER,
    "glibc's fixed mmap threshold for host blocks the cache does not keep (Linux)",
)
TEST_RUN_DIR = EnvVar(
    "PARTITA_TEST_RUN_DIR",
    "a directory",
    "set per run",
    _HARNESS,
    "a rank's run directory (results, stacks) in `partita.testing`",
)
TEST_START_METHOD = EnvVar(
    "PARTITA_TEST_START_METHOD",
    "`forkserver` or `spawn`",
    "`forkserver`",
    _USER,
    "how `partita.testing` starts rank processes; `spawn` starts fresh interpreters",
)

VARIABLES: tuple[EnvVar, ...] = (
    ACCELERATOR,
    AS_DEEPSPEED,
    CACHE_DIR,
    CHECKPOINT_TIMEOUT,
    COLLECTIVES,
    CPU_ADAM,
    DATA_SEED,
    DEBUG,
    FAILURE_DIR,
    HANG_TIMEOUT,
    HEARTBEAT_DIR,
    HEARTBEAT_INTERVAL,
    HOST_CACHE,
    HOST_CACHE_HEADROOM,
    LAUNCHER_PID,
    MMAP_THRESHOLD,
    TEST_RUN_DIR,
    TEST_START_METHOD,
)
"""Every variable, in the order of docs/environment.md's table."""


def markdown_table() -> str:
    """docs/environment.md's table of environment variables (tests/test_env.py holds the page to it)."""
    rows = [
        "| variable | values | default | set by | what it does |",
        "|---|---|---|---|---|",
    ]
    for v in VARIABLES:
        rows.append(f"| `{v.name}` | {v.values} | {v.default} | {v.set_by} | {v.doc} |")
    return "\n".join(rows)


_T = TypeVar("_T")


def _parsed(var: EnvVar, raw: str, parse: Callable[[str], _T], what: str) -> _T:
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"environment variable {var.name}={raw!r} {what}") from None


def _switched_off(var: EnvVar, environ: Environ | None) -> bool:
    return var.raw(environ) == "0"


def forced_accelerator(environ: Environ | None = None) -> str:
    """``PARTITA_ACCELERATOR`` lower-cased, else DeepSpeed's ``DS_ACCELERATOR``, else ``""``."""
    raw = ACCELERATOR.raw(environ)
    if raw is None:
        raw = (os.environ if environ is None else environ).get("DS_ACCELERATOR", "")
    return raw.lower()


def as_deepspeed(environ: Environ | None = None) -> bool:
    """Whether ``PARTITA_AS_DEEPSPEED`` asks partita to stand in for DeepSpeed."""
    return (AS_DEEPSPEED.raw(environ) or "").strip().lower() not in OFF_VALUES


def cache_dir(environ: Environ | None = None) -> str | None:
    """``PARTITA_CACHE_DIR``, or None when unset or empty (the caller's default then)."""
    return CACHE_DIR.raw(environ) or None


def checkpoint_timeout_s(environ: Environ | None = None) -> float | None:
    """``PARTITA_CHECKPOINT_TIMEOUT_S`` in seconds, or None when unset or empty."""
    raw = CHECKPOINT_TIMEOUT.raw(environ)
    if not raw:
        return None
    return _parsed(CHECKPOINT_TIMEOUT, raw, float, "is not a number of seconds")


def collectives(environ: Environ | None = None) -> str:
    """``PARTITA_COLLECTIVES`` as set (``auto`` when unset); any other value acts as ``auto``."""
    raw = COLLECTIVES.raw(environ)
    return "auto" if raw is None else raw


def cpu_adam_enabled(environ: Environ | None = None) -> bool:
    """False when ``PARTITA_CPU_ADAM=0``."""
    return not _switched_off(CPU_ADAM, environ)


def data_seed(environ: Environ | None = None) -> int:
    """``PARTITA_DATA_SEED`` (0 when unset)."""
    raw = DATA_SEED.raw(environ)
    if raw is None:
        return 0
    return _parsed(DATA_SEED, raw, int, "is not an integer")


def debug(environ: Environ | None = None) -> bool:
    """Whether ``PARTITA_DEBUG`` asks for every rank's traceback and torch's failure summary."""
    return (DEBUG.raw(environ) or "").strip().lower() not in OFF_VALUES


def failure_dir(environ: Environ | None = None) -> str | None:
    """``PARTITA_FAILURE_DIR``, or None when unset or empty (no failure records asked for)."""
    return FAILURE_DIR.raw(environ) or None


def hang_timeout(environ: Environ | None = None) -> float:
    """``PARTITA_HANG_TIMEOUT`` in seconds (`DEFAULT_HANG_TIMEOUT` when unset or blank; 0
    disables the watchdog). A value that is not a number >= 0 is a ValueError."""
    raw = HANG_TIMEOUT.raw(environ)
    if raw is None or raw.strip() == "":
        return DEFAULT_HANG_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):  # `not` also refuses NaN
        raise ValueError(
            f"environment variable {HANG_TIMEOUT.name}={raw!r} must be a number of seconds >= 0 "
            "(0 disables it)"
        )
    return value


def heartbeat_dir(environ: Environ | None = None) -> str | None:
    """``PARTITA_HEARTBEAT_DIR``, or None when unset or empty (no heartbeat asked for)."""
    return HEARTBEAT_DIR.raw(environ) or None


def heartbeat_interval(environ: Environ | None = None) -> float:
    """``PARTITA_HEARTBEAT_INTERVAL`` in seconds (`DEFAULT_HEARTBEAT_INTERVAL` when unset). A
    value that is not a positive finite number is a ValueError."""
    raw = HEARTBEAT_INTERVAL.raw(environ)
    if raw is None:
        return DEFAULT_HEARTBEAT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):  # `not` also refuses NaN
        raise ValueError(
            f"environment variable {HEARTBEAT_INTERVAL.name}={raw!r} must be a positive number "
            "of seconds"
        )
    return value


def host_cache_enabled(environ: Environ | None = None) -> bool:
    """False when ``PARTITA_HOST_CACHE=0``."""
    return not _switched_off(HOST_CACHE, environ)


def host_cache_headroom(environ: Environ | None = None) -> float:
    """``PARTITA_HOST_CACHE_HEADROOM`` (`DEFAULT_HOST_CACHE_HEADROOM` when unset)."""
    raw = HOST_CACHE_HEADROOM.raw(environ)
    if raw is None:
        return DEFAULT_HOST_CACHE_HEADROOM
    return _parsed(HOST_CACHE_HEADROOM, raw, float, "is not a number")


def launcher_pid(environ: Environ | None = None) -> str | None:
    """``PARTITA_LAUNCHER_PID`` as set, or None when unset or empty."""
    return LAUNCHER_PID.raw(environ) or None


def mmap_threshold(environ: Environ | None = None) -> int:
    """``PARTITA_MMAP_THRESHOLD`` in bytes (`DEFAULT_MMAP_THRESHOLD` when unset; <= 0 means
    glibc's own)."""
    raw = MMAP_THRESHOLD.raw(environ)
    if raw is None:
        return DEFAULT_MMAP_THRESHOLD
    return _parsed(MMAP_THRESHOLD, raw, int, "is not a number of bytes")


def harness_run_dir(environ: Environ | None = None) -> str:
    """``PARTITA_TEST_RUN_DIR``: set by the harness in every rank (KeyError outside one)."""
    raw = TEST_RUN_DIR.raw(environ)
    if raw is None:
        raise KeyError(f"{TEST_RUN_DIR.name} is not set: not a rank of partita.testing")
    return raw


def harness_start_method(environ: Environ | None = None) -> str:
    """``PARTITA_TEST_START_METHOD`` (``forkserver`` when unset)."""
    raw = TEST_START_METHOD.raw(environ)
    return "forkserver" if raw is None else raw
