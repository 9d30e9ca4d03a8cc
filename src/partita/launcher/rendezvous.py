"""Rendezvous whose stores listen on the sockets the launcher bound, not on every interface.

torchrun's static rendezvous (``StaticTCPRendezvous``) starts its ``TCPStore`` server with only
a port, and the server then listens on all interfaces (``::``), even for a single-node job
whose workers connect to 127.0.0.1. Anyone who can reach the port can then write to the store
the process group bootstraps from, and object collectives carry pickles. partita binds the
listening socket itself, on the address the launch names (`partita.launcher.launch`), and
hands its file descriptor to ``TCPStore(master_listen_fd=...)``; everything else is torch's
static rendezvous unchanged. Registered as the rendezvous backend ``partita-static``.

Elastic jobs (``--nnodes MIN:MAX``) use torch's dynamic c10d rendezvous, registered as
``partita-c10d``, the same way: the agent that hosts the rendezvous state (``is_host``, the one
started with ``--node_rank 0``) serves it from the bound socket, and the store torch starts for
the workers of group rank 0 listens on that node's own address (``local_addr``), not on ``::``.
Which node hosts the state is fixed for the job; the group ranks are the rendezvous' choice.

Imports torch: load it only when launching.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, cast

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

__all__ = [
    "BACKEND",
    "ELASTIC_BACKEND",
    "BoundDynamicRendezvous",
    "BoundStaticRendezvous",
    "register",
]

BACKEND = "partita-static"
ELASTIC_BACKEND = "partita-c10d"

# torch's static rendezvous default (static_tcp_rendezvous._default_timeout_seconds).
_DEFAULT_TIMEOUT_S = 600


class BoundStaticRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous; on node 0 the store serves the given listening socket."""

    def __init__(self, *args: Any, listen_fd: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.listen_fd = listen_fd

    def get_backend(self) -> str:
        """The registered name (torch checks a handler reports the backend it was made for)."""
        return BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        """Creates the store on the bound socket (node 0, first call), then defers to torch."""
        if self._store is None and self.listen_fd is not None:
            # TCPStore takes the descriptor over (it closes it with the store).
            self._store = TCPStore(
                self.master_addr,
                self.master_port,
                self.world_size,
                True,
                self.timeout,
                multi_tenant=True,
                master_listen_fd=self.listen_fd,
            )
            self.listen_fd = None
        return super().next_rendezvous()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    master_addr, master_port = parse_rendezvous_endpoint(params.endpoint, -1)
    rank = cast(int, params.config["rank"])
    listen_fd = params.config.get("listen_fd")
    timeout = int(params.config.get("timeout", _DEFAULT_TIMEOUT_S))
    return BoundStaticRendezvous(
        master_addr,
        master_port,
        rank,
        params.max_nodes,
        params.run_id,
        timeout,
        listen_fd=None if listen_fd is None else int(listen_fd),
    )


class BoundDynamicRendezvous(DynamicRendezvousHandler):
    """torch's dynamic rendezvous; the store its group rank 0 starts for the workers listens on
    this node's address (``local_addr``) instead of every interface."""

    def get_backend(self) -> str:
        """The registered name (torch checks a handler reports the backend it was made for)."""
        return ELASTIC_BACKEND

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        # Imported here: launch imports this module lazily, never the other way at load time.
        from partita.launcher.launch import listen_socket

        addr = str(socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0])
        sock = listen_socket(addr, master_port)
        return TCPStore(
            master_addr,
            int(sock.getsockname()[1]),
            is_master=True,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
        )


def _timeout(params: RendezvousParameters, key: str) -> datetime.timedelta | None:
    seconds = params.get_as_int(f"{key}_timeout")
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def _create_elastic(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, -1)
    listen_fd = params.config.get("listen_fd")
    read_timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    if listen_fd is not None:  # this agent hosts the rendezvous state
        store = TCPStore(
            host,
            port,
            is_master=True,
            multi_tenant=True,
            timeout=read_timeout,
            master_listen_fd=int(listen_fd),
        )
    else:
        store = TCPStore(host, port, is_master=False, multi_tenant=True, timeout=read_timeout)
    timeout = RendezvousTimeout(
        *(_timeout(params, key) for key in ("join", "last_call", "close", "heartbeat"))
    )
    return BoundDynamicRendezvous.from_backend(
        params.run_id,
        store,
        C10dRendezvousBackend(store, params.run_id),
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3,
    )


def register() -> None:
    """Makes ``partita-static`` and ``partita-c10d`` rendezvous backends of this process
    (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)
    rendezvous_handler_registry.register(ELASTIC_BACKEND, _create_elastic)
