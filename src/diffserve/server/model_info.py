"""Reading the served model's report (the engine's `EngineReady` info) in the front end, which imports no
registry (and so no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def suggested_pipelines(info: Mapping[str, Any], task: str) -> str:
    """The Diffusers pipeline names doing `task` ("image-edit", "image-to-video"), comma-separated, as the
    engine listed them from its registry: what an error suggests to a user whose model cannot do it."""
    by_task = info.get("pipelines_for_task")
    names = by_task.get(task) if isinstance(by_task, Mapping) else None
    return ", ".join(str(name) for name in names) if names else f"a {task} model"
