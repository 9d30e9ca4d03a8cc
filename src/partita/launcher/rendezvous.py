"""Static rendezvous whose store listens on the socket the launcher bound, not on every interface.

torchrun's static rendezvous (``StaticTCPRendezvous``) starts its ``TCPStore`` server with only
a port, and the server then listens on all interfaces (``::``), even for a single-node job
whose workers connect to 127.0.0.1. Anyone who can reach the port can then write to the store
the process group bootstraps from, and object collectives carry pickles. partita binds the
listening socket itself, on the address the launch names (`partita.launcher.launch`), and
hands its file descriptor to ``TCPStore(master_listen_fd=...)``; everything else is torch's
static rendezvous unchanged. Registered as the rendezvous backend ``partita-static``.

Imports torch: load it only when launching.
"""

from __future__ import annotations

from typing import Any, cast

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

__all__ = ["BACKEND", "BoundStaticRendezvous", "register"]

BACKEND = "partita-static"

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


def register() -> None:
    """Makes ``partita-static`` a rendezvous backend of this process (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)
