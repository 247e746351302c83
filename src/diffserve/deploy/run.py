"""`diffserve serve --ray`: run the application (app.py) on Ray Serve until SIGTERM or Ctrl-C.

Without `--ray-address` a Ray instance is started for this server and stopped with it; with one
(`auto`, `ray://HOST:10001`) the application is deployed on that cluster and deleted from it at exit.
Ray Serve's proxy listens on `--host`/`--port`. A signal stops the application: Ray Serve lets each
replica finish its requests for its graceful-shutdown timeout, then stops it (and its engine).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from diffserve.errors import UserError

logger = logging.getLogger("diffserve")

APP_NAME = "diffserve"
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it


class StopSignals:
    """SIGTERM and SIGINT, recorded while the server runs (a context manager). Installed once Ray is
    connected (`ray.init` sets a SIGTERM handler of its own) and before the application starts: a
    signal that comes while Ray Serve deploys it stops the server once the deployment is done."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._stop = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        self._stop.set()

    def wait(self) -> int:
        """Until the first signal: the exit code, 0 for SIGTERM and 130 for SIGINT."""
        while not self._stop.wait(0.5):
            pass
        return EXIT_INTERRUPTED if self.received[0] == signal.SIGINT else 0


def serve_on_ray(app_args: dict[str, Any], address: str | None, host: str, port: int) -> int:
    """Deploy `app_args`' application and serve it at http://host:port until a signal; the exit code."""
    import ray
    from ray import serve

    from diffserve.deploy.app import build_app
    from diffserve.server.runner import bind_socket

    app = build_app(app_args)  # invalid args: AppArgsError before Ray starts
    if address is None:
        bind_socket(host, port).close()  # a busy port is a one-line error, not a failing proxy
    if address is None:  # "local": a new instance even where `ray start` runs one (`--ray-address auto`)
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    try:
        with StopSignals() as signals:
            serve.start(http_options={"host": host, "port": port})
            try:
                serve.run(app, name=APP_NAME, route_prefix="/")
            except RuntimeError as exc:
                raise UserError(f"the Ray Serve application could not start: {exc}") from exc
            models = ", ".join(str(model.get("name") or model["model_path"]) for model in app_args["models"])
            logger.info(
                "Serving %s on http://%s:%d (Ray Serve); SIGTERM or Ctrl-C stops it", models, host, port
            )
            code = signals.wait()
            logger.info("Stopping: Ray Serve drains the replicas")
            return code
    finally:
        if address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
