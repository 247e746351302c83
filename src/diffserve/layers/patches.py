"""Checks on the latent grids that DiTs cut into patch tokens."""

from __future__ import annotations

import torch


def video_patch_grid(latents: torch.Tensor, patch: tuple[int, int, int]) -> tuple[int, int, int]:
    """The (frames, rows, columns) of patches of video latents (batch, channels, frames, height, width)
    cut into `patch` = (frames, height, width) patches; a latent size the patch does not divide is
    refused (Diffusers' video DiTs would drop the remainder, or fail later with a shape error)."""
    if latents.ndim != 5:
        raise ValueError(
            f"hidden_states must be (batch, channels, frames, height, width), got {tuple(latents.shape)}"
        )
    frames, height, width = latents.shape[2:]
    p_t, p_h, p_w = patch
    if frames % p_t or height % p_h or width % p_w:
        raise ValueError(
            f"latent size (frames, height, width) = {(frames, height, width)} must be a multiple of "
            f"patch_size {tuple(patch)}"
        )
    return frames // p_t, height // p_h, width // p_w
