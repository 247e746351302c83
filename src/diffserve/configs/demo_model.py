"""Where the trained demo model shipped inside the package lives (used when no --model-path is given)."""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

from diffserve.errors import ModelLoadError

logger = logging.getLogger("diffserve")

DEMO_MODEL_NAME = "shapes-demo"


def demo_model_path() -> Path:
    """Path of the shipped demo model folder; a clear error if this install does not contain it."""
    path = Path(str(resources.files("diffserve") / "assets" / DEMO_MODEL_NAME))
    if not (path / "model_index.json").is_file():
        raise ModelLoadError(
            f"no --model-path given and the shipped demo model is missing from this install ({path}); "
            "pass --model-path DIR with a Diffusers model folder"
        )
    return path


def model_path_or_demo(model_path: str | None) -> str:
    """`model_path` as given, or the shipped demo model's path (logged) when it is None."""
    if model_path is not None:
        return model_path
    path = str(demo_model_path())
    logger.info("No --model-path given: using the shipped demo model at %s", path)
    return path
