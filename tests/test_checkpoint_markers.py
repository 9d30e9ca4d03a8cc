"""Arrival markers (see [Note: arrival markers] in partita/checkpoint/arrival.py): a process
killed while writing its marker leaves nothing that outlives the next save.

Found by tests/test_checkpoint_crash.py: a rank killed between creating its marker and writing
its "<host> pid <pid>" line left an empty marker, which the next save could not attribute to
anyone and so kept (the trial after reported it as a leftover).
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from partita.checkpoint import arrival


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_partial_marker_of_a_dead_writer_is_removed_and_a_live_ones_kept(
    tmp_path: Path,
) -> None:
    calls = tmp_path / arrival.CALLS_DIR
    calls.mkdir()
    host = socket.gethostname()
    dead = f"save-00000003-rank00000.partial-{_dead_pid()}-{host}"
    live = f"save-00000003-rank00001.partial-{os.getppid()}-{host}"
    (calls / dead).write_text("")  # killed before writing a byte
    (calls / live).write_text("")  # another job's process, still writing
    arrival.remove_stale_markers(str(tmp_path), members=[])
    assert sorted(os.listdir(calls)) == [live]


def test_a_partial_marker_of_this_job_is_removed(tmp_path: Path) -> None:
    calls = tmp_path / arrival.CALLS_DIR
    calls.mkdir()
    host, pid = arrival.job_member()
    (calls / f"load-00000007-rank00000.partial-{pid}-{host}").write_text("")
    arrival.remove_stale_markers(str(tmp_path), members=[(host, pid)])
    assert os.listdir(calls) == []
