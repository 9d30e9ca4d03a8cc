"""The hang watchdog: a rank that stops making progress ends the job within a set bound.

End to end, through the ``partita`` launcher with a small bound: a SIGSTOPped rank, and a rank
deadlocked outside any collective while the other waits in one, each end the job with a
non-zero status and a message naming the hung rank and every rank's last collective (without
the watchdog both jobs would sit until gloo's 30-minute timeout; the hang guards catch that).
The detection rules themselves are checked on hand-made heartbeats.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from launch_helpers import kill_all, running, start_launcher, wait_for_files, write_script
from partita.comm.heartbeat import Beat
from partita.launcher.watchdog import find_hang

# Three warm-up all-reduces, then report the pid; rank 1 then deadlocks outside any collective
# ("deadlock") or keeps reducing until the test stops it ("stop"); rank 0 keeps reducing.
HANG_SCRIPT = """
import os, sys, threading, time
from pathlib import Path

import torch

from partita import comm

out, mode = Path(sys.argv[-2]), sys.argv[-1]
comm.init_distributed(dist_backend="gloo")
rank = comm.get_rank()
t = torch.ones(4)
for _ in range(3):
    comm.all_reduce(t, tag="warmup")
# Two heartbeat intervals: the launcher has seen the warm-up before the test stops this rank.
time.sleep(2 * float(os.environ["PARTITA_HEARTBEAT_INTERVAL"]))
(out / f"pid{rank}").write_text(str(os.getpid()))
if rank == 1 and mode == "deadlock":
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns; this rank's heartbeat thread keeps running
while True:
    comm.all_reduce(t, tag="loop")
    time.sleep(0.02)
"""

HANG_GUARD_S = 120  # the job must end long before this; gloo alone would wait 30 minutes


def _run_hung_job(
    tmp_path: Path, mode: str, args: list[str], env: dict[str, str]
) -> tuple[int, str, list[int]]:
    script = write_script(tmp_path / "hang.py", HANG_SCRIPT)
    proc = start_launcher([*args, "--num_procs", "2", str(script), str(tmp_path), mode], env=env)
    pid_files = [tmp_path / f"pid{rank}" for rank in range(2)]
    pids: list[int] = []
    try:
        wait_for_files(pid_files, proc, guard_s=HANG_GUARD_S)
        pids = [int(p.read_text()) for p in pid_files]
        if mode == "stop":
            os.kill(pids[1], signal.SIGSTOP)
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        kill_all([proc.pid, *pids])
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"hang guard: the job did not end\n{out}\n{err}") from None
    finally:
        kill_all(pids)
    return proc.returncode, err, pids


def _assert_names_last_collectives(err: str) -> None:
    for rank in range(2):
        assert re.search(rf"rank {rank}: last collective all_reduce #\d+ \(tag '\w+'\)", err), err


def test_sigstopped_rank_ends_the_job_naming_it(tmp_path: Path) -> None:
    code, err, pids = _run_hung_job(tmp_path, "stop", [], {"PARTITA_HANG_TIMEOUT": "3"})
    assert code != 0, err
    assert re.search(r"partita: hang: rank 1 \(pid \d+\) sent no heartbeat for", err), err
    _assert_names_last_collectives(err)
    assert err.count("partita: hang:") == 1, err  # rank 0, left waiting, is not a second hang
    assert not [pid for pid in pids if running(pid)]


def test_rank_deadlocked_outside_collectives_ends_the_job(tmp_path: Path) -> None:
    code, err, pids = _run_hung_job(tmp_path, "deadlock", ["--hang_timeout", "3"], {})
    assert code != 0, err
    assert re.search(
        r"partita: hang: rank 0 has waited [\d.]+ s in all_reduce #\d+ \(tag 'loop'\) "
        r"while rank\(s\) 1 are in no collective",
        err,
    ), err
    assert re.search(r"rank 1: last collective all_reduce #3 \(tag 'warmup'\), finished", err)
    _assert_names_last_collectives(err)
    assert not [pid for pid in pids if running(pid)]


def _beat(rank: int, beat: float, waiting_since: float | None = None, seq: int = 5) -> Beat:
    return Beat(
        rank=rank,
        pid=1000 + rank,
        beat=beat,
        seq=seq,
        op="all_reduce",
        tag="grad",
        waiting_since=waiting_since,
        done_at=None if waiting_since is not None else beat - 1.0,
    )


def test_find_hang_quiet_job_is_not_a_hang() -> None:
    # Rank 1 computes for longer than the bound; nobody waits for it: not a hang.
    beats = [_beat(0, 99.0), _beat(1, 99.5)]
    assert find_hang(beats, now=100.0, timeout=10.0) is None
    # Waiting, but for less than the bound.
    beats = [_beat(0, 99.0, waiting_since=91.0), _beat(1, 99.5)]
    assert find_hang(beats, now=100.0, timeout=10.0) is None


def test_find_hang_stale_heartbeat_names_that_rank() -> None:
    beats = [_beat(0, 99.0, waiting_since=85.0, seq=6), _beat(1, 85.0)]
    hang = find_hang(beats, now=100.0, timeout=10.0)
    assert hang is not None and hang.culprits == [1]
    assert "rank 1 (pid 1001) sent no heartbeat for 15.0 s" in hang.message
    assert (
        "rank 1: last collective all_reduce #5 (tag 'grad'), finished 16.0 s ago " in hang.message
    )
    assert "(as of its last heartbeat, 15.0 s ago)" in hang.message


def test_find_hang_waiting_rank_names_the_ranks_outside_collectives() -> None:
    beats = [_beat(0, 99.0, waiting_since=85.0, seq=6), _beat(1, 99.5)]
    hang = find_hang(beats, now=100.0, timeout=10.0)
    assert hang is not None and hang.culprits == [1]
    assert "rank 0 has waited 15.0 s in all_reduce #6 (tag 'grad')" in hang.message
    assert "rank 1: last collective all_reduce #5 (tag 'grad'), finished 1.5 s ago" in hang.message


def test_find_hang_all_local_ranks_waiting_blames_other_nodes() -> None:
    # Every rank on this node waits: the rank they wait for is elsewhere; stop the local ones.
    beats = [_beat(2, 99.0, waiting_since=80.0), _beat(3, 99.0, waiting_since=85.0)]
    hang = find_hang(beats, now=100.0, timeout=10.0)
    assert hang is not None and hang.culprits == [2, 3]
    assert "no rank on this node is outside a collective" in hang.message


@pytest.mark.parametrize("value", ["-1", "abc", "nan"])
def test_bad_hang_timeout_is_refused_naming_the_variable(value: str) -> None:
    from partita.launcher.watchdog import hang_timeout_from_env

    with pytest.raises(ValueError, match=f"PARTITA_HANG_TIMEOUT={value!r}"):
        hang_timeout_from_env({"PARTITA_HANG_TIMEOUT": value})


def _collectives_are_recorded(directory: str) -> dict[str, object]:
    import torch

    from partita import comm
    from partita.comm.heartbeat import LAST_COLLECTIVE, read_beats

    log = LAST_COLLECTIVE
    start = log.last[0]
    t = torch.ones(4)
    comm.all_reduce(t, tag="a")
    after_sync = (log.last[0] - start, log.last[1:], log.waiting_since, log.done_at is not None)
    handle = comm.reduce_scatter(torch.empty(2), torch.ones(4), async_op=True, tag="rs")
    issued = (log.last[0] - start, log.last[1:], log.waiting_since)
    assert handle is not None
    handle.wait()
    comm.barrier()
    comm.broadcast_object("x")
    last = (log.last[0] - start, log.last[1:])
    beats = {b.rank: b for b in read_beats(directory)}
    mine = beats[comm.get_rank()]
    return {
        "after_sync": after_sync,
        "issued": issued,
        "last": last,
        "beat_pid_is_mine": mine.pid == os.getpid(),
        "beat_seq_counts_collectives": mine.seq >= start,
    }


def test_collectives_record_last_op_and_heartbeat_is_written(tmp_path: Path) -> None:
    from partita.testing import run_distributed

    beats = str(tmp_path / "beats")
    env = {"PARTITA_HEARTBEAT_DIR": beats, "PARTITA_HEARTBEAT_INTERVAL": "0.2"}
    results = run_distributed(_collectives_are_recorded, 2, beats, env=env, timeout=120)
    for result in results:
        # A blocking collective is done when it returns; an async one is issued, not waited on.
        assert result["after_sync"] == (1, ("all_reduce", "a"), None, True)
        assert result["issued"] == (2, ("reduce_scatter", "rs"), None)
        assert result["last"] == (4, ("broadcast_object", ""))
        assert result["beat_pid_is_mine"] and result["beat_seq_counts_collectives"]
    # destroy_process_group stopped each heartbeat and removed its file.
    assert not list(Path(beats).glob("rank*.json"))


def test_hang_timeout_from_env_default_and_values() -> None:
    from partita.launcher.watchdog import DEFAULT_HANG_TIMEOUT, hang_timeout_from_env

    # The bound: by default a hung job ends within 5 minutes (detection slack included).
    assert hang_timeout_from_env({}) == DEFAULT_HANG_TIMEOUT <= 300 - 10
    assert hang_timeout_from_env({"PARTITA_HANG_TIMEOUT": "2.5"}) == 2.5
    assert hang_timeout_from_env({"PARTITA_HANG_TIMEOUT": "0"}) == 0  # disabled
