"""Multi-node launch inputs (issue 18): hostfile and host filters, entry-point environments,
the ssh fan-out plan. Pure functions, table-driven; nothing here starts a training process."""

from __future__ import annotations

from pathlib import Path

import pytest

from partita.launcher import cli
from partita.launcher.hostfile import (
    HostfileError,
    parse_filter,
    parse_hostfile,
    resolve_resources,
)

POOL = {"a": 4, "b": 2, "c": 1}


# --- 1. hostfile, --include/--exclude, --num_nodes/--num_gpus/--num_procs -------------------


def test_hostfile_comments_blank_lines_and_order() -> None:
    text = "# cluster\n\nworker-1 slots=4\n  worker-0   slots=2  \n# end\n"
    assert list(parse_hostfile(text.splitlines(), "hf").items()) == [
        ("worker-1", 4),
        ("worker-0", 2),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=2\nb slots = 2\n", r"hf:2: expected 'HOST slots=N', got 'b slots = 2'"),
        ("a slots=2\n\nb\n", r"hf:3: expected 'HOST slots=N', got 'b'"),
        ("a slots=two\n", r"hf:1: expected"),
        ("a slots=2 extra\n", r"hf:1: expected"),
        ("a slots=0\n", r"hf:1: host 'a' has slots=0"),
        (
            "a slots=2\n#\nb slots=1\na slots=4\n",
            r"hf:4: host 'a' is listed again \(first on line 1\)",
        ),
        ("# nothing\n\n", r"hf: lists no host"),
    ],
)
def test_bad_hostfile_names_file_and_line(text: str, message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(text.splitlines(), "hf")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("a", {"a": []}),
        ("a@b:0,1", {"a": [], "b": [0, 1]}),
        ("b:1@b:0,1", {"b": [0, 1]}),
        ("b:1@b", {"b": []}),
    ],
)
def test_parse_filter(spec: str, expected: dict[str, list[int]]) -> None:
    assert parse_filter(spec, "--include") == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {"a": [0, 1, 2, 3], "b": [0, 1], "c": [0]}),
        ({"include": "b@a:1,3"}, {"a": [1, 3], "b": [0, 1]}),  # hostfile order, not flag order
        ({"exclude": "a:0,1@c"}, {"a": [2, 3], "b": [0, 1]}),
        ({"exclude": "a"}, {"b": [0, 1], "c": [0]}),
        ({"num_nodes": 2}, {"a": [0, 1, 2, 3], "b": [0, 1]}),
        ({"num_nodes": 2, "slots_per_node": 2}, {"a": [0, 1], "b": [0, 1]}),
        ({"include": "a:1,2,3", "slots_per_node": 2}, {"a": [1, 2]}),
    ],
)
def test_resolve_resources(kwargs: dict[str, object], expected: dict[str, list[int]]) -> None:
    assert resolve_resources(POOL, **kwargs) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "a@zz"}, r"--include: host 'zz' is not in the hostfile"),
        ({"exclude": "zz:0"}, r"--exclude: host 'zz' is not in the hostfile"),
        ({"include": "b:2"}, r"--include: host 'b' has no slot 2 \(the hostfile lists slots=2"),
        ({"include": "b:x"}, r"--include 'b:x': bad slot index 'x' for host 'b'"),
        ({"include": "a@@b"}, r"--include 'a@@b': bad host entry ''"),
        ({"include": "a", "exclude": "b"}, "--include and --exclude cannot be used together"),
        ({"exclude": "a@b@c"}, "leaves no slot on any host"),
        ({"num_nodes": 4}, r"--num_nodes 4 asks for more nodes than the 3 selected"),
        ({"slots_per_node": 2}, r"--num_gpus 2 asks for more slots than host 'c' has"),
        (
            {"include": "a:0", "slots_per_node": 2, "slots_flag": "--num_procs"},
            r"--num_procs 2 asks for more slots than host 'a' has selected \(1: 0\)",
        ),
    ],
)
def test_resolve_resources_refusals_name_the_host(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        resolve_resources(POOL, **kwargs)  # type: ignore[arg-type]


def _script(tmp_path: Path) -> str:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    return str(script)


@pytest.mark.parametrize(
    ("hostfile", "flags", "message"),
    [
        ("a slots=2\nb slots==2\n", [], ":2: expected 'HOST slots=N'"),
        ("a slots=2\nb slots=2\n", ["--include", "a@c"], "host 'c' is not in the hostfile"),
        ("a slots=2\nb slots=1\n", ["--num_procs", "2"], "more slots than host 'b'"),
        ("a slots=2\n", ["--num_nodes", "2"], "--num_nodes 2 asks for more nodes"),
    ],
)
def test_cli_refuses_before_anything_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hostfile: str,
    flags: list[str],
    message: str,
) -> None:
    path = tmp_path / "hostfile"
    path.write_text(hostfile)
    started: list[object] = []
    monkeypatch.setattr(cli, "launch", lambda *a: started.append(a) or 0)
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    status = cli.main(["--hostfile", str(path), *flags, _script(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2
    assert started == []
    assert message in err
    assert err.count("\n") == 1, err  # one line


def test_cli_names_a_missing_hostfile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert cli.main(["--hostfile", str(missing), _script(tmp_path)]) == 2
    assert f"hostfile {str(missing)!r}" in capsys.readouterr().err
