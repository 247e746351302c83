"""Latent preparation: initial noise as a latent image, or packed into 2x2 latent patches (FLUX.1,
Qwen-Image); the packed grid's FLUX.1 position ids."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from diffserve.request import LatentSize, Req
from diffserve.stages.base import Stage


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C*4): each 2x2 patch becomes one token."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack_latents` for a latent grid of `height` x `width` latent pixels."""
    b, _, channels = tokens.shape
    grid = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return grid.reshape(b, channels // 4, height, width)


def latent_image_ids(
    grid_height: int, grid_width: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """(h*w, 3) ids (0, row, col) for FLUX's 3-axis RoPE over the packed grid."""
    rows = torch.arange(grid_height).repeat_interleave(grid_width)
    cols = torch.arange(grid_width).repeat(grid_height)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1)
    return ids.to(device=device, dtype=dtype)


def initial_noise(req: Req, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Noise from the request's CPU generator: the same on every device, and as Diffusers' `randn_tensor`."""
    return torch.randn(shape, generator=req.generator, device="cpu", dtype=dtype)


class SpatialLatentPreparationStage(Stage):
    """Initial noise as a (batch, channels, h, w) latent image, for DiTs that patchify it themselves (SD3)."""

    needs = ("generator", "prompt_embeds")
    sets = ("latents", "latent_size")

    def __init__(self, latent_channels: int, vae_scale_factor: int, device: torch.device, dtype: torch.dtype):
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor
        self.device = device
        self.dtype = dtype

    def forward(self, req: Req) -> Req:
        p = req.params
        h, w = p.height // self.vae_scale_factor, p.width // self.vae_scale_factor
        noise = initial_noise(req, (p.num_outputs_per_prompt, self.latent_channels, h, w), self.dtype)
        req.latents = noise.to(self.device)
        req.latent_size = LatentSize(h, w)
        return req


class LatentPreparationStage(SpatialLatentPreparationStage):
    """Initial noise packed into 2x2 latent patches: (batch, tokens, channels * 4)."""

    sets = ("latents", "latent_size")

    def forward(self, req: Req) -> Req:
        p = req.params
        # Latent height/width are rounded to an even count so 2x2 packing works (as in Diffusers).
        h = 2 * (p.height // (self.vae_scale_factor * 2))
        w = 2 * (p.width // (self.vae_scale_factor * 2))
        shape = (p.num_outputs_per_prompt, self.latent_channels, h, w)
        noise = initial_noise(req, shape, self.dtype)
        req.latents = pack_latents(noise).to(self.device)
        req.latent_size = LatentSize(h, w)
        return req


class PackedLatentIdsPreparationStage(LatentPreparationStage):
    """Initial noise packed into 2x2 latent patches, with the packed grid's (0, row, col) position ids set
    on the request's conditioning (`conditioning_type.of(req).image_ids`), as the FLUX-style DiTs read
    them. A family's stage names its conditioning type."""

    sets = ("latents", "latent_size", "conditioning.image_ids")
    conditioning_type: ClassVar[Any]

    def forward(self, req: Req) -> Req:
        req = super().forward(req)
        assert req.latent_size is not None
        height, width = req.latent_size
        ids = latent_image_ids(height // 2, width // 2, self.device, self.dtype)
        self.conditioning_type.of(req).image_ids = ids
        return req


class VideoLatentPreparationStage(Stage):
    """Initial noise of shape (batch, channels, latent frames, h, w) for a video VAE that compresses
    `temporal` frames (the first alone) and `spatial` pixels per side into one latent, drawn in `dtype`
    (float32 unless the family's reference draws it in the DiT's) on the request's CPU generator."""

    needs = ("generator", "prompt_embeds")
    sets = ("latents", "latent_size")

    def __init__(
        self,
        channels: int,
        spatial: int,
        temporal: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.channels, self.spatial, self.temporal = channels, spatial, temporal
        self.device, self.dtype = device, dtype

    def forward(self, req: Req) -> Req:
        p = req.params
        frames = (p.num_frames - 1) // self.temporal + 1
        h, w = p.height // self.spatial, p.width // self.spatial
        shape = (p.num_outputs_per_prompt, self.channels, frames, h, w)
        req.latents = self.noise(req, shape)
        req.latent_size = LatentSize(h, w)
        return req

    def noise(self, req: Req, shape: tuple[int, ...]) -> torch.Tensor:
        """The initial latents of `shape` on the device: the request's noise drawn in `dtype`."""
        return initial_noise(req, shape, self.dtype).to(self.device)
