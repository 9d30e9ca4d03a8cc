"""Which node of a multi-node job is gone: agent heartbeats in the rendezvous store.

When a node dies (its agent killed, the machine lost), the survivors only see their own
workers fail: a collective with a peer that no longer exists ends in a connection error, and
torchrun's agent reports the local rank that raised it. That names the wrong node. So every
partita agent of a multi-node job keeps a counter in the job's rendezvous store
(`AgentBeat`: the store node 0's agent hosts, which every node reaches already) and, when a
worker fails, `gone_nodes` reads the counters twice a moment apart: a node whose counter stood
still is the one that died, named by its ``--node_rank``, address and agent pid. A store that
no longer answers means node 0's agent, its host, is gone.

Imports torch: load it only when launching.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time

from torch.distributed import TCPStore

__all__ = ["AgentBeat", "gone_nodes"]

_PREFIX = "partita_agents"
_INTERVAL_S = 0.25  # several beats inside the window below
_WINDOW_S = 1.5


def _connect(addr: str, port: int, timeout_s: float) -> TCPStore:
    return TCPStore(
        addr,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class AgentBeat:
    """A daemon thread that announces this agent in the store at ``addr:port`` and then bumps
    its counter every quarter second until `stop` (or until the store is gone)."""

    def __init__(self, addr: str, port: int, node_rank: int, node_addr: str | None) -> None:
        self.addr, self.port, self.node_rank = addr, port, node_rank
        self.info = {"addr": node_addr or socket.gethostname(), "pid": os.getpid()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="partita-agent-beat", daemon=True)

    def start(self) -> None:
        """Starts beating (connecting as soon as the store exists)."""
        self._thread.start()

    def stop(self) -> None:
        """Stops beating."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        store = None
        while store is None and not self._stop.is_set():
            try:  # node 0's agent creates the store when its rendezvous starts
                store = _connect(self.addr, self.port, timeout_s=2)
            except (RuntimeError, ValueError, OSError):
                self._stop.wait(_INTERVAL_S)
        if store is None:
            return
        # The store outlives nobody's interest: once it is gone the job is over or failing,
        # and the failure path reports that itself.
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            store.set(f"{_PREFIX}/info/{self.node_rank}", json.dumps(self.info))
            while not self._stop.is_set():
                store.add(f"{_PREFIX}/beat/{self.node_rank}", 1)
                self._stop.wait(_INTERVAL_S)


def _describe(store: TCPStore, rank: int) -> str:
    info = json.loads(store.get(f"{_PREFIX}/info/{rank}"))
    return f"node {rank} ({info['addr']}, agent pid {info['pid']})"


def gone_nodes(addr: str, port: int, num_nodes: int, self_rank: int) -> list[str]:
    """One line per node of the job, other than ``self_rank``, whose agent stopped beating
    (nodes that never announced themselves are not judged); a store that does not answer
    is reported as node 0's agent being gone. Node 0 (the store's host) lingers one more
    window afterwards, so survivors reading at the same moment still find the store."""
    try:
        return _stalled(addr, port, num_nodes, self_rank)
    finally:
        if self_rank == 0:
            time.sleep(_WINDOW_S)


def _stalled(addr: str, port: int, num_nodes: int, self_rank: int) -> list[str]:
    try:
        store = _connect(addr, port, timeout_s=2)
        others = [r for r in range(num_nodes) if r != self_rank]
        known = [r for r in others if store.check([f"{_PREFIX}/info/{r}"])]
        before = {r: store.add(f"{_PREFIX}/beat/{r}", 0) for r in known}
        time.sleep(_WINDOW_S)
        after = {r: store.add(f"{_PREFIX}/beat/{r}", 0) for r in known}
        return [
            f"{_describe(store, r)} is gone: its agent stopped beating in the rendezvous store"
            for r in known
            if after[r] == before[r]
        ]
    except (RuntimeError, ValueError, OSError):
        if self_rank == 0:
            return []
        return [
            f"node 0 is gone: the rendezvous store its agent hosts at {addr}:{port} does not answer"
        ]
