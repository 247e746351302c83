"""Connection limits below HTTP: what a client may hold open before it has sent a request.

uvicorn closes idle keep-alive connections (`--keep-alive-timeout`) and answers 503 past
`limit_concurrency`, but only once a whole request has arrived: a client that opens thousands of
connections and sends one header byte every few seconds (slowloris) holds every one of them, and enough
of them take the process to its file-descriptor limit, where accepting fails, /health stops answering
and every failed accept logs a traceback. So the server's HTTP protocol is uvicorn's h11 protocol with a
guard (`ConnectionGuard`):

- a request's headers must arrive within `--header-timeout` seconds of the connection being made (or
  of the previous answer on a kept-alive connection); else the connection is closed (408 when part of a
  request had arrived);
- at most `--max-connections-per-client` connections per client address: more are answered 503 and
  closed at once, before anything is read;
- at most `--max-connections` in all: a newcomer past the cap closes the oldest connection that is
  waiting for a request (idle, or slow to send its headers), or, when every connection has a request
  in progress, is answered 503 and closed;
- the process's open-file limit is raised to fit the caps (`fit_connection_limit`), so the caps, not the
  kernel, are what a flood meets; and what a flood does is logged in one summary line per interval,
  never a line per connection. `ResourceErrorLogFilter` does the same for any "Too many open files"
  error that still happens (asyncio logs each failed accept with its traceback).

The body of a request has its own deadline (`--body-timeout`, middleware.BodySizeLimitMiddleware).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import time
from collections import Counter, OrderedDict
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("diffserve.server")

#: Seconds between two summary lines of refused and closed connections (and of resource errors).
LOG_INTERVAL_S = 10.0
#: File descriptors the front end needs besides one per connection: its own files, the engine sockets,
#: and a file a download reads (one per connection, counted in `fd_budget`).
FD_RESERVE = 256
#: OS errors that mean the process (or the system) is out of descriptors or buffers.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _answer(status: int, reason: str, message: str, code: str) -> bytes:
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    retry = "Retry-After: 1\r\n" if status == 503 else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{retry}Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def fd_budget(max_connections: int) -> int:
    """Open files the front end may need with `max_connections` connections: a socket and a file each."""
    return 2 * max_connections + FD_RESERVE


def fit_connection_limit(max_connections: int) -> int:
    """`max_connections`, once the open-file limit is raised to fit it (up to the hard limit); when the
    hard limit is too low, the largest cap that fits, logged."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = fd_budget(max_connections)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    fitted = max(1, (soft - FD_RESERVE) // 2)
    logger.warning(
        "--max-connections %d lowered to %d: this process may open only %d files (ulimit -n; hard limit %s)",
        max_connections, fitted, soft, "unlimited" if hard == resource.RLIM_INFINITY else hard,
    )  # fmt: skip
    return fitted


class ConnectionGuard:
    """The counts and limits `GuardedH11Protocol` connections share (one per server, on one event loop)."""

    def __init__(self, max_connections: int, max_per_client: int, header_timeout: float) -> None:
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.header_timeout = header_timeout
        self.open = 0
        self.per_client: Counter[str] = Counter()
        #: Connections waiting for a request's headers, oldest first: the ones a newcomer may displace.
        self.waiting: OrderedDict[GuardedH11Protocol, None] = OrderedDict()
        self.counts: Counter[str] = Counter()  # since the last summary line
        self._next_summary: asyncio.TimerHandle | None = None
        self._too_many_per_client = _answer(
            503, "Service Unavailable",
            f"too many connections from this client (at most {max_per_client}, --max-connections-per-client); "
            "close some or retry later", "too_many_connections",
        )  # fmt: skip
        self._too_many = _answer(
            503, "Service Unavailable",
            f"the server has too many open connections (at most {max_connections}, --max-connections); "
            "retry later", "too_many_connections",
        )  # fmt: skip
        self.timeout_answer = _answer(
            408, "Request Timeout",
            f"the request's headers did not arrive within {header_timeout:g} s (--header-timeout)",
            "request_timeout",
        )  # fmt: skip

    def admit(self, host: str) -> bytes | None:
        """Count a new connection from `host` in; or the 503 to answer it with (it is not counted)."""
        if self.max_per_client and self.per_client[host] >= self.max_per_client:
            self.note("refused_per_client")
            return self._too_many_per_client
        if self.open >= self.max_connections:
            if not self.waiting:
                self.note("refused_total")
                return self._too_many
            oldest = next(iter(self.waiting))
            oldest.close_idle()  # its count goes when its transport reports the loss; room is made now
            self.note("displaced")
        self.open += 1
        self.per_client[host] += 1
        return None

    def release(self, host: str) -> None:
        self.open -= 1
        self.per_client[host] -= 1
        if self.per_client[host] <= 0:
            del self.per_client[host]

    def note(self, event: str) -> None:
        """Count `event`; the first of a burst is logged at once, the rest in one line per LOG_INTERVAL_S."""
        self.counts[event] += 1
        if self._next_summary is None:
            self._summarise()

    def _summarise(self) -> None:
        self._next_summary = None
        if not self.counts:
            return
        parts = []
        if n := self.counts["refused_per_client"]:
            parts.append(f"refused {n} over --max-connections-per-client {self.max_per_client}")
        if n := self.counts["refused_total"]:
            parts.append(f"refused {n} over --max-connections {self.max_connections}")
        if n := self.counts["displaced"]:
            parts.append(
                f"closed {n} idle to make room for new ones (--max-connections {self.max_connections})"
            )
        if n := self.counts["header_timeout"]:
            parts.append(
                f"closed {n} that sent no complete request within --header-timeout {self.header_timeout:g} s"
            )
        level = (
            logging.WARNING
            if self.counts["refused_per_client"] or self.counts["refused_total"]
            else logging.INFO
        )
        logger.log(level, "Connections: %s (%d open now)", "; ".join(parts), self.open)
        self.counts.clear()
        self._next_summary = asyncio.get_running_loop().call_later(LOG_INTERVAL_S, self._summarise)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionGuard` (see the module docstring). `guarded_protocol`
    makes the class of one server, with its guard."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host = ""
        self._admitted = False
        self._deadline: asyncio.TimerHandle | None = None
        #: The request cycle current when the deadline was set: a new one means the headers arrived.
        self._awaited_cycle: object = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self._host = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "-"
        refusal = self.guard.admit(self._host)
        if refusal is not None:
            transport.write(refusal)
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:  # refused: uvicorn never saw it
            return
        self._admitted = False
        self._stop_waiting()
        self.guard.release(self._host)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        super().data_received(data)
        self._check_headers()

    def handle_websocket_upgrade(self, event: Any) -> None:
        """A WebSocket (`/v1/realtime/videos`): its headers came, and the socket is the WebSocket
        protocol's from now on; it holds this connection's room in the guard until it is lost."""
        self._stop_waiting()
        super().handle_websocket_upgrade(event)
        websocket = self.transport.get_protocol()
        lost = websocket.connection_lost

        def release(exc: Exception | None) -> None:
            if self._admitted:
                self._admitted = False
                self.guard.release(self._host)
            lost(exc)

        websocket.connection_lost = release  # type: ignore[method-assign]

    def on_response_complete(self) -> None:
        self._await_headers()  # before uvicorn starts on a pipelined request, which then clears it
        super().on_response_complete()
        self._check_headers()

    def close_idle(self) -> None:
        """Close this connection, which is waiting for a request (the guard needs its room)."""
        self._stop_waiting()
        if not self.transport.is_closing():
            self.transport.close()

    def _await_headers(self) -> None:
        self._stop_waiting()
        if self.transport.is_closing():
            return
        self._awaited_cycle = self.cycle
        self._deadline = self.loop.call_later(self.guard.header_timeout, self._headers_timed_out)
        self.guard.waiting[self] = None

    def _check_headers(self) -> None:
        if self._deadline is not None and self.cycle is not self._awaited_cycle:
            self._stop_waiting()

    def _stop_waiting(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.guard.waiting.pop(self, None)

    def _headers_timed_out(self) -> None:
        self._deadline = None
        self.guard.waiting.pop(self, None)
        if self.cycle is not self._awaited_cycle or self.transport.is_closing():
            return
        self.guard.note("header_timeout")
        if self.conn.trailing_data[0]:  # part of a request came: say why it is dropped
            self.transport.write(self.guard.timeout_answer)
        self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The HTTP protocol class (uvicorn.Config's `http`) of a server whose connections `guard` limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class ResourceErrorLogFilter(logging.Filter):
    """On a log handler: a record of an out-of-descriptors error ("Too many open files", ENFILE, ENOBUFS,
    ENOMEM; asyncio logs one per failed accept, with its traceback) passes as one line without the
    traceback, at most once per `interval` seconds, saying how many were suppressed meanwhile."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        super().__init__()
        self.interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    @staticmethod
    def _resource_error(record: logging.LogRecord) -> BaseException | None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            return exc
        return None

    def filter(self, record: logging.LogRecord) -> bool:
        exc = self._resource_error(record)
        if exc is None:
            return True
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return False
        self._last = now
        suppressed = (
            f"; {self._suppressed} more like it in the last {self.interval:g} s" if self._suppressed else ""
        )
        self._suppressed = 0
        record.msg = f"{record.getMessage()}: {exc}{suppressed}"
        record.args, record.exc_info, record.exc_text, record.stack_info = (), None, None, None
        return True


def install_log_filter(filter_: logging.Filter) -> None:
    """Put `filter_` on every handler of the root logger (where uvicorn's, asyncio's and ours end up)."""
    for handler in logging.getLogger().handlers:
        if filter_ not in handler.filters:
            handler.addFilter(filter_)
