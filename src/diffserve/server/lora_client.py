"""The front end's side of one engine's LoRA admin ops: sent with an op id, answered by the engine
(`engine_loras.py`) with a `LoraOpDone` or a `LoraOpFailed`.

The loads and unloads that succeeded are kept (`changes`) so that an engine process that (re)starts gets
them again, in order, before it takes requests (`restore`): a restarted engine (or a `--dp-size` replica
that was starting while they were made) serves the adapters the admin routes left, not only `--lora`'s.
The replayed loads are lazy (the engine checks each file is there and reads it when a request names it),
and there are at most `--max-loras` of them (the engine refuses more), so a restart serves at once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from diffserve.server import protocol as msg

logger = logging.getLogger("diffserve.server")

#: A LoRA admin op that changes what the engine serves (replayed on a restarted engine).
LoraChange = msg.LoadLora | msg.UnloadLora
LoraOp = msg.LoadLora | msg.UnloadLora | msg.ListLoras


class LoraOpError(Exception):
    """The engine refused or failed a LoRA admin op (-> `status`: 400, 404, 409 or 500)."""

    def __init__(self, message: str, status: int, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def new_op_id() -> str:
    return uuid.uuid4().hex


class LoraOps:
    """One engine's LoRA ops in flight and the changes to replay. `send` hands a message to the engine
    (raising when it cannot); `name` names the engine in the log."""

    def __init__(self, name: str, send: Callable[[Any], None]) -> None:
        self.name, self._send = name, send
        self._waiting: dict[str, asyncio.Future[msg.LoraOpDone]] = {}
        #: The loads and unloads that succeeded, in order.
        self.changes: list[LoraChange] = []

    async def request(self, op: LoraOp) -> msg.LoraOpDone:
        """Send `op` and wait for the engine's answer (raises LoraOpError, or what `fail_all` was given)."""
        future: asyncio.Future[msg.LoraOpDone] = asyncio.get_running_loop().create_future()
        self._waiting[op.op_id] = future
        try:
            self._send(op)
            return await future
        finally:
            self._waiting.pop(op.op_id, None)

    def answer(self, message: msg.LoraOpDone | msg.LoraOpFailed) -> None:
        """The engine's answer to an op in flight (an answer nobody waits for any more is dropped)."""
        future = self._waiting.get(message.op_id)
        if future is None or future.done():
            return
        if isinstance(message, msg.LoraOpDone):
            future.set_result(message)
        else:
            future.set_exception(LoraOpError(message.message, message.status, message.param, message.code))

    def fail_all(self, error: Exception) -> None:
        """The engine will not answer (it died, the server stops): every op in flight raises `error`."""
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(error)

    def record(self, op: LoraChange) -> None:
        """Keep a load or unload that succeeded. An unload drops the earlier loads of its name; one that
        dropped none (an adapter of `--lora`) is kept, so that a restarted engine unloads it again."""
        if isinstance(op, msg.LoadLora):
            self.changes.append(op)
            return
        loads = [c for c in self.changes if isinstance(c, msg.LoadLora) and c.name == op.name]
        self.changes = [c for c in self.changes if not any(c is load for load in loads)]
        if not loads:
            self.changes.append(op)

    def forget(self, name: str) -> None:
        """The engine has no adapter `name` (it answered 404): drop the loads of it kept for replay."""
        self.changes = [c for c in self.changes if not (isinstance(c, msg.LoadLora) and c.name == name)]

    async def restore(self, current: Callable[[], bool]) -> dict[str, Any] | None:
        """Replay `changes` on a freshly started engine while `current()` (False once that engine died or
        the server stops); the engine's LoRA state after the last one that succeeded, None if none did.
        A change that fails now (its file gone) is logged and dropped; an unload of an adapter that is
        already gone is no failure."""
        state = None
        for op in list(self.changes):
            again = (
                replace(op, op_id=new_op_id(), lazy=True)
                if isinstance(op, msg.LoadLora)
                else replace(op, op_id=new_op_id())
            )
            try:
                done = await self.request(again)
            except LoraOpError as exc:
                if not (isinstance(op, msg.UnloadLora) and exc.status == 404):
                    logger.error("%s: could not restore LoRA %r (%s): %s", self.name, op.name, type(op).__name__, exc)  # fmt: skip
                    self.changes.remove(op)
                continue
            except (
                Exception
            ) as exc:  # the engine died or stopped (its watch task takes over), or cannot be reached
                if current():
                    logger.error("%s: restoring the LoRA adapters stopped: %s", self.name, exc)
                return state
            if not current():
                return state
            state = done.loras
        if self.changes:
            logger.info("%s: restored %d LoRA change(s) made through /v1/loras", self.name, len(self.changes))
        return state
