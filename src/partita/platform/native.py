"""Builds partita's small C++ helpers (``csrc/*.cpp``) on first use, caches and loads them.

Each source is compiled with the system C++ compiler (``$CXX``, else ``c++``/``g++``/
``clang++``) into ``$PARTITA_CACHE_DIR`` (default ``~/.cache/partita``), under a name keyed by a
hash of the source, the flags, torch's version, the compiler and the C++ ABI, so later
processes load it at once. Helpers include at most ``c10`` headers, so a build takes about a
second, not the minutes of a torch extension.

[Note: what gets loaded]
Loading a library runs its constructors, so partita loads only what this user could have
written: the cache folder is used only when it is a directory owned by this user (effective
uid) that neither group nor others may write (created 0700), and a cached library only when it
is a regular file with the same owner and mode rule (else it is rebuilt over). When the cache
folder is unusable (cannot be created, another account's, group- or world-writable), the
library is built in a private folder from `tempfile.mkdtemp` (0700, unpredictable name, removed
at exit) and not shared with other processes; there is no shared, predictable fallback such as
``$TMPDIR/partita-<uid>``, which another account could create first. `load_library` also checks
the symbols its caller needs, so a stale or foreign file fails like a failed build.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from partita.platform import env

__all__ = ["CSRC", "LibraryError", "build_library", "cache_dir", "compiler", "load_library"]

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
"""The folder of the C++ sources."""


class LibraryError(RuntimeError):
    """A helper library could not be built, loaded, or lacks a symbol its caller needs."""


def cache_dir() -> Path:
    """Where built libraries are kept (``$PARTITA_CACHE_DIR`` or ``~/.cache/partita``); used
    only when it is private to this user (see [Note: what gets loaded])."""
    root = env.cache_dir() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "partita"
    )
    return Path(root)


def compiler() -> str | None:
    """The C++ compiler to use, or None when there is none."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def load_library(
    source: Path,
    cxx: str,
    symbols: Sequence[str],
    *,
    flags: Sequence[str] = (),
    link_c10: bool = False,
) -> ctypes.CDLL:
    """The library built from ``source`` (see `build_library`), loaded, with every name in
    ``symbols`` checked. Raises `LibraryError` when it cannot be built or loaded or lacks a
    symbol, so callers fall back in one place."""
    try:
        path = build_library(source, cxx, flags=flags, link_c10=link_c10)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        raise LibraryError(f"build or load of {source.name} failed: {exc}") from exc
    missing = [name for name in symbols if not hasattr(lib, name)]
    if missing:
        raise LibraryError(f"{path} lacks the symbols {', '.join(missing)}")
    return lib


def build_library(
    source: Path, cxx: str, *, flags: Sequence[str] = (), link_c10: bool = False
) -> Path:
    """The shared library built from ``source`` with ``flags`` (built now unless cached).

    ``link_c10`` adds torch's include folder and links ``libc10``. Raises RuntimeError when the
    compiler fails (its stderr in the message). The result lies in a folder only this user can
    write (see [Note: what gets loaded]).
    """
    torch_dir = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd_flags = ["-O3", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd_flags += list(flags)
    if link_c10:
        cmd_flags += [f"-I{torch_dir / 'include'}", f"-L{torch_dir / 'lib'}", "-lc10"]
        cmd_flags += [f"-Wl,-rpath,{torch_dir / 'lib'}"]
    key = hashlib.sha256(
        source.read_bytes()
        + f"|{' '.join(cmd_flags)}|{torch.__version__}|{cxx}|{sys.platform}".encode()
    ).hexdigest()[:16]
    name = f"{source.stem}-{key}.so"
    folder, writable = _cache_folder()
    if folder is not None:
        if _not_private(folder / name, directory=False) is None:
            return folder / name
        if not writable:
            folder = None
    target = (folder or _private_build_dir()) / name
    _compile([cxx, str(source), *cmd_flags], target)
    return target


def _compile(cmd: list[str], target: Path) -> None:
    """Runs ``cmd`` with ``-o`` a temporary file next to ``target``, renamed into place."""
    # Several ranks may build at once: each writes its own file and renames it into place.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    # The source comes first in ``cmd``: -l options only resolve symbols of inputs named
    # before them.
    cmd = [*cmd, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _not_private(path: Path, *, directory: bool) -> str | None:
    """Why another account could have written ``path`` (None when only this user could):
    missing, not a directory / regular file (symbolic links included), another owner, or
    writable by group or others."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        return f"{path} is not a {'directory' if directory else 'regular file'}"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}: writable by group or others"
    return None


_warned: set[str] = set()


def _cache_folder() -> tuple[Path | None, bool]:
    """The cache folder (created 0700 if missing) when it is private to this user, else None;
    and whether this process may write in it."""
    root = cache_dir()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder = root.resolve()  # a symbolic link to a private folder is fine
        why = _not_private(folder, directory=True)
    except OSError as exc:
        folder, why = root, f"cannot create {root}: {exc.strerror}"
    if why is None:
        return folder, os.access(folder, os.W_OK | os.X_OK)
    if why not in _warned:
        _warned.add(why)
        logger.warning(
            "partita: not using the helper cache (%s); building in a private temporary folder "
            f"instead (set {env.CACHE_DIR.name} to a folder of your own to cache builds)",
            why,
        )
    return None, False


_private_dir: Path | None = None
_private_lock = threading.Lock()


def _private_build_dir() -> Path:
    """This process's private build folder (`tempfile.mkdtemp`: 0700, unpredictable name),
    removed at exit."""
    global _private_dir
    with _private_lock:
        if _private_dir is None or not _private_dir.is_dir():
            _private_dir = Path(tempfile.mkdtemp(prefix="partita-build-"))
            atexit.register(shutil.rmtree, _private_dir, ignore_errors=True)
        return _private_dir
