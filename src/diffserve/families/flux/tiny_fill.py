"""Builder of small random-weight FLUX.1 Fill checkpoints in the Diffusers `FluxFillPipeline` layout.

FLUX.1 Fill's components are FLUX.1's except its DiT's input width: each image token carries its noisy
latents, the masked input image's latents and the mask's 8x8 pixels per latent pixel, packed 2x2
(64 + 64 + 256 = 384 channels for the FLUX VAE), while it predicts the 64 noisy channels only. The folder
loads unchanged in diffserve and diffusers.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux


def build_tiny_flux_fill(out_dir: str | Path, spec: TinyFluxSpec | None = None) -> Path:
    """Write a random-weight FLUX.1 Fill folder to `out_dir` and return its path."""
    spec = spec or TinyFluxSpec()
    packed = spec.latent_channels * 4
    vae_scale = 2 ** (len(spec.vae_block_out_channels) - 1)
    mask_channels = vae_scale * vae_scale * 4
    dit = {"in_channels": 2 * packed + mask_channels, "out_channels": packed, **spec.extra_dit_config}
    root = build_tiny_flux(out_dir, replace(spec, extra_dit_config=dit))
    index_path = root / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_class_name"] = "FluxFillPipeline"
    index_path.write_text(json.dumps(index, indent=2))
    return root
