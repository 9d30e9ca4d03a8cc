"""Loading partita's compiled helpers (partita.platform.native): only libraries this user built,
in a folder nobody else can write, are loaded; a library without the expected symbols falls
back like a failed build.

A planted library (its constructor writes a marker file) stands in for one another account put
where a build is looked for; each case shows it is never loaded. The helper built here is a
two-line C++ file, so no case compiles against torch's headers."""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from partita.optim import adam_kernel
from partita.platform import host_cache, native

CXX = native.compiler()
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

HELPER = 'extern "C" int partita_test_answer() { return 42; }\n'
PLANTED = """
#include <cstdio>
extern "C" int partita_test_answer() { return 666; }
__attribute__((constructor)) static void planted() {
  std::FILE* f = std::fopen(MARKER, "w");
  if (f != nullptr) { std::fputs("planted library ran", f); std::fclose(f); }
}
"""
OTHER_UID = 65534  # "nobody": another account


def _compile(code: str, out: Path, *defines: str) -> Path:
    src = out.with_suffix(".cpp")
    src.write_text(code)
    cmd = [str(CXX), "-shared", "-fPIC", *defines, str(src), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return out


class Setup:
    """A helper source, the name its build gets, and a planted library of that name."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.source = root / "helper.cpp"
        self.source.write_text(HELPER)
        self.marker = root / "marker.txt"
        # The name a build of the helper gets (keyed by source, flags, compiler, torch).
        monkeypatch.setenv("PARTITA_CACHE_DIR", str(root / "reference"))
        self.name = native.build_library(self.source, str(CXX)).name
        self.planted = _compile(PLANTED, root / "planted.so", f'-DMARKER="{self.marker}"')

    def plant(self, folder: Path) -> Path:
        """Copies the planted library into ``folder`` under the helper's name."""
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / self.name
        target.write_bytes(self.planted.read_bytes())
        return target

    def foreign(self, path: Path) -> None:
        """Makes ``path`` another account's: chown where allowed (root), else this process
        pretends to be another user."""
        if os.geteuid() == 0:
            os.chown(path, OTHER_UID, OTHER_UID)
        else:
            uid = os.geteuid() + 1
            self.monkeypatch.setattr(os, "geteuid", lambda: uid)

    def load(self) -> int:
        """Builds (or finds) the helper as partita does and calls it; checks the marker."""
        path = native.build_library(self.source, str(CXX))
        answer = ctypes.CDLL(str(path)).partita_test_answer()
        assert not self.marker.exists(), f"the planted library was loaded from {path}"
        return int(answer)


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return Setup(tmp_path, monkeypatch)


def test_unusable_cache_never_loads_a_library_planted_in_the_temporary_folder(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache folder cannot be created (here: below a file), so the build goes elsewhere;
    another account made the predictable ``$TMPDIR/partita-<uid>`` and put its library in."""
    (setup.root / "a-file").write_text("")
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(setup.root / "a-file" / "cache"))
    shared = Path(tempfile.gettempdir()) / f"partita-{os.getuid()}"
    setup.plant(shared)
    shared.chmod(0o777)
    setup.foreign(shared)
    assert setup.load() == 42


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_group_or_world_writable_cache_is_not_used(setup: Setup, mode: int) -> None:
    cache = setup.root / "shared-cache"
    setup.plant(cache)
    cache.chmod(mode)
    setup.monkeypatch.setenv("PARTITA_CACHE_DIR", str(cache))
    assert setup.load() == 42
    assert stat.S_IMODE(cache.stat().st_mode) == mode  # left as it was, not "repaired"


def test_cache_owned_by_another_account_is_not_used(setup: Setup) -> None:
    cache = setup.root / "their-cache"
    setup.plant(cache)
    cache.chmod(0o755)
    setup.foreign(cache)
    setup.monkeypatch.setenv("PARTITA_CACHE_DIR", str(cache))
    assert setup.load() == 42


@pytest.mark.parametrize("how", ["world-writable", "foreign"])
def test_library_file_others_could_write_is_rebuilt(setup: Setup, how: str) -> None:
    """A private cache folder, but the library file in it is not this user's alone."""
    cache = setup.root / "cache"
    cache.mkdir(mode=0o700)
    planted = setup.plant(cache)
    if how == "foreign" and os.geteuid() == 0:
        os.chown(planted, OTHER_UID, OTHER_UID)
    else:
        planted.chmod(0o666)
    setup.monkeypatch.setenv("PARTITA_CACHE_DIR", str(cache))
    assert setup.load() == 42


def test_private_cache_is_created_0700_and_reused(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = setup.root / "new" / "cache"
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(cache))
    first = native.build_library(setup.source, str(CXX))
    assert first.parent == cache
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    monkeypatch.setattr(subprocess, "run", _no_compiler)
    assert native.build_library(setup.source, str(CXX)) == first  # cached: no second build


def _no_compiler(*args: object, **kwargs: object) -> None:
    raise AssertionError(f"compiler run again: {args}")


def test_library_without_its_symbols_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library of the right name but not the right content (a stale or truncated build)."""
    empty = _compile('extern "C" int partita_nothing() { return 0; }\n', tmp_path / "e.so")
    monkeypatch.setattr(native, "build_library", lambda *args, **kwargs: empty)
    for env in ("PARTITA_CPU_ADAM", "PARTITA_HOST_CACHE", "PARTITA_HOST_CACHE_HEADROOM"):
        monkeypatch.delenv(env, raising=False)
    # The kernel checks the CPU before building: make any CPU pass that check here.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(adam_kernel, "_lib", None)
    monkeypatch.setattr(adam_kernel, "_why_not", None)
    assert not adam_kernel.available()
    assert "partita_adam_isa" in str(adam_kernel.why_not()), adam_kernel.why_not()
    monkeypatch.setattr(host_cache, "_lib", None)
    monkeypatch.setattr(host_cache, "_why_not", None)
    assert not host_cache.install_host_cache()
    assert "partita_host_cache_install" in str(host_cache.why_not()), host_cache.why_not()
