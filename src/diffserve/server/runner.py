"""Runs the app on uvicorn: shutdown on signals, and fatal engine errors.

The first SIGTERM or Ctrl-C drains: the server keeps listening but answers new generation requests (and
/health) with 503 `shutting_down`, while the requests in flight and the /v1/videos jobs get
`--shutdown-timeout` seconds (their clients can still poll and download); then the rest are cancelled,
uvicorn stops, the engine stops, and the process exits (0 for SIGTERM, 130 for Ctrl-C). A second signal
stops at once: the engine process (every replica's, with --dp-size) is killed, the requests in flight are
answered 503, the IPC socket folders are removed, and the server exits within ABORT_GRACE_S even if a
client does not read its answer.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from diffserve.errors import UserError
from diffserve.server.app import create_app
from diffserve.server.app_state import app_state_of
from diffserve.server.args import ServerArgs
from diffserve.server.connections import (
    ConnectionGuard,
    ResourceErrorLogFilter,
    fit_connection_limit,
    guarded_protocol,
    install_log_filter,
)
from diffserve.server.output_lock import OutputDirLock
from diffserve.server.replicas import Engines

logger = logging.getLogger("diffserve.server")

#: After a second signal: how long the 503 answers get to reach their clients before uvicorn stops
#: waiting for connections.
ABORT_GRACE_S = 2.0
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the engine client's two shutdown speeds: the first signal drains (uvicorn
    stops once the drain is over, not before: video jobs hold no connection it would wait for), the
    second aborts; uvicorn's own force-quit only from the third."""

    def __init__(self, config: uvicorn.Config, engine: Engines, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self.stop_signal: int | None = None  # the first shutdown signal received

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between bytecodes: the work is handed to the loop, never done here.
        self._signals += 1
        name = signal.Signals(sig).name
        if self._loop is None:  # not serving yet: uvicorn's own handling
            super().handle_exit(sig, frame)
        elif self._signals == 1:
            self.stop_signal = sig
            self._loop.call_soon_threadsafe(self._drain, name)
        elif self._signals == 2:
            self._loop.call_soon_threadsafe(self._abort, name)
        else:
            super().handle_exit(sig, frame)
            self.force_exit = True

    def _drain(self, name: str) -> None:
        timeout = self.shutdown_timeout
        logger.info("Received %s: shutting down (in-flight requests get %g s)", name, timeout)
        self.engine.begin_drain(timeout)
        asyncio.get_running_loop().create_task(self._exit_when_drained())

    async def _exit_when_drained(self) -> None:
        await self.engine.wait_drained()
        self.should_exit = True  # uvicorn stops listening and closes the connections, then the app stops

    def _abort(self, name: str) -> None:
        logger.warning("Received %s again: stopping at once", name)
        reason = f"the server was stopped at once ({name} received twice) before this request finished"
        self.engine.abort(reason)
        self.should_exit = True
        asyncio.get_running_loop().call_later(ABORT_GRACE_S, self._force_exit)

    def _force_exit(self) -> None:
        """uvicorn stops waiting for connections (a client that does not read its 503 holds none up)."""
        self.force_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine starts: a busy port is a one-line error, not a crash."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def serve(args: ServerArgs) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or until the engine cannot start (2: user error, 1: other)."""
    # Before anything touches the folder: a second server on it stops here, naming the first one.
    output_lock = OutputDirLock.acquire(args.output_dir)
    try:
        sock = bind_socket(args.host, args.port)
    except BaseException:
        output_lock.release()
        raise
    args.port = sock.getsockname()[1]  # --port 0: the port the system chose
    exit_code, server = 0, None

    def on_fatal(code: int, message: str) -> None:
        nonlocal exit_code
        exit_code = code
        logger.error("Stopping the server: the engine cannot run (exit code %d)", code)
        if server is not None:
            server.should_exit = True

    app = create_app(args, on_fatal=on_fatal)
    # No uvicorn log config nor access log: its lines use diffserve's format, and RequestContextMiddleware
    # logs one line per request. uvicorn stops after the drain: its graceful-shutdown timeout only bounds
    # the time answers already made take to reach their clients.
    backstop = 5.0
    # Connection limits (connections.py): uvicorn's h11 protocol under a guard; uvicorn's own 503 past
    # limit_concurrency stays as a backstop for requests still running after their client left.
    install_log_filter(ResourceErrorLogFilter())
    max_connections = fit_connection_limit(args.max_connections)
    guard = ConnectionGuard(max_connections, args.max_connections_per_client, args.header_timeout)
    config = uvicorn.Config(
        app, args.host, args.port, log_config=None, access_log=False, timeout_graceful_shutdown=backstop,
        http=guarded_protocol(guard), timeout_keep_alive=args.keep_alive_timeout,  # type: ignore[arg-type]
        # WebSockets: /v1/realtime/videos only; its first message is a POST /v1/videos body.
        ws="websockets-sansio", ws_max_size=max(args.max_video_body_bytes, 1 << 16),
        limit_concurrency=2 * max_connections,  # a backstop: the guard holds connections to the cap
    )  # fmt: skip
    engine: Engines = app_state_of(app).engine
    server = GracefulServer(config, engine, args.shutdown_timeout)
    # After a third signal uvicorn re-raises the signals it stopped on once it is done; for SIGTERM that
    # lands here, so the process exits with its code instead of being killed by the default handler.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        logger.info("Serving %s on http://%s:%d; the engine is starting", args.model_id, args.host, args.port)
        server.run(sockets=[sock])
    finally:
        # Whatever stopped the server (uvicorn's force-quit skips the app's shutdown): no engine process
        # left for multiprocessing's exit-time join to wait on, no socket folder left in /tmp.
        engine.kill_engine()
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        output_lock.release()
    return EXIT_INTERRUPTED if server.stop_signal == signal.SIGINT else exit_code
