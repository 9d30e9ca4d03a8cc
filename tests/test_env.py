"""partita's environment variables: read in one module (`partita.platform.env`), listed in the docs.

A variable read (or named) anywhere else would drift from its documentation; the table in
docs/environment.md is generated from `partita.platform.env`, so a variable added there and not
to the page fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from partita.testing.interpreter import run_python

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "partita"
ENV_PAGE = SRC.parent / "docs" / "environment.md"
_NAME = re.compile(r"PARTITA_[A-Z][A-Z0-9_]*")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose, not names the code uses)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            # A module/class/function docstring, or an attribute docstring after an assignment.
            after_assign = i > 0 and isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))
            is_text = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            if (i == 0 or after_assign) and is_text and isinstance(stmt.value.value, str):
                found.add(id(stmt.value))
    return found


def _names_outside_env_module() -> list[str]:
    """``file:line: NAME`` for every ``PARTITA_*`` name in code (not prose) outside
    platform/env.py."""
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "platform" / "env.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in prose:
                    continue
                for name in _NAME.findall(node.value):
                    hits.append(f"{path.relative_to(SRC)}:{node.lineno}: {name}")
    return hits


def test_variables_are_named_only_in_env_module() -> None:
    """No ``PARTITA_*`` string in code outside `partita.platform.env`: readers call its accessors,
    writers (the launcher, the test harness) use its `EnvVar.name`, messages format it in."""
    hits = _names_outside_env_module()
    assert not hits, "PARTITA_* named outside partita/platform/env.py:\n" + "\n".join(hits)


def test_every_variable_is_registered() -> None:
    """Every `EnvVar` the module defines is in `VARIABLES` (what the table lists), once."""
    from partita.platform import env

    defined = [v for v in vars(env).values() if isinstance(v, env.EnvVar)]
    assert sorted(v.name for v in defined) == sorted(v.name for v in env.VARIABLES)
    assert len({v.name for v in env.VARIABLES}) == len(env.VARIABLES)
    for var in env.VARIABLES:
        assert _NAME.fullmatch(var.name), var.name
        assert var.doc.strip() and var.values.strip() and var.default.strip(), var.name


def test_docs_list_every_variable() -> None:
    """docs/environment.md holds the table `partita.platform.env.markdown_table()` generates,
    verbatim."""
    from partita.platform import env

    table = env.markdown_table()
    assert all(f"`{v.name}`" in table for v in env.VARIABLES)
    page = ENV_PAGE.read_text()
    missing = [v.name for v in env.VARIABLES if f"| `{v.name}` |" not in page]
    assert table in page, (
        f"docs/environment.md's table is not what partita.platform.env defines (missing: "
        f"{missing or 'none; a row differs'}); replace it with the output of "
        "`python -c 'import partita.platform.env as e; print(e.markdown_table())'`"
    )


def test_startup_hook_reads_the_switch_as_env_does() -> None:
    """The ``.pth`` hook cannot import partita before it knows the switch is on (it runs in
    every interpreter), so it spells the name and the off-values itself: they must match."""
    from partita.platform import env

    hook = (SRC / "partita-as-deepspeed.pth").read_text().replace('"', "'")
    assert f"os.environ.get('{env.AS_DEEPSPEED.name}', '')" in hook
    assert f"not in {env.OFF_VALUES!r}" in hook


@pytest.mark.parametrize("value", ["", "0", "false", "No", " off ", "1", "yes", "true"])
def test_as_deepspeed_matches_startup_hook(value: str) -> None:
    """`as_deepspeed` and the hook's expression agree on each value."""
    from partita.platform import env

    hook = (SRC / "partita-as-deepspeed.pth").read_text()
    condition = hook.split(" and ")[0].split(";", 1)[1].strip()
    fake_os = type("os", (), {"environ": {env.AS_DEEPSPEED.name: value}})
    assert eval(condition, {"os": fake_os}) is env.as_deepspeed({env.AS_DEEPSPEED.name: value})


def test_accessors_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable set after import is seen (tests set os.environ); unset gives the default."""
    from partita.platform import env

    for var in env.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert env.hang_timeout() == env.DEFAULT_HANG_TIMEOUT
    assert env.collectives() == "auto" and env.data_seed() == 0
    assert env.cpu_adam_enabled() and env.host_cache_enabled()
    assert env.mmap_threshold() == 1 << 20 and env.checkpoint_timeout_s() is None
    assert env.forced_accelerator() == "" and not env.as_deepspeed()
    monkeypatch.setenv("DS_ACCELERATOR", "CPU")
    assert env.forced_accelerator() == "cpu"  # DeepSpeed's variable, when partita's is unset
    for name, value in [("HANG_TIMEOUT", "7"), ("COLLECTIVES", "native"), ("DATA_SEED", "3")]:
        monkeypatch.setenv(getattr(env, name).name, value)
    monkeypatch.setenv(env.CPU_ADAM.name, "0")
    monkeypatch.setenv(env.ACCELERATOR.name, "cuda")
    assert env.hang_timeout() == 7 and env.collectives() == "native" and env.data_seed() == 3
    assert not env.cpu_adam_enabled() and env.forced_accelerator() == "cuda"


@pytest.mark.parametrize(
    ("accessor", "var", "value"),
    [
        ("hang_timeout", "HANG_TIMEOUT", "soon"),
        ("hang_timeout", "HANG_TIMEOUT", "-1"),
        ("heartbeat_interval", "HEARTBEAT_INTERVAL", "0"),
        ("checkpoint_timeout_s", "CHECKPOINT_TIMEOUT", "later"),
        ("data_seed", "DATA_SEED", "1.5"),
        ("mmap_threshold", "MMAP_THRESHOLD", "1MB"),
        ("host_cache_headroom", "HOST_CACHE_HEADROOM", "lots"),
    ],
)
def test_bad_value_names_the_variable(accessor: str, var: str, value: str) -> None:
    """A value that does not parse is a ValueError naming the variable and the value."""
    from partita.platform import env

    name = getattr(env, var).name
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
        getattr(env, accessor)({name: value})


def test_importing_env_imports_nothing_heavy() -> None:
    """The launcher's --help and the start-up hook import it: no torch, no pydantic."""
    out = run_python(
        "import sys, partita.platform.env; print(sorted(m for m in ('torch', 'pydantic', 'numpy') "
        "if m in sys.modules))"
    )
    assert out == "[]"
