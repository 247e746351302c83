"""The engine process's side of the LoRA admin routes (`POST/GET/DELETE /v1/loras`).

Loads and unloads run on a worker thread of their own, so the receiver thread keeps taking jobs and
cancels. A load reads and checks its file on that thread (`LoraRegistry.prepare`: the denoising loop runs
on meanwhile), then registers it through `Engine.run_exclusive` (between two steps, never during one:
with several ranks the op is broadcast like a step); an unload runs through `run_exclusive` whole. A
restarted engine's adapters come back without being read (`LoadLora.lazy`: read when a request names
them). Listing reads the registry at once (its lock makes that safe while requests pin and release
adapters).

Every op is answered: `LoraOpDone` with the engine's LoRA state after it, or `LoraOpFailed` with the HTTP
status the front end answers (400 a bad name, path or file; 404 an adapter that is not loaded; 409 a name
already taken, an adapter requests (queued or running) name, or --max-loras adapters loaded; 503 when the
adapters running requests use fill --max-lora-memory: retry). A failing op changes nothing and never
stops the engine or a running request.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from diffserve.errors import LoraBusyError, LoraError, LoraLimitError
from diffserve.server import protocol as msg

if TYPE_CHECKING:
    from diffserve.runtime.engine import Engine as RuntimeEngine
    from diffserve.runtime.lora_registry import LoraRegistry

logger = logging.getLogger("diffserve.engine")

LoraOp = msg.LoadLora | msg.UnloadLora | msg.ListLoras


class Sender(Protocol):
    """Where the answers go: the engine process's channel to the front end."""

    def send(self, message: Any) -> None: ...


class LoraOpRefused(Exception):
    """An op the engine will not run, with the front end's answer (`status`, `param`, `code`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class EngineLoras:
    """Runs the front end's LoRA ops against the engine runner's registry (`runtime/lora_registry.py`)."""

    def __init__(self, engine: RuntimeEngine, channel: Sender) -> None:
        self.engine, self.channel = engine, channel
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-admin")

    @property
    def registry(self) -> LoraRegistry | None:
        return self.engine.runner.loras

    def handle(self, op: LoraOp) -> None:
        """Answer `op`: a listing now, a load or unload once it has run (on the worker thread)."""
        if not isinstance(op, msg.ListLoras):
            self._worker.submit(self._run, op)
            return
        try:
            answer: msg.LoraOpDone | msg.LoraOpFailed = msg.LoraOpDone(op.op_id, self.summary())
        except Exception as exc:
            logger.exception("Listing the LoRA adapters failed")
            answer = msg.LoraOpFailed(op.op_id, f"{type(exc).__name__}: {exc}", 500, None, "lora_op_failed")
        self.channel.send(answer)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _run(self, op: msg.LoadLora | msg.UnloadLora) -> None:
        answer: msg.LoraOpDone | msg.LoraOpFailed
        try:
            adapter = self._load(op) if isinstance(op, msg.LoadLora) else self._unload(op)
            answer = msg.LoraOpDone(op.op_id, self.summary(), adapter)
        except LoraOpRefused as exc:
            logger.info("LoRA %r: %s refused: %s", op.name, type(op).__name__, exc)
            answer = msg.LoraOpFailed(op.op_id, str(exc), exc.status, exc.param, exc.code)
        except LoraBusyError as exc:  # the adapters running requests use fill --max-lora-memory: for now
            logger.info("LoRA %r: %s refused for now: %s", op.name, type(op).__name__, exc)
            answer = msg.LoraOpFailed(op.op_id, str(exc), 503, None, "lora_memory_full")
        except LoraLimitError as exc:
            logger.info("LoRA %r: %s refused: %s", op.name, type(op).__name__, exc)
            answer = msg.LoraOpFailed(op.op_id, str(exc), 409, "name", "too_many_loras")
        except LoraError as exc:  # read or checked by the registry: the file does not fit this model
            logger.info("LoRA %r: %s refused: %s", op.name, type(op).__name__, exc)
            param = "path" if isinstance(op, msg.LoadLora) else "name"
            answer = msg.LoraOpFailed(op.op_id, str(exc), 400, param, "invalid_lora")
        except Exception as exc:  # a bug, or a broken rank group (the rank watchdog restarts the engine)
            logger.exception("LoRA %r: %s failed", op.name, type(op).__name__)
            answer = msg.LoraOpFailed(op.op_id, f"{type(exc).__name__}: {exc}", 500, None, "lora_op_failed")
        try:
            self.channel.send(answer)
        except Exception:
            logger.exception("LoRA %r: could not send the answer to %s", op.name, type(op).__name__)

    def _checked_registry(self) -> LoraRegistry:
        registry = self.registry
        if registry is None:
            raise LoraOpRefused("this model takes no LoRA adapters", code="lora_unsupported")
        if registry.merged:
            raise LoraOpRefused(
                f"this server merged its LoRA adapters into the weights at start ({', '.join(registry.merged)}, "
                "--lora-merge): adapters cannot be loaded or unloaded",
                code="lora_merged",
            )
        return registry

    def _load(self, op: msg.LoadLora) -> dict[str, Any]:
        """Checks what the request can fix first (name, --lora-dir, path), then reads the file here and
        registers it between two steps (a lazy load, replayed on a restarted engine, reads nothing)."""
        from diffserve.runtime.lora_registry import check_name

        registry = self._checked_registry()
        try:
            check_name(op.name)
        except LoraError as exc:
            raise LoraOpRefused(str(exc), param="name", code="invalid_value") from None
        if registry.lora_dir is None:
            raise LoraOpRefused(
                "this server has no --lora-dir: POST /v1/loras loads adapter files from that folder only; "
                "start the server with --lora-dir DIR (or load adapters at start with --lora)",
                param="path",
                code="lora_dir_not_set",
            )
        if op.name in registry.names():
            raise LoraOpRefused(
                f"a LoRA named {op.name!r} is already loaded; DELETE /v1/loras/{op.name} first, or pick another name",
                status=409,
                param="name",
                code="lora_exists",
            )
        try:
            path = registry.inside_lora_dir(op.path)
            is_file = path.is_file()
        except LoraError as exc:
            raise LoraOpRefused(str(exc), param="path", code="invalid_path") from None
        except OSError as exc:  # e.g. a component name too long
            raise LoraOpRefused(
                f"LoRA path cannot be used: {exc.strerror or exc}", param="path", code="invalid_path"
            ) from None
        if not is_file:
            shown = op.path if len(op.path) <= 200 else f"{op.path[:120]}...{op.path[-60:]}"
            raise LoraOpRefused(
                f"LoRA path {shown!r} is not a file in --lora-dir", param="path", code="lora_file_not_found"
            )
        if op.lazy and self._one_rank():
            return self.engine.run_exclusive(lambda: registry.know(op.name, path).to_dict())
        registry.prepare(op.name, path, op.strict)  # the read, off the denoising loop
        return self.engine.run_exclusive(
            lambda: self.engine.runner.load_lora(op.name, str(path), op.strict).to_dict()
        )

    def _one_rank(self) -> bool:
        """Whether this engine is one rank (several ranks each read an adapter when it is loaded)."""
        state = self.engine.runner.parallel_state
        return state is None or state.world_size == 1

    def _unload(self, op: msg.UnloadLora) -> None:
        self.engine.run_exclusive(lambda: self._unload_now(op))

    def _unload_now(self, op: msg.UnloadLora) -> None:
        from diffserve.runtime.lora_registry import describe_use

        registry = self._checked_registry()
        infos = {info.name: info for info in registry.infos()}
        info = infos.get(op.name)
        if info is None:
            loaded = ", ".join(infos) or "none"
            raise LoraOpRefused(
                f"no LoRA named {op.name!r} is loaded (loaded: {loaded})", 404, "name", "lora_not_found"
            )
        if info.in_use:
            raise LoraOpRefused(
                f"LoRA {op.name!r} is used by {describe_use(info.in_use - info.queued, info.queued)}; retry when "
                "they finish",
                409,
                "name",
                "lora_in_use",
            )
        self.engine.runner.unload_lora(op.name)
        return None

    def summary(self) -> dict[str, Any]:
        """The `loras` block of /server_info: every known adapter (`LoraInfo.to_dict()`: name, rank,
        bytes, in_use, ...), the merged ones, the device bytes the resident ones take and the budget."""
        registry = self.registry
        if registry is None:
            return {"enabled": False, "adapters": [], "merged": [], "resident_bytes": 0, "max_lora_memory": 0,
                    "lora_dir": None}  # fmt: skip
        infos = registry.infos()
        merged = list(registry.merged)
        return {
            # Whether requests may name adapters: some are loaded or can be, and none were merged.
            "enabled": not merged and (bool(infos) or registry.lora_dir is not None),
            "adapters": [info.to_dict() for info in infos],
            "merged": merged,
            "resident_bytes": sum(info.num_bytes for info in infos if info.resident),
            "max_lora_memory": registry.max_bytes,
            "lora_dir": None if registry.lora_dir is None else str(registry.lora_dir),
        }
