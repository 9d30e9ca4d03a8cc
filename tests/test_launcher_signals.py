"""The ``partita`` launcher and signals: killing it must not leave workers running.

- SIGKILL of the launcher (no chance to clean up) ends every worker within 10 s (the acceptance
  bound, asserted as an upper bound: the workers sleep for 600 s otherwise).
- SIGTERM and SIGINT stop the job: non-zero exit status, no worker left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from launch_helpers import (
    kill_all,
    running,
    start_launcher,
    wait_for_files,
    wait_gone,
    write_script,
)

# Records its pid and sleeps: only a signal from outside ends it early. No torch import, so the
# job is up quickly.
SLEEP_SCRIPT = """
import os, sys, time
from pathlib import Path

out = Path(sys.argv[-1])
rank = int(os.environ["RANK"])
(out / f"pid{rank}").write_text(str(os.getpid()))
time.sleep(600)
"""

SIGKILL_BOUND_S = 10.0


def _start_sleepers(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    script = write_script(tmp_path / "sleep.py", SLEEP_SCRIPT)
    proc = start_launcher(["--num_procs", "2", str(script), str(tmp_path)])
    pid_files = [tmp_path / f"pid{rank}" for rank in range(2)]
    wait_for_files(pid_files, proc, guard_s=120)
    return proc, [int(p.read_text()) for p in pid_files]


def test_sigkill_of_launcher_ends_every_worker(tmp_path: Path) -> None:
    proc, pids = _start_sleepers(tmp_path)
    try:
        assert all(running(pid) for pid in pids)
        os.kill(proc.pid, signal.SIGKILL)
        # wait(), not communicate(): surviving workers would hold the output pipes open.
        proc.wait(timeout=60)
        left = wait_gone(pids, SIGKILL_BOUND_S)
        assert not left, f"workers {left} still running {SIGKILL_BOUND_S} s after SIGKILL"
    finally:
        kill_all(pids)
        proc.communicate(timeout=60)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_stop_the_job_with_nonzero_status(
    tmp_path: Path, sig: signal.Signals
) -> None:
    proc, pids = _start_sleepers(tmp_path)
    try:
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=120)  # hang guard
        assert proc.returncode == 128 + sig, out + err
        assert f"stopped by {sig.name}" in err, err
        # The launcher waits for its workers before it exits: none may be left running.
        assert not [pid for pid in pids if running(pid)], f"workers left: {pids}"
    finally:
        kill_all(pids)
