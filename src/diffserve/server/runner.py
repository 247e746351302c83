"""Runs the app on uvicorn: graceful SIGTERM (drain, then stop the engine, exit 0) and fatal engine errors."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from diffserve.errors import UserError
from diffserve.server.app import create_app
from diffserve.server.args import ServerArgs

logger = logging.getLogger("diffserve.server")


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which also starts the engine client's drain when a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._draining or self._loop is None:
            return
        self._draining, timeout = True, self.shutdown_timeout
        logger.info(
            "Received %s: shutting down (in-flight requests get %g s)", signal.Signals(sig).name, timeout
        )
        # Signal handlers run between bytecodes; hand the work to the loop instead of touching it here.
        self._loop.call_soon_threadsafe(self.config.app.state.engine.begin_drain, timeout)


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
    sock = bind_socket(args.host, args.port)
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
    # logs one line per request. Its graceful-shutdown timeout is a backstop: the engine client cancels first.
    backstop = args.shutdown_timeout + 5
    config = uvicorn.Config(
        app, args.host, args.port, log_config=None, access_log=False, timeout_graceful_shutdown=backstop
    )
    server = GracefulServer(config, args.shutdown_timeout)
    # uvicorn re-raises the signal it stopped on once it is done; for SIGTERM that lands here, so the
    # process exits with 0 after a graceful shutdown instead of being killed by the default handler.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        logger.info("Serving %s on http://%s:%d; the engine is starting", args.model_id, args.host, args.port)
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    return exit_code
