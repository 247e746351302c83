"""The generation parameters embedded in every output file, built in one place for the CLI, the Python API
and the server, so a file carries the same record however it was made."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from diffserve.configs.sampling_params import IMAGE_FIELDS

if TYPE_CHECKING:
    from diffserve.configs.sampling_params import SamplingParams


def output_metadata(model_path: str, diffusers_pipeline: str, params: SamplingParams) -> dict[str, Any]:
    """`{"model": ..., "pipeline": ..., **params}`: the JSON-friendly request fields, the model folder and
    its Diffusers pipeline class.

    Input images and the mask (`IMAGE_FIELDS`) are never included, not even their sizes: they are inputs
    rather than parameters, and a file's metadata must not depend on how the caller passed them.
    """
    fields = {k: v for k, v in params.to_dict().items() if k not in IMAGE_FIELDS}
    return {"model": model_path, "pipeline": diffusers_pipeline, **fields}


def metadata_json(metadata: dict[str, Any]) -> str:
    """The text embedded in a file: JSON with sorted keys (stable bytes for equal metadata), non-JSON values
    (paths, enums) as their `str`, non-ASCII escaped (so it fits ASCII-only slots such as EXIF tags)."""
    return json.dumps(metadata, sort_keys=True, default=str)
