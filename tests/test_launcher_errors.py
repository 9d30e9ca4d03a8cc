"""What a failed job prints under the ``partita`` launcher: a configuration error's message once
and exit 2; a crash's traceback once, from the first failing rank, one line naming it, exit 1;
``PARTITA_DEBUG=1``: every rank's traceback and torch's summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from partita.config import ConfigError, load_config
from partita.launcher import failures
from partita.launcher.worker_exec import run_python

CLI = [sys.executable, "-m", "partita.launcher.cli"]

# The DeepSpeed way in: the config comes from --deepspeed_config.
TRAIN = """
import argparse

import torch

import partita as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
deepspeed.add_config_arguments(parser)
args = parser.parse_args()
model = torch.nn.Linear(4, 4)
deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
"""

# Every rank hits the same bug, as ranks running the same code usually do.
CRASH = """
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
ratio = 1 / 0
"""

GOOD = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def _launch(tmp_path: Path, script: str, *args: str, debug: bool = False) -> tuple[int, str]:
    """Runs a 2-rank CPU job in ``tmp_path``; returns its status and whole output."""
    path = _write(tmp_path / "train.py", script)
    env = {k: v for k, v in os.environ.items() if k != "PARTITA_DEBUG"}
    if debug:
        env["PARTITA_DEBUG"] = "1"
    result = subprocess.run(
        [*CLI, "--num_procs", "2", str(path), *args],
        capture_output=True,
        text=True,
        timeout=180,  # a hang guard, not a timing
        cwd=tmp_path,
        env=env,
    )
    return result.returncode, result.stdout + result.stderr


def _launch_config(tmp_path: Path, config: dict[str, object] | None) -> tuple[int, str]:
    name = "ds_config.json"
    if config is not None:
        (tmp_path / name).write_text(json.dumps(config))
    return _launch(tmp_path, TRAIN, "--deepspeed_config", name)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        pytest.param(
            {**GOOD, "zero_optimisation": {"stage": 1}},
            "zero_optimisation: unknown key; did you mean 'zero_optimization'?",
            id="typo",
        ),
        pytest.param(
            {**GOOD, "zero_optimization": {"stage": "one"}},
            "zero_optimization.stage: expected an integer",
            id="wrong-type",
        ),
        pytest.param(None, "cannot read the config file", id="missing-file"),
    ],
)
def test_config_error_prints_its_message_once_and_exits_2(
    tmp_path: Path, config: dict[str, object] | None, named: str
) -> None:
    status, output = _launch_config(tmp_path, config)
    lines = output.splitlines()
    assert status == 2, output
    assert len(lines) <= 3, output
    assert lines[0].startswith("partita: error: DeepSpeed config in ds_config.json: "), output
    assert named in lines[0], output
    # Both ranks usually get there; one may be stopped first when the other fails sooner.
    ranks = r"(ranks 0 and 1|rank [01])"
    assert re.fullmatch(
        rf"partita: {ranks} stopped on this error; PARTITA_DEBUG=1 shows the traceback", lines[-1]
    ), output
    assert "Traceback" not in output and "FAILED" not in output, output


def test_crash_prints_the_first_failing_rank_traceback_once_and_exits_1(tmp_path: Path) -> None:
    status, output = _launch(tmp_path, CRASH)
    assert status == 1, output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert output.count("ZeroDivisionError: division by zero") == 2, output  # traceback + line
    rank_lines = [line for line in output.splitlines() if line.startswith("partita:")]
    assert len(rank_lines) == 1, output
    assert rank_lines[0].startswith("partita: rank "), output
    assert " failed (exit 1): ZeroDivisionError: division by zero" in rank_lines[0], output
    # The script's own frames only: no launcher shim, no runpy, no torch summary or log lines.
    assert "worker_exec" not in output and "runpy" not in output, output
    assert "Root Cause" not in output and "SIGTERM" not in output, output


def test_debug_shows_every_rank_traceback_and_torch_summary(tmp_path: Path) -> None:
    (tmp_path / "ds_config.json").write_text(json.dumps({**GOOD, "zero_optimisation": {}}))
    status, output = _launch(tmp_path, TRAIN, "--deepspeed_config", "ds_config.json", debug=True)
    assert status == 2, output
    # Each rank that got to fail prints its own traceback (one may be stopped first, as before).
    tracebacks = output.count("Traceback (most recent call last)")
    assert tracebacks in (1, 2), output
    assert output.count("ConfigError: DeepSpeed config in ds_config.json: ") == tracebacks, output
    assert output.count("did you mean 'zero_optimization'?") == tracebacks, output
    # torch's log lines and failure block, and the launcher's headline over them.
    assert "failed (exitcode: 2)" in output and "Root Cause" in output, output
    # (torch picks the "first" failure by whole seconds: the stopped rank may tie with it.)
    assert re.search(r"failed first, exit code (2|-15); the other workers were stopped", output)


def test_single_problem_config_error_is_one_self_explaining_line(tmp_path: Path) -> None:
    # Without the launcher (python or torchrun) the traceback's last line is the message.
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 2, "zero_optimisation": {}}, world_size=1)
    assert str(info.value) == (
        "DeepSpeed config in <dict>: zero_optimisation: unknown key; did you mean "
        "'zero_optimization'?"
    )
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=f"DeepSpeed config in {missing}: cannot read"):
        load_config(str(missing), world_size=1)


@dataclass
class _Failure:
    """The fields of torch's ProcessFailure that `summarize` reads."""

    local_rank: int
    exitcode: int
    timestamp: int

    def signal_name(self) -> str:
        return "SIGSEGV" if self.exitcode == -11 else "Signals.UNKNOWN"


def test_summary_without_records_names_the_agent_first_failure(tmp_path: Path) -> None:
    agent = {0: _Failure(0, -15, 12), 5: _Failure(1, -11, 10)}
    line, status = failures.summarize(tmp_path, agent, node_rank=2, num_nodes=3)
    assert status == 1
    assert line == (
        "partita: rank 5 (local_rank 1 on node 2) failed (exit -11, SIGSEGV); "
        "the other workers were stopped"
    )


def _report(tmp_path: Path, rank: int, exc: BaseException, attempt: int = 0) -> int:
    environ = {
        "PARTITA_FAILURE_DIR": str(tmp_path),
        "RANK": str(rank),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
    }
    return failures.report_failure(exc, environ)


def test_only_the_first_rank_to_fail_prints_and_the_summary_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _report(tmp_path, 3, ZeroDivisionError("division by zero")) == 1
    assert _report(tmp_path, 1, RuntimeError("connection closed by peer\nmore")) == 1
    err = capsys.readouterr().err
    assert err.count("Traceback") == 0 and err.count("ZeroDivisionError") == 1, err
    # The agent may stop the first rank while it exits (SIGTERM); the line keeps its own status.
    line, status = failures.summarize(tmp_path, {3: _Failure(3, -15, 0), 1: _Failure(1, 1, 0)})
    assert status == 1
    assert line == (
        "partita: rank 3 failed (exit 1): ZeroDivisionError: division by zero; rank 1 failed "
        "too (PARTITA_DEBUG=1 shows every traceback)"
    )
    # A restart of the worker group has its own first rank; the summary reads its records only.
    assert _report(tmp_path, 1, ValueError("bad batch"), attempt=1) == 1
    assert "ValueError: bad batch" in capsys.readouterr().err
    line, _ = failures.summarize(tmp_path, {1: _Failure(1, 1, 0)})
    assert line == "partita: rank 1 failed (exit 1): ValueError: bad batch"


def test_user_error_prints_its_message_once_and_summary_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        load_config({"train_batch_size": "two"}, world_size=1)
    except ConfigError as exc:
        error = exc
    for rank in (0, 1, 2, 4):
        assert _report(tmp_path, rank, error) == 2
    err = capsys.readouterr().err
    assert err == f"partita: error: {error}\n"
    line, status = failures.summarize(tmp_path, {})
    assert (line, status) == (
        "partita: ranks 0-2 and 4 stopped on this error; PARTITA_DEBUG=1 shows the traceback",
        2,
    )


def test_ranks_phrase_joins_runs() -> None:
    assert failures.ranks_phrase([3]) == "rank 3"
    assert failures.ranks_phrase([1, 0]) == "ranks 0 and 1"
    assert failures.ranks_phrase([0, 1, 2, 3, 7, 9, 10]) == "ranks 0-3, 7, 9 and 10"


def test_run_python_runs_a_script_as_main_and_reports_its_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _write(
        tmp_path / "job.py",
        """
        import sys
        from pathlib import Path
        assert __name__ == "__main__" and Path(__file__).is_absolute()
        assert sys.path[0] == str(Path(__file__).resolve().parent), sys.path[0]
        print(sys.argv[1:])
        raise KeyError(sys.argv[1])
        """,
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    # Each in-process init_process_group of earlier tests wraps sys.excepthook with torch's
    # "[rank0]: " prefix (the full suite saw it three times); this test wants Python's own.
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.delenv("PARTITA_FAILURE_DIR", raising=False)
    assert run_python(str(script), ["--x=1"], module=False) == 1
    out, err = capsys.readouterr()
    assert out == "['--x=1']\n"
    # The traceback as `python job.py` prints it: the script's frame first, nothing above it.
    assert err.splitlines()[:2] == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 7, in <module>',
    ], err
    assert err.endswith("KeyError: '--x=1'\n"), err
