"""Builder of small random-weight FLUX.1 Kontext checkpoints in the Diffusers `FluxKontextPipeline` layout.

Kontext's components are FLUX.1's (same DiT, VAE, text encoders and scheduler); only `model_index.json`
differs: its pipeline class, and the IP-Adapter image encoder and feature extractor that the released
FLUX.1-Kontext-dev folder lists as null. The folder loads unchanged in diffserve and diffusers.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux


def build_tiny_flux_kontext(out_dir: str | Path, spec: TinyFluxSpec | None = None) -> Path:
    """Write a random-weight FLUX.1 Kontext folder to `out_dir` and return its path."""
    root = build_tiny_flux(out_dir, spec)
    index_path = root / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "FluxKontextPipeline"
    index["image_encoder"] = [None, None]
    index["feature_extractor"] = [None, None]
    index_path.write_text(json.dumps(index, indent=2))
    return root
