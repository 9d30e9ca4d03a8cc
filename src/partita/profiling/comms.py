"""The comms logger: every collective partita issues, by op and message size, with latency and
bandwidth, printed as DeepSpeed's ``deepspeed.comm.log_summary()`` table.

It observes `partita.comm.COUNTERS` (which every collective records its payload into) so the
sizes are exactly the bytes partita's accounting counts: all-reduce and broadcast the tensor,
reduce-scatter its full input, all-gather its full output. On gloo partita may run a
reduce-scatter or all-gather as an all-reduce; it is then listed as the all-reduce it was.

[Note: comms latency]
Latency runs from issue to completion: for a blocking collective the call's duration, for an
asynchronous one until the caller's ``wait()`` returns, so time the collective overlapped with
computation counts (DeepSpeed synchronises the device after each logged op instead, which for
an asynchronous op on gloo times only its launch). Completions arrive in issue order; each is
matched with the oldest collective not yet finished.

Bandwidths follow DeepSpeed's ``calc_bw_log`` (Gbps = 8 bits x bytes / seconds / 1e9): for
all-gather and reduce-scatter of a full payload S, tput = S / t and busbw = tput (n - 1) / n;
for all-reduce, tput = 2 S / t and busbw = S / t x 2 (n - 1) / n; for broadcast, busbw = tput.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from partita import comm
from partita.config.sections.profiling import CommsLoggerConfig
from partita.profiling.units import bytes_to_string

__all__ = ["COMMS_LOGGER", "CommsLogger", "OpStats", "bandwidths", "configure", "log_summary"]

logger = logging.getLogger("partita")

# Collectives with no tensor payload: they finish without a record and are listed at size 0.
_UNRECORDED = frozenset({"barrier", "all_gather_object", "broadcast_object"})
_HEADER = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
           "tput_avg (Gbps)", "busbw_avg (Gbps)")  # fmt: skip


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(tput, busbw) in Gbps of one collective (see the module docstring)."""
    if seconds <= 0:
        return 0.0, 0.0
    rate = nbytes / seconds
    share = (world - 1) / world if world > 1 else 0.0
    if op == "all_reduce":
        tput, busbw = 2 * rate, rate * 2 * share
    elif op in ("all_gather", "reduce_scatter"):
        tput, busbw = rate, rate * share
    else:
        tput = busbw = rate
    return tput * 8 / 1e9, busbw * 8 / 1e9


@dataclass
class OpStats:
    """The collectives of one name and message size."""

    count: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    tput_gbps: list[float] = field(default_factory=list)
    busbw_gbps: list[float] = field(default_factory=list)


@dataclass
class _Pending:
    op: str
    name: str
    nbytes: int


class CommsLogger:
    """Records collectives for `log_summary` while enabled (see the module docstring)."""

    def __init__(self) -> None:
        self.config = CommsLoggerConfig()
        self.enabled = False
        self.stats: dict[str, dict[int, OpStats]] = {}
        self._pending: deque[_Pending] = deque()

    def configure(self, config: CommsLoggerConfig) -> None:
        """Applies a ``comms_logger`` section; enabled starts recording, disabled stops."""
        self.config = config
        if config.enabled:
            self.start()
        else:
            self.stop()

    def start(self) -> None:
        """Observes `partita.comm.COUNTERS` from now on."""
        self.enabled = True
        comm.COUNTERS.observer = self

    def stop(self) -> None:
        """Stops observing (the recorded data stays until `reset`)."""
        self.enabled = False
        if comm.COUNTERS.observer is self:
            comm.COUNTERS.observer = None
        self._pending.clear()

    def reset(self) -> None:
        """Drops every record."""
        self.stats = {}
        self._pending.clear()

    def _wanted(self, op: str) -> bool:
        return self.config.prof_all or op in self.config.prof_ops

    def recorded(self, op: str, tag: str, nbytes: int) -> None:
        """A collective's payload (called by the counters)."""
        name = f"{op} | [tag: {tag or '-'}]" if self.config.debug else op
        if not comm.is_initialized():  # one process: nothing is sent, nothing to time
            self._add(op, name, nbytes, 0.0)
            return
        self._pending.append(_Pending(op, name, nbytes))

    def finished(self, op: str, seconds: float) -> None:
        """The oldest unfinished collective completed (called by the counters; see [Note: comms
        latency])."""
        if op in _UNRECORDED:
            self._add(op, op, 0, seconds)
        elif self._pending:
            done = self._pending.popleft()
            self._add(done.op, done.name, done.nbytes, seconds)

    def _add(self, op: str, name: str, nbytes: int, seconds: float) -> None:
        if not self._wanted(op):
            return
        world = comm.get_world_size() if comm.is_initialized() else 1
        tput, busbw = bandwidths(op, nbytes, seconds, world)
        stats = self.stats.setdefault(name, {}).setdefault(nbytes, OpStats())
        stats.count += 1
        stats.latencies_ms.append(seconds * 1e3)
        stats.tput_gbps.append(tput)
        stats.busbw_gbps.append(busbw)
        if self.config.verbose:
            logger.info(
                "comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | "
                "busbw (Gbps): %.2f", name, seconds * 1e3, bytes_to_string(nbytes), tput, busbw
            )  # fmt: skip

    def summary(self) -> dict[str, dict[int, dict[str, Any]]]:
        """``{op: {message bytes: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps,
        busbw_avg_gbps, msg_size_bytes, msg_size_str}}}``; averages trim 10% at each end as
        DeepSpeed's do."""
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for name, sizes in self.stats.items():
            out[name] = {
                size: {
                    "count": s.count,
                    "total_latency_ms": sum(s.latencies_ms),
                    "avg_latency_ms": _trim_mean(s.latencies_ms),
                    "tput_avg_gbps": _trim_mean(s.tput_gbps),
                    "busbw_avg_gbps": _trim_mean(s.busbw_gbps),
                    "msg_size_bytes": size,
                    "msg_size_str": bytes_to_string(size),
                }
                for size, s in sorted(sizes.items())
            }
        return out

    def table(self) -> str:
        """The summary as DeepSpeed's fixed-width table."""
        lines = ["".join(f"{h: <20}" for h in _HEADER)]
        for name, sizes in self.summary().items():
            lines.append(name)
            for row in sizes.values():
                lines.append(
                    f"{' ': <20}{row['msg_size_str']: <20}{row['count']: <20}"
                    f"{row['total_latency_ms']: <20.2f}{row['avg_latency_ms']: <20.2f}"
                    f"{row['tput_avg_gbps']: <20.2f}{row['busbw_avg_gbps']: <20.2f}"
                )
        return "\n".join(lines)


def _trim_mean(values: list[float], share: float = 0.1) -> float:
    """The mean without the lowest and highest `share` of `values` (0 for none)."""
    if not values:
        return 0.0
    cut = int(len(values) * share)
    kept = sorted(values)[cut : len(values) - cut] or values
    return statistics.fmean(kept)


COMMS_LOGGER = CommsLogger()
"""The process-wide comms logger (``deepspeed.comm.comms_logger``)."""


def configure(config: CommsLoggerConfig) -> None:
    """Applies a ``comms_logger`` section to the process-wide logger."""
    COMMS_LOGGER.configure(config)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """DeepSpeed's ``deepspeed.comm.log_summary``: after a barrier, rank 0 prints the table.

    Returns ``{"summary": ..., "straggler_analysis": None, "metadata": {world_size, rank}}`` on
    every rank when `return_dict` (each rank's own records).
    """
    if show_straggler:
        raise NotImplementedError(
            "log_summary(show_straggler=True): partita's comms logger has no straggler analysis"
        )
    rank = comm.get_rank() if comm.is_initialized() else 0
    world = comm.get_world_size() if comm.is_initialized() else 1
    # The barrier is not recorded: the summary should show the training's collectives only.
    observer, comm.COUNTERS.observer = comm.COUNTERS.observer, None
    try:
        comm.barrier()
    finally:
        comm.COUNTERS.observer = observer
    if rank == 0:
        print(COMMS_LOGGER.table())
    if not return_dict:
        return None
    return {
        "summary": COMMS_LOGGER.summary(),
        "straggler_analysis": None,
        "metadata": {"world_size": world, "rank": rank},
    }
