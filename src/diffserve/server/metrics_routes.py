"""`GET /metrics`: the server's Prometheus metrics (metrics.py), in the text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from diffserve.server.app_state import ServerState

router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(state: ServerState) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
