"""Builds partita's small C++ helpers (``csrc/*.cpp``) on first use and caches the libraries.

Each source is compiled with the system C++ compiler (``$CXX``, else ``c++``/``g++``/
``clang++``) into ``$PARTITA_CACHE_DIR`` (default ``~/.cache/partita``; the temporary folder
when that is not writable), under a name keyed by a hash of the source, the flags, torch's
version, the compiler and the C++ ABI, so later processes load it at once. Helpers include at
most ``c10`` headers, so a build takes about a second, not the minutes of a torch extension.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["CSRC", "build_library", "cache_dir", "compiler"]

CSRC = Path(__file__).resolve().parent / "csrc"
"""The folder of the C++ sources."""


def cache_dir() -> Path:
    """Where built libraries are kept (``$PARTITA_CACHE_DIR`` or ``~/.cache/partita``)."""
    root = os.environ.get("PARTITA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "partita"
    )
    return Path(root)


def compiler() -> str | None:
    """The C++ compiler to use, or None when there is none."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def build_library(
    source: Path, cxx: str, *, flags: Sequence[str] = (), link_c10: bool = False
) -> Path:
    """The shared library built from ``source`` with ``flags`` (built now unless cached).

    ``link_c10`` adds torch's include folder and links ``libc10``. Raises RuntimeError when the
    compiler fails (its stderr in the message) or no folder is writable.
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
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"partita-{os.getuid()}"):
        if (folder / name).exists():
            return folder / name
        try:  # a read-only home falls back to the temporary folder
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:
            continue
    else:
        raise RuntimeError(f"no writable folder to build {name} in")
    target = folder / name
    # Several ranks may build at once: each writes its own file and renames it into place.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    # The source comes first: -l options only resolve symbols of inputs named before them.
    cmd = [cxx, str(source), *cmd_flags, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
