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


def wait_for_signal() -> int:
    """Block until SIGTERM (0) or SIGINT (130)."""
    received: list[int] = []
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return EXIT_INTERRUPTED if received[0] == signal.SIGINT else 0


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
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise UserError(f"the Ray Serve application could not start: {exc}") from exc
        models = ", ".join(str(model.get("name") or model["model_path"]) for model in app_args["models"])
        logger.info("Serving %s on http://%s:%d (Ray Serve); SIGTERM or Ctrl-C stops it", models, host, port)
        code = wait_for_signal()
        logger.info("Stopping: Ray Serve drains the replicas")
        return code
    finally:
        if address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
