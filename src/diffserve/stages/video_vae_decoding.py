"""Decoding through a causal video VAE (Qwen-Image's, Wan's; an image is one frame), after undoing the
per-channel normalisation the DiT's latents carry. With several ranks every rank runs these stages and
the decode is split by rows over them (`diffserve.distributed.parallel_vae.decode_split`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from diffserve.distributed.parallel_vae import decode_split
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout, tensor_to_pil
from diffserve.stages.latent_preparation import unpack_latents


def latent_stats(
    vae: nn.Module, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent (mean, std), shaped (1, channels, 1, 1, 1) to broadcast over video latents."""
    channels = int(vae.config["z_dim"])
    mean = torch.tensor(vae.config["latents_mean"]).view(1, channels, 1, 1, 1)
    std = torch.tensor(vae.config["latents_std"]).view(1, channels, 1, 1, 1)
    return mean.to(device, dtype), std.to(device, dtype)


def normalize_latents(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """VAE latents -> the DiT's normalised space (the edit pipelines' conditioning images)."""
    mean, std = latent_stats(vae, latents.device, latents.dtype)
    return (latents - mean) / std


def denormalize_latents(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """The DiT's normalised latents -> VAE latents, dividing by 1/std as Diffusers does (same rounding)."""
    mean, std = latent_stats(vae, latents.device, latents.dtype)
    return latents / (1.0 / std) + mean


class VideoVaeImageDecodingStage(Stage):
    """Packed one-frame latents -> PIL images through a video VAE."""

    needs = ("latents", "latent_size")
    sets = ("outputs.images",)

    def __init__(self, vae: nn.Module) -> None:
        self.vae = vae

    def decode_layout(self) -> DecodeLayout:
        return DecodeLayout(self.vae, packed=True, video_vae=True)

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        latents = unpack_latents(req.latents, *req.latent_size).unsqueeze(2)
        frames = decode_split(self.vae, denormalize_latents(self.vae, to_module(self.vae, latents)))
        req.outputs.images = tensor_to_pil(frames[:, :, 0])
        return req


class VideoVaeDecodingStage(Stage):
    """(B, C, F, h, w) normalised latents -> one uint8 (frames, H, W, 3) array per output video."""

    needs = ("latents",)
    sets = ("outputs.frames",)

    def __init__(self, vae: nn.Module) -> None:
        self.vae = vae

    def decode_layout(self) -> DecodeLayout:
        return DecodeLayout(self.vae, packed=False, video_vae=True)

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        video = decode_split(self.vae, denormalize_latents(self.vae, to_module(self.vae, req.latents)))
        req.outputs.frames = video_to_uint8(video)
        return req


def video_to_uint8(video: torch.Tensor) -> list[np.ndarray]:
    """(B, C, F, H, W) pixels in [-1, 1] -> one uint8 (F, H, W, 3) array per video, rounded as Diffusers'
    processors do. Elementwise, so a temporal chunk converts to exactly its frames of the whole clip (what
    a streamed job publishes while the rest decodes)."""
    array = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu().numpy()
    return list((array * 255).round().astype(np.uint8))
