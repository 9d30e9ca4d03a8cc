"""A pytest plugin for benchmarks/deepspeed_unit_tests.py: records every test's outcome to JSON.

Loaded with ``-p ds_unit_probe`` (this folder on PYTHONPATH) into a pytest run of DeepSpeed's
``tests/``. It writes ``$DS_UNIT_PROBE_OUT`` (JSON lines, appended as tests finish, so a run cut
short keeps what it saw): one ``collected`` record with the node ids, one record per test
(``passed`` / ``failed`` / ``error`` / ``skipped``, the first error line and the tail of the
traceback), and one record per module that failed to import.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_OUT = os.environ.get("DS_UNIT_PROBE_OUT", "")
_TAIL = 4000


def _write(record: dict[str, Any]) -> None:
    if not _OUT:
        return
    with open(_OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _first_line(report: Any) -> str:
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        message = crash.message
    elif isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        message = str(longrepr[2])
    else:
        text = str(longrepr).strip().splitlines()
        errors = [line for line in text if line.startswith("E ")]
        message = errors[0][1:].strip() if errors else (text[-1] if text else "")
    return message.strip().splitlines()[0] if message.strip() else ""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    _write({"kind": "collected", "ids": [item.nodeid for item in items]})


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _write(
            {
                "kind": "collect_error",
                "id": report.nodeid,
                "first": _first_line(report),
                "tail": str(report.longrepr)[-_TAIL:],
            }
        )


def pytest_runtest_logreport(report: Any) -> None:
    outcome = None
    if report.when == "call":
        outcome = report.outcome
    elif report.when == "setup" and not report.passed:
        outcome = "skipped" if report.skipped else "error"
    elif report.when == "teardown" and report.failed:
        outcome = "teardown_error"
    if outcome is None:
        return
    record: dict[str, Any] = {"kind": "test", "id": report.nodeid, "outcome": outcome}
    record["duration"] = round(report.duration, 2)
    if outcome != "passed":
        record["first"] = _first_line(report)
        if outcome != "skipped":
            record["tail"] = str(report.longrepr)[-_TAIL:]
    _write(record)
