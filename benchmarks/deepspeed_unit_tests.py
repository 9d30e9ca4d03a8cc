"""DeepSpeed's own unit tests, run against real DeepSpeed and against partita standing in (issue 35).

Measures how much of DeepSpeed's unit-test suite for the ZeRO, config, initialize, LR-schedule,
checkpoint, pipeline-schedule, topology and MoE files passes when ``import deepspeed`` is partita.
DeepSpeed's tests are read from a checkout the caller provides (nothing of DeepSpeed is copied
into this repository); they run as DeepSpeed's CPU CI runs them (``.github/workflows/
cpu-torch-latest.yml``: ``cd tests; pytest --forked unit/... --torch_ver=X`` with the markers of
``tests/pytest.ini``), with ``DS_ACCELERATOR=cpu``, one test at a time (no ``-n``: this machine
is shared).

Two sides, each one pytest session (resumed after a test DeepSpeed's harness calls hung):

- ``deepspeed``: the DeepSpeed installed in this interpreter; every selected test runs;
- ``partita``: the same interpreter with ``PARTITA_AS_DEEPSPEED=1`` (partita's start-up hook
  installs the ``deepspeed`` alias in the pytest process and in every worker it spawns); only the
  tests that passed on DeepSpeed run, since the figure is "of those, how many pass on partita".

Outcomes come from a small pytest plugin (``benchmarks/ds_unit_plugin/ds_unit_probe.py``) written
as JSON lines to the work folder. The summary prints the figures and partita's failures grouped
by their first error line, and ``--result`` writes it as markdown.

    python benchmarks/deepspeed_unit_tests.py --ds-tests /tmp/ds-src --side both \\
        --result benchmarks/results/deepspeed_unit_tests.md

``--ds-tests`` is a folder holding DeepSpeed's ``tests/`` (e.g. ``git archive <rev> tests``
from DeepSpeed's repository); a full checkout also works when its ``deepspeed/`` source tree is
the installed version (the tests put the checkout's root on ``sys.path``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PLUGIN_DIR = HERE / "ds_unit_plugin"

# The categories, as paths under DeepSpeed's tests/ (CPU-relevant files only).
# Ordered cheap-first (plain tests, then DistributedTest classes that spawn workers per test), so
# that a run cut short by --budget-s still covers every category.
DEFAULT_FILES = [
    "unit/runtime/test_ds_config_model.py",
    "unit/runtime/pipe/test_pipe_schedule.py",
    "unit/runtime/pipe/test_topology.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/zero/test_zero_tiled.py",
    "unit/checkpoint/test_reshape_checkpoint.py",
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_ds_initialize.py",
    "unit/runtime/zero/test_zero_leaf_module.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/v1/moe/test_moe.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/checkpoint/test_lr_scheduler.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/v1/zero/test_zero.py",
]

HUNG = "the pytest session ended during this test (DeepSpeed's harness: 'Test hanged, exiting', or a crash)"


def _read_probe(path: Path) -> tuple[list[str], dict[str, dict], dict[str, dict]]:
    """(collected ids in order, test records by id, collection errors by node id)."""
    collected: list[str] = []
    tests: dict[str, dict] = {}
    collect_errors: dict[str, dict] = {}
    if not path.exists():
        return collected, tests, collect_errors
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = record.get("kind")
        if kind == "collected":
            for nodeid in record["ids"]:
                if nodeid not in collected:
                    collected.append(nodeid)
        elif kind == "test":
            old = tests.get(record["id"])
            # a teardown error after a pass makes the test an error; keep the worst record
            if old is None or old["outcome"] == "passed":
                tests[record["id"]] = record
        elif kind == "collect_error":
            collect_errors[record["id"]] = record
    return collected, tests, collect_errors


def _env(side: str, work: Path, partita_src: str | None, timeout: int) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(PLUGIN_DIR)]
    extra = os.environ.get("DS_UNIT_EXTRA_PATH")  # e.g. a --target folder holding pytest-forked
    if extra:
        paths.append(extra)
    if side == "partita" and partita_src:
        paths.insert(0, partita_src)
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["DS_ACCELERATOR"] = "cpu"
    env["HF_HOME"] = env.get("HF_HOME", "/tmp/hf_home/")
    env["HF_HUB_OFFLINE"] = "1"
    env["DS_UNITTEST_TIMEOUT"] = str(timeout)
    env["DS_UNIT_PROBE_OUT"] = str(work / f"{side}.jsonl")
    if side == "partita":
        env["PARTITA_AS_DEEPSPEED"] = "1"
    else:
        env.pop("PARTITA_AS_DEEPSPEED", None)
    return env


def _torch_ver(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    return ".".join(out.stdout.strip().split("+")[0].split(".")[:2])


def _pytest_base(side: str, args: argparse.Namespace) -> list[str]:
    """The pytest command line both sides share, before the targets."""
    base = [args.python, "-m", "pytest", "-p", "ds_unit_probe", "-p", "no:cacheprovider"]
    base += [
        "--color=no",
        f"--timeout={args.test_timeout}",
        f"--torch_ver={_torch_ver(args.python)}",
    ]
    if side == "partita":
        base.append("--continue-on-collection-errors")
    if args.forked:  # DeepSpeed's CI runs --forked; pytest-forked 1.7.5 fails on pytest 9 (exit 3)
        base.append("--forked")
    return base


def _importable(
    side: str, base: list[str], work: Path, targets: list[str], run: dict[str, Any]
) -> list[str]:
    """The targets whose modules import (collecting them first records the others' errors)."""
    # A node id in a module that fails to import makes pytest stop with "found no collectors"
    # (exit 4) before running anything: collect the modules first and run only the ids of
    # those that import; the others are charged to their module's import error.
    modules = sorted({t.split("::")[0] for t in targets})
    listing = work / f"{side}.modules.txt"
    listing.write_text("\n".join(modules) + "\n", encoding="utf-8")
    with open(work / f"{side}.collect.txt", "w", encoding="utf-8") as out:
        subprocess.run(
            base + ["--collect-only", f"@{listing}"], stdout=out, stderr=subprocess.STDOUT, **run
        )
    _, _, collect_errors = _read_probe(work / f"{side}.jsonl")
    failed = {key.split("::")[0] for key in collect_errors}
    return [t for t in targets if t.split("::")[0] not in failed]


def _run_once(cmd: list[str], log: Path, deadline: float | None, run: dict[str, Any]) -> int | None:
    """One pytest session; its exit code, or None when it was killed at `deadline`."""
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **run
        )
        while proc.poll() is None:
            if deadline is not None and time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)  # the session this script started
                proc.wait()
                return None
            time.sleep(2)
    return proc.returncode


def run_side(
    side: str,
    args: argparse.Namespace,
    work: Path,
    targets: list[str],
) -> tuple[list[str], dict[str, dict], dict[str, dict]]:
    """Runs one side's pytest session (resuming after a hang); returns `_read_probe`'s triple."""
    probe = work / f"{side}.jsonl"
    probe.unlink(missing_ok=True)
    run = {
        "cwd": Path(args.ds_tests) / "tests",
        "env": _env(side, work, args.partita_src, args.hang_timeout),
    }
    base = _pytest_base(side, args)
    deadline = time.time() + args.budget_s if args.budget_s else None
    wanted = _importable(side, base, work, targets, run) if side == "partita" else list(targets)
    if not wanted:
        return _read_probe(probe)
    hung: dict[str, dict] = {}
    order = [t for t in targets if "::" in t]
    for attempt in range(args.max_resumes + 1):
        argsfile = work / f"{side}.args{attempt}.txt"
        argsfile.write_text("\n".join(wanted) + "\n", encoding="utf-8")
        log = work / f"{side}.log{attempt}.txt"
        print(f"[{side}] {len(wanted)} targets, log {log}", flush=True)
        t0 = time.time()
        rc = _run_once(base + [f"@{argsfile}"], log, deadline, run)
        collected, tests, collect_errors = _read_probe(probe)
        print(
            f"[{side}] pytest exit {rc} after {time.time() - t0:.0f}s: {len(tests)} tests reported",
            flush=True,
        )
        if attempt == 0 and side == "deepspeed":
            order = list(collected)
        failed_modules = {key.split("::")[0] for key in collect_errors}
        remaining = [
            t
            for t in order
            if t not in tests and t not in hung and t.split("::")[0] not in failed_modules
        ]
        if rc is None:
            print(
                f"[{side}] out of time (--budget-s {args.budget_s}): {len(remaining)} not reached",
                flush=True,
            )
            break
        if not remaining or rc == 4:  # 4: a usage error (an id pytest cannot find), not a hang
            break
        hung[remaining[0]] = {"kind": "test", "id": remaining[0], "outcome": "hung", "first": HUNG}
        wanted = remaining[1:]
        if not wanted:
            break
    collected, tests, collect_errors = _read_probe(probe)
    for key, record in hung.items():
        tests.setdefault(key, record)
    return collected, tests, collect_errors


_ADDR = re.compile(r"0x[0-9a-fA-F]+")


def _group_key(message: str) -> str:
    message = _ADDR.sub("0x…", message or "(no message)")
    return message[:240]


def _outcome_for(nodeid: str, tests: dict[str, dict], collect_errors: dict[str, dict]) -> dict:
    if nodeid in tests:
        return tests[nodeid]
    module = nodeid.split("::")[0]
    for key, record in collect_errors.items():
        if key == module or module.startswith(key.rstrip("/") + "/") or key == "":
            return {"outcome": "collect_error", "first": record["first"], "tail": record["tail"]}
    return {"outcome": "not_run", "first": "not reported by pytest"}


def _git(args: list[str], cwd: Path) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    return out.stdout.strip()


def _header(
    args: argparse.Namespace, ds: tuple[list[str], dict[str, dict], dict[str, dict]], command: str
) -> tuple[list[str], list[str], collections.Counter[str]]:
    """The report's head (what ran, DeepSpeed's outcomes); also the ids DeepSpeed passed and
    how many per file."""
    collected, ds_tests, _ = ds
    counts = collections.Counter(ds_tests[t]["outcome"] for t in collected if t in ds_tests)
    passed = [t for t in collected if ds_tests.get(t, {}).get("outcome") == "passed"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = _git(["rev-parse", "--short", "HEAD"], REPO)
    dirty = _git(["status", "--porcelain", "--untracked-files=no", "--", "src"], REPO)
    src = args.partita_src or str(REPO / "src")
    edits = " (src/ had uncommitted edits)" if dirty and not args.partita_src else ""
    selection = (
        f"- node ids from {args.ids_from}, in that order"
        if args.ids_from
        else f"- files: {', '.join(args.files)}"
    )
    per_file = collections.Counter(t.split("::")[0] for t in passed)
    reached = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    lines = [
        "# DeepSpeed's unit tests on real DeepSpeed and on partita",
        "",
        f"- date: {now}",
        f"- partita: commit {commit}{edits}, source {src}",
        f"- DeepSpeed tests: {args.ds_label or args.ds_tests}",
        f"- command: `{command}`",
        selection,
        "",
        f"Selected (after tests/pytest.ini's marker deselection): {len(collected)}",
        "",
        f"On DeepSpeed: {reached}; not reached (--budget-s) "
        f"{len([t for t in collected if t not in ds_tests])}",
        "",
        "Passed on DeepSpeed, per file: "
        + ", ".join(f"{k} {v}" for k, v in sorted(per_file.items())),
    ]
    return lines, passed, per_file


def _partita_lines(
    args: argparse.Namespace,
    passed: list[str],
    per_file: collections.Counter[str],
    pt: tuple[list[str], dict[str, dict], dict[str, dict]],
) -> list[str]:
    """partita's figure on the tests DeepSpeed passed, per file, and its failures grouped."""
    _, pt_tests, pt_errors = pt
    outcomes = {t: _outcome_for(t, pt_tests, pt_errors) for t in passed}
    ok = [t for t in passed if outcomes[t]["outcome"] == "passed"]
    pct = 100.0 * len(ok) / len(passed) if passed else 0.0
    pt_counts = collections.Counter(o["outcome"] for o in outcomes.values())
    pt_file_ok = collections.Counter(t.split("::")[0] for t in ok)
    lines = [
        "",
        f"**DeepSpeed passes {len(passed)}; partita passes {len(ok)} of them = {pct:.1f}%**",
        "",
        "On partita (of those): " + ", ".join(f"{k} {v}" for k, v in sorted(pt_counts.items())),
        "",
        "| file | DeepSpeed passes | partita passes |",
        "| --- | ---: | ---: |",
    ]
    lines += [
        f"| {name} | {per_file[name]} | {pt_file_ok.get(name, 0)} |" for name in sorted(per_file)
    ]
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for t in passed:
        o = outcomes[t]
        if o["outcome"] != "passed":
            groups[f"[{o['outcome']}] " + _group_key(o.get("first", ""))].append(t)
    lines += [
        "",
        f"## partita's failures, grouped by first error line ({len(passed) - len(ok)} tests)",
    ]
    for key, ids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = ids[: args.show_ids]
        lines += ["", f"### {len(ids)} x {key}"] + [f"- `{t}`" for t in shown]
        if len(ids) > len(shown):
            lines.append(f"- ... and {len(ids) - len(shown)} more")
    return lines


def summarize(
    args: argparse.Namespace,
    ds: tuple[list[str], dict[str, dict], dict[str, dict]],
    pt: tuple[list[str], dict[str, dict], dict[str, dict]] | None,
    command: str,
) -> str:
    """The markdown report: DeepSpeed's half, then (when run) partita's on the same tests."""
    lines, passed, per_file = _header(args, ds, command)
    if pt is not None:
        lines += _partita_lines(args, passed, per_file, pt)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ds-tests", required=True, help="folder holding DeepSpeed's tests/")
    parser.add_argument("--ds-label", default="", help="what the tests are (repository, commit)")
    parser.add_argument("--side", choices=["deepspeed", "partita", "both"], default="both")
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="paths under tests/")
    parser.add_argument("--ids-from", default=None, help="run these node ids (one a line) instead")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--work", default="/tmp/ds-unit-work", help="probe records and logs")
    parser.add_argument(
        "--partita-src", default=None, help="a partita src/ to put first on PYTHONPATH"
    )
    parser.add_argument("--test-timeout", type=int, default=600, help="pytest-timeout, seconds")
    parser.add_argument("--hang-timeout", type=int, default=300, help="DS_UNITTEST_TIMEOUT")
    parser.add_argument(
        "--forked", action="store_true", help="run each test in a fork (pytest-forked)"
    )
    parser.add_argument(
        "--budget-s", type=int, default=0, help="stop a side after this long (0: none)"
    )
    parser.add_argument("--max-resumes", type=int, default=10)
    parser.add_argument("--show-ids", type=int, default=8)
    parser.add_argument("--result", default=None, help="write the summary here (markdown)")
    args = parser.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if (Path(args.ds_tests) / "deepspeed").is_dir():
        print(
            "note: the checkout's deepspeed/ is on the tests' sys.path (tests/conftest.py)",
            flush=True,
        )
    targets = list(args.files)
    if args.ids_from:  # node ids, one a line: e.g. the plain tests first, the spawning ones after
        targets = [t for t in Path(args.ids_from).read_text().splitlines() if t.strip()]
    if args.side in ("deepspeed", "both"):
        ds = run_side("deepspeed", args, work, targets)
    else:
        ds = _read_probe(work / "deepspeed.jsonl")
    pt = None
    if args.side in ("partita", "both"):
        collected, ds_tests, _ = ds
        passed = [t for t in collected if ds_tests.get(t, {}).get("outcome") == "passed"]
        pt = run_side("partita", args, work, passed)
    elif (work / "partita.jsonl").exists():
        pt = _read_probe(work / "partita.jsonl")
    text = summarize(args, ds, pt, command)
    print(text)
    if args.result:
        Path(args.result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
