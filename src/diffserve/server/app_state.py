"""What every route group reaches the server through: one typed `AppState`, on the app.

`create_app` (app.py) builds the state once and puts it on the app with `set_app_state`; the routes take
it as a parameter annotated `ServerState` (a FastAPI dependency reading `request.app.state`), and the
lifespan and the runner read it with `app_state_of(app)`. So no route depends on variables of the
function that built the app, and a test can serve one route module over stand-ins by setting the state
on its own app.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.applications import Starlette

from diffserve.server.args import ServerArgs
from diffserve.server.errors import ApiError, as_api_error
from diffserve.server.health_probe import HealthProbe
from diffserve.server.metrics import ServerMetrics
from diffserve.server.replicas import Engines
from diffserve.server.video_jobs import VideoJobManager

#: The attribute of `app.state` the AppState is kept in; read only through `app_state_of`.
_STATE_ATTRIBUTE = "diffserve"


@dataclass(frozen=True)
class AppState:
    """The server's parts the routes use: its arguments, the engine side (one engine client, or the
    --dp-size replicas), the Prometheus metrics, the video job manager, the /health_generate probe, and
    when the server started (the `created` of its model card)."""

    args: ServerArgs
    engine: Engines
    metrics: ServerMetrics
    video_jobs: VideoJobManager
    health_probe: HealthProbe
    started_at: int

    def check_model(self, name: str | None) -> None:
        """404 for a request's `model` that is not served here (None: the request names none)."""
        if name is not None and name not in self.args.model_aliases:
            message = f"model {name!r} is not served here; this server serves {self.args.model_id!r}"
            raise ApiError(404, message, param="model", code="model_not_found")

    def count_failure(self, exc: Exception) -> None:
        """Count a generation request that raised `exc` in `diffserve_generation_requests_total`."""
        self.metrics.count(outcome_of(exc))


def outcome_of(exc: Exception) -> str:
    """The `diffserve_generation_requests_total` outcome of a request that raised `exc`."""
    status = as_api_error(exc).status
    return {429: "queue_full", 503: "unavailable"}.get(status, "invalid" if status < 500 else "failed")


def set_app_state(app: Starlette, state: AppState) -> None:
    """Attach `state` to `app`, for its routes, its lifespan and the runner."""
    setattr(app.state, _STATE_ATTRIBUTE, state)


def app_state_of(app: Starlette) -> AppState:
    """The AppState `set_app_state` attached to `app`."""
    state = getattr(app.state, _STATE_ATTRIBUTE, None)
    if not isinstance(state, AppState):
        raise RuntimeError("this app has no diffserve AppState: build it with create_app or set_app_state")
    return state


async def request_app_state(request: Request) -> AppState:
    """The FastAPI dependency behind `ServerState`: the state of the app serving `request`. Async,
    though it awaits nothing, so FastAPI calls it on the event loop instead of in its thread pool."""
    return app_state_of(request.app)


#: A route parameter annotated `ServerState` receives the serving app's AppState.
ServerState = Annotated[AppState, Depends(request_app_state)]
