"""Load-time checks of a Mochi folder against what Diffusers' `MochiPipeline` assumes of its VAE instead of
reading it: 8x spatial and 6x temporal compression (its `vae_spatial_scale_factor` and
`vae_temporal_scale_factor`) and 12 latent channels wherever `latents_mean` / `latents_std` are set (it views
them as 12 values). A VAE built otherwise makes Diffusers size the latents wrongly (videos of another size or
length than asked) or fail when it decodes, so diffserve refuses it with the key to change; so is a scheduler
with dynamic shifting, which Diffusers' pipeline fails on."""

from __future__ import annotations

from typing import Any

from diffserve.errors import ModelLoadError

#: Diffusers' fixed VAE factors and latent channels (the released Mochi 1 VAE's).
SPATIAL_COMPRESSION = 8
TEMPORAL_COMPRESSION = 6
LATENT_CHANNELS = 12


def check_vae_layout(vae: Any) -> None:
    """Refuse an `AutoencoderKLMochi` whose compression or normalised channels differ from Diffusers' fixed ones."""
    config = vae.config
    checks = (
        ("spatial_expansions", int(vae.spatial_compression_ratio), SPATIAL_COMPRESSION),
        ("temporal_expansions", int(vae.temporal_compression_ratio), TEMPORAL_COMPRESSION),
    )
    for key, ratio, fixed in checks:
        if ratio != fixed:
            raise ModelLoadError(
                f"vae/config.json: {key} {tuple(config[key])} compress {ratio}x, but Diffusers' MochiPipeline "
                f"sizes the latents for {fixed}x (its fixed VAE factor), so it would make videos of another "
                "size or length than asked; only Mochi's VAE layout is supported"
            )
    if config.get("latents_mean") is None or config.get("latents_std") is None:
        return
    counts = {
        "latent_channels": int(config["latent_channels"]),
        "latents_mean": len(config["latents_mean"]),
        "latents_std": len(config["latents_std"]),
    }
    wrong = {key: n for key, n in counts.items() if n != LATENT_CHANNELS}
    if wrong:
        raise ModelLoadError(
            f"vae/config.json: {', '.join(f'{k} has {n}' for k, n in wrong.items())} where Diffusers' "
            f"MochiPipeline un-normalises exactly {LATENT_CHANNELS} channels (it fails on others); set "
            "latents_mean and latents_std to null for another channel count"
        )
