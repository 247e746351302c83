"""Waiting on work for a request only while its client is still there.

A generation can take minutes; when the client goes away meanwhile, the routes stop waiting and cancel
the work (the engine client then sends CancelJob), instead of computing an answer nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from diffserve.server.streaming import wait_for_disconnect

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) when the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
