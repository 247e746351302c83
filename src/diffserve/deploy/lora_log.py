"""The LoRA changes made through `/v1/loras` for one model, as every replica must serve them.

The ingress applies a load or an unload to every running replica at once (engines.py); the log it keeps
(`LoraLog`: the changes that succeeded, numbered by `version`) travels with every job, so a replica
that missed some (started later, or restarted by Ray) catches up before it runs the job: it undoes the
changes the log no longer has and applies the ones it lacks, in order (`plan_catch_up`). The log follows
the single server's replay rules (server/lora_client.py's `LoraOps.record`): an unload drops the earlier
loads of its name, and an unload of a `--lora` adapter stays (a new replica loads those at start).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffserve.server import protocol as msg
from diffserve.server.lora_client import LoraChange, new_op_id


def change_key(change: LoraChange) -> tuple[str, str, str | None]:
    """What identifies a change across processes (op ids differ): its kind, name and path."""
    return type(change).__name__, change.name, getattr(change, "path", None)


@dataclass(frozen=True)
class LoraLog:
    """The changes that succeeded, in order, and a counter of the log's edits."""

    version: int = 0
    changes: tuple[LoraChange, ...] = field(default_factory=tuple)

    def recorded(self, change: LoraChange) -> LoraLog:
        """The log with `change` (which succeeded) recorded, as `LoraOps.record` keeps it."""
        kept = list(self.changes)
        if isinstance(change, msg.LoadLora):
            kept.append(change)
        else:
            loads = [c for c in kept if isinstance(c, msg.LoadLora) and c.name == change.name]
            kept = [c for c in kept if not any(c is load for load in loads)]
            if not loads:
                kept.append(change)
        return LoraLog(self.version + 1, tuple(kept))


def plan_catch_up(log: LoraLog, applied: list[LoraChange]) -> tuple[list[msg.UnloadLora], list[LoraChange]]:
    """What a replica whose engine has `applied` (its `LoraOps.changes`) must do to serve `log`: the
    unloads undoing loads the log no longer has, then the log's changes it lacks, in order (fresh op ids)."""
    wanted = {change_key(c) for c in log.changes}
    have = {change_key(c) for c in applied}
    undo = [
        msg.UnloadLora(new_op_id(), c.name)
        for c in applied
        if isinstance(c, msg.LoadLora) and change_key(c) not in wanted
    ]
    missing = [c for c in log.changes if change_key(c) not in have]
    return undo, missing
