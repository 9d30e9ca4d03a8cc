"""The comms logger lists every collective partita issues by op and message size, in DeepSpeed's
``log_summary`` table, with the same bytes partita's counters hold."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import partita
from partita import comm
from partita.compat.deepspeed import comm as ds_comm
from partita.config.sections.profiling import CommsLoggerConfig
from partita.profiling.comms import COMMS_LOGGER, bandwidths
from partita.testing import run_distributed

HEADER = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
          "tput_avg (Gbps)", "busbw_avg (Gbps)"]  # fmt: skip


@pytest.fixture(autouse=True)
def _logger_off() -> Any:
    COMMS_LOGGER.configure(CommsLoggerConfig())
    COMMS_LOGGER.reset()
    yield
    COMMS_LOGGER.configure(CommsLoggerConfig())
    COMMS_LOGGER.reset()


def test_bandwidths_follow_deepspeeds_formulas() -> None:
    assert bandwidths("all_reduce", 10**9, 1.0, 2) == pytest.approx((16.0, 8.0))
    assert bandwidths("all_gather", 10**9, 1.0, 4) == pytest.approx((8.0, 6.0))
    assert bandwidths("broadcast", 10**9, 2.0, 4) == pytest.approx((4.0, 4.0))


def test_single_process_summary_prints_deepspeeds_table(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    ds_comm.configure(enabled=True, verbose=True)
    with caplog.at_level(logging.INFO, logger="partita"):
        comm.all_reduce(torch.ones(256))
    assert any("comm op: all_reduce" in r.message for r in caplog.records)
    result = ds_comm.log_summary(return_dict=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("  ")[0] == "Comm. Op" and all(h in lines[0] for h in HEADER)
    assert lines[1] == "all_reduce" and lines[2].split()[:3] == ["1", "KB", "1"]
    assert result is not None and result["summary"]["all_reduce"][1024]["count"] == 1


def _logged_run(_: Any) -> dict[str, Any]:
    """Engine steps and direct collectives with the logger on, then with only broadcasts."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
        "comms_logger": {"enabled": True, "debug": True},
    }
    engine, *_ = partita.initialize(model=model, config=config)
    COMMS_LOGGER.reset()
    comm.COUNTERS.reset()
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    for _ in range(3):
        comm.all_reduce(torch.ones(1000), tag="probe")
    comm.broadcast(torch.ones(10), src=0, tag="probe")
    summary = ds_comm.log_summary(return_dict=True)["summary"]  # type: ignore[index]
    counted = {op: comm.COUNTERS.bytes(op) for (op, _) in comm.COUNTERS.total_bytes}
    table = COMMS_LOGGER.table()
    ds_comm.configure(debug=False, prof_all=False, prof_ops=["broadcast"])
    COMMS_LOGGER.reset()
    comm.all_reduce(torch.ones(4))
    comm.broadcast(torch.ones(4), src=0)
    only = COMMS_LOGGER.summary()
    return {"summary": summary, "counted": counted, "table": table, "only": only}


def test_two_ranks_log_every_collective_with_the_counters_bytes() -> None:
    for result in run_distributed(_logged_run, 2, None, timeout=240):
        summary = result["summary"]
        probe = summary["all_reduce | [tag: probe]"][4000]
        assert probe["count"] == 3 and probe["msg_size_str"] == "3.91 KB"
        assert probe["total_latency_ms"] > 0 and probe["busbw_avg_gbps"] > 0
        assert summary["broadcast | [tag: probe]"][40]["count"] == 1
        # Every record is in the counters and the other way round: same bytes per op.
        logged: dict[str, int] = {}
        for name, sizes in summary.items():
            op = name.split(" | ")[0]
            if op != "barrier":
                logged[op] = logged.get(op, 0) + sum(s * r["count"] for s, r in sizes.items())
        assert logged == {op: n for op, n in result["counted"].items() if n}
        assert any("[tag: grad]" in name for name in summary)  # the engine's reductions
        assert result["table"].splitlines()[1] in summary
        assert list(result["only"]) == ["broadcast"]
