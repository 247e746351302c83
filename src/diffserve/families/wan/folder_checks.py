"""Load-time checks of Wan-family folders (Wan 2.1 / 2.2, SkyReels-V2) against what Diffusers' pipelines do
with them: a folder whose config Diffusers would run differently from diffserve, or not at all, is refused
here with the key and the value it needs, rather than served with other pixels or failing mid-request."""

from __future__ import annotations

from typing import Any

from diffserve.errors import ModelLoadError


def check_vae_scale_factors(vae: Any) -> None:
    """Refuse an `AutoencoderKLWan` whose `scale_factor_spatial` / `scale_factor_temporal` differ from its
    network's compression (`dim_mult`, `temperal_downsample`, `patch_size`): Diffusers' Wan pipelines size
    the latents (and round `num_frames`) by those two keys, so such a folder makes videos of another size
    and length than asked there, while diffserve sizes them by the network."""
    derived = {
        "scale_factor_spatial": (int(vae.spatial_compression_ratio), "dim_mult and patch_size"),
        "scale_factor_temporal": (int(vae.temporal_compression_ratio), "temperal_downsample"),
    }
    for key, (ratio, keys) in derived.items():
        value = vae.config.get(key)
        if value is None or value != ratio:
            raise ModelLoadError(
                f"vae/config.json: {key} is {value!r}, but the VAE's network ({keys}) compresses {ratio}x: "
                f"Diffusers' Wan pipelines size the latents by {key}, so they would make videos of another "
                f"size than asked; set {key} to {ratio}"
            )


def check_image_encoder(image_encoder: Any, image_dim: int, pos_embed_seq_len: int | None) -> None:
    """Refuse a CLIP vision encoder whose states the DiT cannot take: its width must be the DiT's
    `image_dim`, and an FLF2V DiT's `pos_embed_seq_len` must be two images' tokens (patches + class token).
    Diffusers fails on either mismatch inside the DiT, at the first request."""
    vision = image_encoder.config
    width = int(vision.hidden_size)
    if width != image_dim:
        raise ModelLoadError(
            f"transformer/config.json: image_dim is {image_dim}, but the image encoder's states are {width} "
            "wide (its hidden_size): they must match"
        )
    if pos_embed_seq_len is not None:
        tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1
        if pos_embed_seq_len != 2 * tokens:
            raise ModelLoadError(
                f"transformer/config.json: pos_embed_seq_len is {pos_embed_seq_len}, but the first and last "
                f"frames' CLIP states are 2 x {tokens} tokens (image encoder: image_size {vision.image_size}, "
                f"patch_size {vision.patch_size}); set it to {2 * tokens}"
            )


def refuse_no_temporal_compression(vae: Any) -> None:
    """Refuse a VAE that does not compress time (`temperal_downsample` all false): Diffusers' Wan and
    SkyReels-V2 pipelines round `num_frames` to `factor * k + 1` with `num_frames % factor != 1`, which for
    a factor of 1 adds a frame to every request (their videos are one frame longer than asked)."""
    if int(vae.temporal_compression_ratio) == 1:
        raise ModelLoadError(
            "vae/config.json: temperal_downsample has no true entry (no temporal compression); Diffusers' "
            "Wan pipelines then make num_frames + 1 frames, which diffserve does not reproduce"
        )
