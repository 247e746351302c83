"""A loopback port for a test's server to bind a moment later.

A port the OS hands out for a bind to port 0 (or to a connection) comes from its ephemeral range (32768 and
up on Linux), where every other test worker's listeners, stores and connections take theirs: one freed a
moment ago may be handed to them before the server that was told to use it binds it (a failed start, or
two groups meeting on one store). A port below that range is taken only by code that asks for it by
number, as these tests do, each drawing at random among the ports free now.
"""

from __future__ import annotations

import random
import socket

#: Below Linux's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999).
PORT_RANGE = (20000, 32000)


def unassigned_port() -> int:
    """A loopback TCP port in `PORT_RANGE` that nothing listens on now."""
    while True:
        port = random.randrange(*PORT_RANGE)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
