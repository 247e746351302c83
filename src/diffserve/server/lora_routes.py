"""`/v1/loras`: the LoRA adapters the server serves, which requests name in their `loras` field.

GET    /v1/loras           list them: name, file, family, format, rank, bytes, in_use, ...
POST   /v1/loras           load one: {"name", "path", "strict"}, `path` relative to --lora-dir (nothing
                           outside it is read: no --lora-dir, an absolute path or `..` are refused)
DELETE /v1/loras/{name}    unload one (409 while a request, queued or running, names it)

The engine reads a load's file while it keeps denoising (engine_loras.py) and registers it, or unloads
one, between two denoising steps, so running requests are never touched nor stalled;
with `--dp-size` every replica does (replicas.py). Like every route but the probes, these need the API
key when the server has one; loading and unloading need the admin key when it has one (`--admin-api-key`,
access.py), and others see no server path in the list.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from diffserve.server.access import AdminOnly
from diffserve.server.app_state import ServerState
from diffserve.server.errors import documented
from diffserve.server.image_edits import inline_schema
from diffserve.server.replicas import Engines
from diffserve.server.request_body import read_body
from diffserve.server.schemas import utf8_text

logger = logging.getLogger("diffserve.server")

#: How long /server_info waits for the engine's live LoRA state before showing the last one it reported.
LORA_INFO_TIMEOUT_S = 2.0


class LoraLoadRequest(BaseModel):
    """`POST /v1/loras`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        max_length=128,
        description="the name requests will use: 1-128 letters, digits, '.', '_' or '-'",
    )
    path: str = Field(
        min_length=1,
        description="the adapter file, relative to the server's --lora-dir (e.g. 'styles/ink.safetensors')",
    )
    strict: bool = Field(
        True,
        description="false: apply the layers that fit the model and ignore the others (logged); true: refuse "
        "such a file",
    )

    _utf8 = field_validator("*")(utf8_text)


LORA_LOAD_FIELDS: tuple[str, ...] = tuple(LoraLoadRequest.model_fields)


class LoraCard(BaseModel):
    """One adapter, as the engine reports it (`LoraInfo.to_dict()`)."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(description="the adapter's name")
    object: Literal["lora"] = "lora"
    name: str
    path: str = Field(description="the file it is read from")
    family: str
    format: str = Field(description="the file's layout (diffusers/PEFT, kohya, ...); '' until it is read")
    rank: int = Field(description="0 until it is read (an adapter of --lora-dir is read on first use)")
    bytes: int = Field(description="device bytes it takes while resident")
    targets: int = Field(description="layers (or parts of fused layers) it changes")
    resident: bool = Field(description="on the device now (false: evicted or not read yet)")
    in_use: int = Field(description="requests naming it, queued or running (DELETE answers 409 meanwhile)")
    queued: int = Field(0, description="of those, the ones still queued")


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LoraCard]
    merged: list[str] = Field(description="adapters merged into the weights at start (--lora-merge)")
    resident_bytes: int
    max_lora_memory: int


class LoraDeleted(BaseModel):
    id: str
    object: Literal["lora.deleted"] = "lora.deleted"
    deleted: bool


def _request_body() -> dict[str, Any]:
    """The load route reads its body itself (its own error words): its `openapi_extra`."""
    schema = inline_schema(LoraLoadRequest.model_json_schema())
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def lora_card(adapter: dict[str, Any]) -> dict[str, Any]:
    return {"id": adapter["name"], "object": "lora", **adapter}


router = APIRouter()


@router.get("/v1/loras", response_model=LoraList, responses=documented(401, 500, 503))
async def list_loras(state: ServerState) -> JSONResponse:
    loras = (await state.engine.list_loras()).loras
    return JSONResponse(
        {
            "object": "list",
            "data": [lora_card(adapter) for adapter in loras["adapters"]],
            "merged": loras["merged"],
            "resident_bytes": loras["resident_bytes"],
            "max_lora_memory": loras["max_lora_memory"],
        }
    )


@router.post(
    "/v1/loras",
    response_model=LoraCard,
    responses=documented(400, 401, 403, 409, 413, 415, 500, 503),
    openapi_extra=_request_body(),
    dependencies=[AdminOnly],  # the admin key, when the server has one (access.py)
)
async def load_lora(request: Request, state: ServerState) -> JSONResponse:
    """Load the adapter file at `path` (inside --lora-dir) as `name`: diffusers/PEFT, kohya or a FLUX
    community layout, checked against the served model (another family's file is refused)."""
    body, _ = await read_body(
        request, LoraLoadRequest, LORA_LOAD_FIELDS, files=(), text_only=None,
        empty="request body is required: a JSON object with 'name' and 'path'", send="application/json",
    )  # fmt: skip
    done = await state.engine.load_lora(body.name, body.path, body.strict)
    if done.adapter is None:
        raise RuntimeError("the engine answered a LoRA load without the adapter")
    return JSONResponse(lora_card(done.adapter))


@router.delete(
    "/v1/loras/{name}", response_model=LoraDeleted, responses=documented(401, 403, 404, 409, 500, 503),
    dependencies=[AdminOnly],  # the admin key, when the server has one (access.py)
)  # fmt: skip
async def unload_lora(name: str, state: ServerState) -> JSONResponse:
    """Unload the adapter (and forget it: a file of --lora-dir is read again when a request names it)."""
    await state.engine.unload_lora(name)
    return JSONResponse({"id": name, "object": "lora.deleted", "deleted": True})


async def live_lora_state(engine: Engines) -> dict[str, Any] | None:
    """The engine's LoRA state for /server_info, `live` when asked now (adapters in use change with
    every request); else (engine not ready, or not answering within LORA_INFO_TIMEOUT_S) the last one it
    reported, `live: false`. None before the engine has reported any."""
    if engine.ready:
        try:
            state = (await asyncio.wait_for(engine.list_loras(), LORA_INFO_TIMEOUT_S)).loras
            return {**state, "live": True}
        except Exception as exc:  # /server_info answers whatever the engine does
            logger.info(
                "/server_info: the engine's LoRA state is the last reported (%s)", exc or type(exc).__name__
            )
    last = engine.engine_info.get("loras")
    return None if last is None else {**last, "live": False}
