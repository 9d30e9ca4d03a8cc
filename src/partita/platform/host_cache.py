"""partita's caching host allocator: builds, loads and installs ``csrc/host_cache.cpp``.

Training on the host allocates and frees the same large buffers every step; with glibc each
of them is a fresh mapping that page-faults and is zeroed again. The cache (a ``c10``
allocator installed as torch's CPU allocator) keeps freed blocks of 1 MiB and more and serves
requests of nearly the same size from them (a block up to 1/8 larger than the request); idle
blocks are unmapped (most recently freed first), then the unused tails of larger blocks in use,
before a new mapping would take the total past `HEADROOM` above the peak of the bytes tensors
asked for (page rounding aside; see the C++ file's header).

The C++ file is compiled on first use against torch's ``c10`` headers by `partita.platform.native`
(about a second; cached, see there). Without a compiler, or with ``PARTITA_HOST_CACHE=0``,
nothing is installed and `why_not` says why; callers then keep glibc's allocator.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass

from partita.platform import env, native

__all__ = [
    "HostCacheStats",
    "empty_host_cache",
    "host_cache_stats",
    "install_host_cache",
    "why_not",
]

logger = logging.getLogger(__name__)

_SOURCE = native.CSRC / "host_cache.cpp"
_SYMBOLS = ("partita_host_cache_install", "partita_host_cache_stats", "partita_host_cache_empty")
MIN_BYTES = 1 << 20
"""Blocks at least this large go through the cache; smaller ones stay with glibc's heap."""
HEADROOM = env.DEFAULT_HOST_CACHE_HEADROOM
"""Idle blocks are kept while the mapped total stays within (1 + HEADROOM) x the peak of the
bytes tensors asked for (``PARTITA_HOST_CACHE_HEADROOM`` overrides). Measured on 2 CPU ranks
training a 23M-parameter GPT-2, page faults per step and peak RSS of rank 0: glibc with a fixed
1 MB mmap threshold 190k, 1263 MB; glibc's defaults (DDP) 138k, 1374-1403 MB; the cache with
0.05: 70k, 1300 MB (stage 3: 81k, 1322 MB); with 0.1: 49k, 1335 MB (stage 3: 55k, 1355 MB);
without a limit: 2k, 1408 MB."""

_lib: ctypes.CDLL | None = None
_why_not: str | None = None


@dataclass(frozen=True)
class HostCacheStats:
    """What the cache holds: mapped bytes of blocks in use, idle bytes kept for reuse, the
    peak of both, requests served from the cache or by a new mapping, bytes unmapped so far,
    and the bytes tensors asked for (now and at the peak: the limit's base)."""

    live_bytes: int
    idle_bytes: int
    peak_mapped_bytes: int
    hits: int
    misses: int
    released_bytes: int
    requested_bytes: int
    peak_requested_bytes: int


def install_host_cache() -> bool:
    """Installs the cache as torch's CPU allocator for this process (idempotent). Returns
    whether it is installed; when not, `why_not` says why."""
    global _lib, _why_not
    if _lib is not None:
        return True
    if _why_not is not None:
        return False
    if not env.host_cache_enabled():
        _why_not = f"disabled by {env.HOST_CACHE.name}=0"
    elif not sys.platform.startswith("linux"):
        _why_not = f"not built on {sys.platform}"
    elif (cxx := native.compiler()) is None:
        _why_not = "no C++ compiler found (set CXX)"
    else:
        try:
            lib = native.load_library(_SOURCE, cxx, _SYMBOLS, link_c10=True)
            lib.partita_host_cache_install.argtypes = [ctypes.c_uint64, ctypes.c_double]
            lib.partita_host_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
            headroom = env.host_cache_headroom()
            lib.partita_host_cache_install(MIN_BYTES, headroom)
            _lib = lib
        except native.LibraryError as exc:
            _why_not = str(exc)
        except ValueError as exc:  # PARTITA_HOST_CACHE_HEADROOM is not a number (names it)
            _why_not = str(exc)
    if _why_not is not None:
        logger.info("partita host cache not installed: %s", _why_not)
    return _lib is not None


def why_not() -> str | None:
    """Why `install_host_cache` did not install the cache (None when it did or was not
    called)."""
    return _why_not


def host_cache_stats() -> HostCacheStats | None:
    """The cache's counters (None when it is not installed)."""
    if _lib is None:
        return None
    out = (ctypes.c_uint64 * 8)()
    _lib.partita_host_cache_stats(out)
    return HostCacheStats(*(int(v) for v in out))


def empty_host_cache() -> None:
    """Unmaps every idle block (a no-op when the cache is not installed)."""
    if _lib is not None:
        _lib.partita_host_cache_empty()
