"""What the server serves and how it is doing: `/v1/models`, `/health`, `/health_generate`, `/server_info`.

`/health` and `/health_generate` are open without the API key (middleware.OPEN_PATHS), for load
balancers; `/health_generate` runs a real generation, rate-limited by health_probe.py. `/server_info`
shows the arguments, the engine (or each --dp-size replica), its LoRA state and the versions.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

import diffserve
from diffserve.server.app_state import AppState, ServerState
from diffserve.server.disconnects import ClientDisconnected
from diffserve.server.engine_client import EngineClient
from diffserve.server.errors import documented, error_response
from diffserve.server.lora_routes import live_lora_state
from diffserve.server.middleware import CLIENT_CLOSED_REQUEST
from diffserve.server.schemas import ModelCard, ModelList

_ERRORS = documented(400, 401, 404, 413, 429, 500, 503)
#: Engine info that differs between replicas: with several, shown per replica, not in `engine`. `node`:
#: where a Ray Serve replica runs (deploy/engines.py); None for the engine processes of this machine.
_PER_REPLICA_INFO = ("load_seconds", "warmup_seconds", "device_name", "node", "batching")

router = APIRouter()


def model_card(state: AppState) -> ModelCard:
    """The served model, as OpenAI's model object (`created`: when this server started)."""
    return ModelCard(id=state.args.model_id, created=state.started_at)


def replica_info(client: EngineClient) -> dict[str, Any]:
    """One replica in /server_info: its state, process, restarts and load, and where it runs."""
    info = client.engine_info
    return {
        "replica": client.replica,
        "state": client.state.value,
        "detail": client.state_detail,
        "pid": client.engine_pid,
        "restarts": client.restarts,
        "waiting": client.num_waiting,
        "running": client.num_running,
        "completed": client.completed,
        "device_indices": None if client.device_indices is None else list(client.device_indices),
        **{k: info.get(k) for k in ("platform", *_PER_REPLICA_INFO)},
    }


def _versions() -> dict[str, str]:
    """The front end's versions of diffserve, Python and the serving packages (the engine adds its own)."""
    out = {"diffserve": diffserve.__version__, "python": platform.python_version()}
    for name in ("fastapi", "uvicorn", "pyzmq", "pydantic", "prometheus-client"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def list_models(state: ServerState) -> ModelList:
    return ModelList(data=[model_card(state)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
async def get_model(model_id: str, state: ServerState) -> ModelCard:
    state.check_model(model_id)
    return model_card(state)


@router.head("/health", responses=_ERRORS)  # load balancers that probe with HEAD
@router.get("/health", responses=_ERRORS)
async def health(state: ServerState) -> Response:
    engine = state.engine
    if not engine.ready:
        err = engine.unavailable_error()
        return error_response(503, str(err), None, err.code)
    return JSONResponse({"status": "ok"})


@router.get("/health_generate", responses=_ERRORS)
async def health_generate(request: Request, state: ServerState) -> Response:
    """A real 1-step generation at a small size through the queue, rate-limited by HealthProbe
    (a reused result says `"cached": true`)."""
    try:
        result, reused = await state.health_probe.result(request)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    body = {**result.body, "cached": reused} if result.status == 200 else result.body
    return JSONResponse(body, status_code=result.status)


@router.get("/server_info", responses=_ERRORS)
async def server_info(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    replicas = [replica_info(client) for client in engine.replicas]
    hidden = {"versions", "replica", "loras", *(_PER_REPLICA_INFO if len(replicas) > 1 else ())}
    loras = await live_lora_state(engine)
    return {
        "model": state.args.model_id,
        "server_args": state.args.to_dict(),
        "engine": {  # one replica: its engine; several: the state clients see, the sums, the model
            "state": engine.state.value,
            "detail": engine.state_detail,
            "pid": replicas[0]["pid"] if len(replicas) == 1 else None,
            "restarts": sum(replica["restarts"] for replica in replicas),
            "waiting": engine.num_waiting,
            "running": engine.num_running,
            **{k: v for k, v in engine.engine_info.items() if k not in hidden},
            # Adapters (name, rank, bytes, in_use, ...), merged ones, resident bytes, --max-lora-memory.
            "loras": loras,
        },
        "replicas": replicas,
        "versions": {**_versions(), **engine.engine_info.get("versions", {})},
        "front_end_pid": os.getpid(),
        "python_executable": sys.executable,
    }
