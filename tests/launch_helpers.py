"""Helpers for tests that run the ``partita`` launcher as a real process and watch its workers."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

CLI = [sys.executable, "-m", "partita.launcher.cli"]


def write_script(path: Path, text: str) -> Path:
    """Writes a dedented script and returns its path."""
    path.write_text(textwrap.dedent(text))
    return path


def start_launcher(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Starts ``partita <args>`` with captured output (read it with ``communicate``).

    Python's fault handler is on in the launcher and everything it starts, so a crash in
    native code (an agent exited -11 with no output in a full run, 2026-12-04) leaves every
    thread's stack in the output the test prints."""
    full_env = {"PYTHONFAULTHANDLER": "1", **os.environ, **(env or {})}
    return subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env
    )


def wait_for_files(
    paths: Iterable[Path],
    proc: subprocess.Popen[str] | Sequence[subprocess.Popen[str]],
    guard_s: float,
) -> None:
    """Waits until every path exists; fails (with its output) if a launcher in `proc` (one or
    several: each node's) exits first, or if the hang guard runs out."""
    paths = list(paths)
    procs = list(proc) if isinstance(proc, Sequence) else [proc]
    deadline = time.monotonic() + guard_s
    while not all(p.exists() for p in paths):
        for i, launcher in enumerate(procs):
            if launcher.poll() is not None:
                out, err = launcher.communicate()
                raise AssertionError(
                    f"launcher {i} of {len(procs)} exited {launcher.returncode} early:\n{out}\n{err}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: {[str(p) for p in paths if not p.exists()]} missing")
        time.sleep(0.05)


def running(pid: int) -> bool:
    """True while `pid` is a live process (a zombie has finished running)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], bound_s: float) -> list[int]:
    """Waits up to `bound_s` for every pid to stop running; returns those still running."""
    pids = list(pids)
    deadline = time.monotonic() + bound_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILLs the given test-started processes that are still there (clean-up after a
    failed assertion, so a broken launcher does not leave sleeping workers behind)."""
    for pid in pids:
        if running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def is_loopback(ip: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (::ffff:127.0.0.1)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """Local (address, port) of every listening TCP socket and bound UDP socket of `pid`."""
    found = []
    for conn in psutil.Process(pid).net_connections(kind="inet"):
        tcp_listen = conn.status == psutil.CONN_LISTEN
        udp_bound = conn.type == 2 and conn.laddr and not conn.raddr  # SOCK_DGRAM
        if tcp_listen or udp_bound:
            found.append((conn.laddr.ip, conn.laddr.port))
    return found


def finish(proc: subprocess.Popen[str], guard_s: float) -> tuple[str, str]:
    """The launcher's (stdout, stderr) once it exits; kills it and fails past the hang guard."""
    try:
        return proc.communicate(timeout=guard_s)
    except subprocess.TimeoutExpired:
        _dump_stacks(proc.pid)
        proc.kill()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired as still:
            # A process the launcher started outlives it holding its output pipes open.
            out, err = _text(still.stdout), _text(still.stderr)
            out += f"\n(launcher exited {proc.poll()}; its output is still held open)"
        message = f"hang guard: launcher still running after {guard_s} s\n{out}\n{err}"
        raise AssertionError(message) from None


def _dump_stacks(pid: int, wait_s: float = 3.0) -> None:
    """SIGABRTs `pid` and everything under it, workers first: with PYTHONFAULTHANDLER set
    (`start_launcher`) each prints every thread's stack into the launcher's output, so a hung
    job says where it hung (a two-node job hung after its workers' last step, 2026-12-05)."""
    try:
        tree = psutil.Process(pid).children(recursive=True)[::-1] + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        with contextlib.suppress(psutil.Error):
            member.send_signal(signal.SIGABRT)
    psutil.wait_procs(tree, timeout=wait_s)


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""
