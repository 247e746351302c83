"""Backends other than diffserve's native pipelines. `--backend diffusers` (`diffusers_pipeline.py`) runs a
Diffusers pipeline class diffserve has not ported through diffusers itself, behind the same CLI, API, server
and outputs, one request at a time. Native stays the default, and nothing falls back to another backend:
a folder whose pipeline is not ported is refused unless the backend is asked for by name."""

from __future__ import annotations

from typing import Literal

from diffserve.configs.engine_args import BACKENDS as BACKENDS  # `--backend` choices, declared there

Backend = Literal["native", "diffusers"]

#: What the diffusers backend does not do, as the startup log and /server_info list it.
DIFFUSERS_BACKEND_DISABLED = (
    "step batching (one request runs at a time)",
    "quality tiers other than high (exact)",
    "LoRA adapters",
    "streamed previews (partial_images)",
    "--compile, quantization, single-file weights, offload",
    "multi-device parallelism",
)


def describe_backend(name: str) -> dict[str, object]:
    """The `backend` block of /server_info: its name and, for a non-native one, what it disables."""
    if name == "native":
        return {"name": "native", "step_batching": True, "disabled": []}
    return {
        "name": name,
        "step_batching": False,
        "quality_tiers": ["high"],
        "disabled": list(DIFFUSERS_BACKEND_DISABLED),
    }
