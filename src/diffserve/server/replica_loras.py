"""What the two front ends over several engine replicas (`--dp-size`: `replicas.py`; Ray Serve:
`deploy/engines.py`) share of the LoRA admin ops: a load that lands on every ready replica or on none,
and a replica's refusal reworded to name the replica and what the op left behind."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from diffserve.server import protocol as msg
from diffserve.server.engine_client import EngineUnavailableError
from diffserve.server.lora_client import LoraOpError

logger = logging.getLogger("diffserve.server")

#: One replica as a front end holds it (an `EngineClient`, a Ray replica's record).
Replica = TypeVar("Replica")


def on_replica(replica_id: object, error: Exception, outcome: str) -> Exception:
    """`error` from one replica's LoRA op, its message naming the replica and the op's `outcome`."""
    message = f"replica {replica_id}: {error}; {outcome}"
    if isinstance(error, LoraOpError):
        return LoraOpError(message, error.status, error.param, error.code)
    if isinstance(error, EngineUnavailableError):
        return EngineUnavailableError(message, error.code)
    return error


async def load_on_all_or_none(
    replicas: Sequence[Replica],
    load: Callable[[Replica], Awaitable[Any]],
    unload: Callable[[Replica], Awaitable[Any]],
    replica_id: Callable[[Replica], object],
    name: str,
) -> msg.LoraOpDone:
    """Load LoRA `name` on every one of `replicas` at once (`load`), or on none: where it loaded it is
    unloaded again (`unload`) when another replica refused it, and that refusal is the answer (as it came
    when every replica refused alike, a bad path or file; else naming the replica). The caller records
    the op for replicas that start later."""
    results = await asyncio.gather(*(load(r) for r in replicas), return_exceptions=True)
    failed = [(r, e) for r, e in zip(replicas, results, strict=True) if isinstance(e, BaseException)]
    if failed:
        loaded = [r for r, e in zip(replicas, results, strict=True) if not isinstance(e, BaseException)]
        for replica in loaded:
            try:
                await unload(replica)
            except Exception as exc:
                logger.error(
                    "Replica %s: could not undo the load of LoRA %r: %s", replica_id(replica), name, exc
                )
        replica, error = failed[0]
        if not loaded or not isinstance(error, Exception):
            raise error  # every replica refused it alike (a bad path or file): their answer
        raise on_replica(replica_id(replica), error, f"LoRA {name!r} was loaded on no replica")
    return next(r for r in results if isinstance(r, msg.LoraOpDone))
