"""A node's agent ends when the fan-out that started it is gone.

``partita --hostfile`` starts each node's agent through ssh and, to stop a node (another one
failed), closes that ssh's standard input. Killing the ssh client alone is not enough: without
a terminal, sshd does not signal the remote command when the connection drops, so the agent
would go on, waiting in a rendezvous for a node that will never come (torch's static timeout
is ten minutes) or training without the rest of the job. The node script hands the agent
ssh's standard input as a file descriptor (``--lifeline_fd``, see
`partita.launcher.multinode.node_script`); the agent reads it on a daemon thread and, at its
end of file (the fan-out closed it, exited or was killed, or the connection dropped), stops as
it does on SIGTERM: its workers are terminated and it exits 128 + 15.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["watch"]


def watch(fd: int) -> threading.Thread:
    """Starts a daemon thread that sends this process SIGTERM at end of file on ``fd``."""
    os.set_inheritable(fd, False)  # the workers must not hold the fan-out's line open

    def run() -> None:
        try:
            while os.read(fd, 4096):
                pass  # nothing is sent on the line; only its end matters
        except OSError:
            pass  # a broken line is an ended one
        print(
            "partita: the fan-out that started this node closed its connection; stopping",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run, name="partita-lifeline", daemon=True)
    thread.start()
    return thread
