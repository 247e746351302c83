"""LTX-2's decoding, as Diffusers' after its loop: the video tokens unpacked to (batch, channels, frames,
h, w), mixed with `decode_noise_scale` of fresh noise and decoded at `decode_timestep` when the VAE's
decoder is timestep-conditioned, denormalised (x * std / scaling_factor + mean) and decoded to uint8
frames; the audio tokens denormalised (per packed channel), unpacked to (batch, channels, steps, mel bins),
decoded by the audio VAE to a mel spectrogram and by the vocoder to a waveform."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from diffserve.families.ltx2.conditioning import LTX2Conditioning
from diffserve.families.ltx2.config import ltx2_guidance
from diffserve.families.ltx2.latent_preparation import unpack_audio_latents, unpack_video_latents
from diffserve.request import Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout
from diffserve.stages.latent_preparation import initial_noise
from diffserve.vae_tiling import requested_tiling


def denormalize_video_latents(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """The DiT's normalised latents -> VAE latents: x * std / scaling_factor + mean per channel."""
    mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    return latents * std / float(vae.config["scaling_factor"]) + mean


class LTX2DecodingStage(Stage):
    needs = ("latents", "conditioning.audio_latents", "latent_size")
    sets = ("outputs.frames", "outputs.audio", "outputs.audio_sample_rate")

    def __init__(
        self,
        vae: nn.Module,
        audio_vae: nn.Module,
        vocoder: nn.Module,
        dtype: torch.dtype,
        image_to_video: bool,
    ) -> None:
        self.vae = vae
        self.audio_vae = audio_vae
        self.vocoder = vocoder
        self.dtype = dtype
        self.image_to_video = image_to_video

    def decode_layout(self) -> DecodeLayout:
        raise NotImplementedError(
            "LTX-2 has no mid-denoising previews (its latents are packed video + audio)"
        )

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        req.outputs.frames = self.decode_video(req)
        req.outputs.audio = self.decode_audio(req)
        req.outputs.audio_sample_rate = int(self.vocoder.sample_rate)
        return req

    def decode_video(self, req: Req) -> list[np.ndarray]:
        h, w = req.latent_size
        frames = req.latents.shape[1] // (h * w)
        latents = unpack_video_latents(req.latents, frames, h, w).to(self.dtype)
        temb = None
        if self.vae.config["timestep_conditioning"]:
            settings = ltx2_guidance(req.params, self.image_to_video)
            # Drawn even at scale 0, as Diffusers draws it: the generator's state is part of the result.
            noise = initial_noise(req, tuple(latents.shape), latents.dtype).to(latents.device)
            scale = (
                settings.decode_timestep
                if settings.decode_noise_scale is None
                else settings.decode_noise_scale
            )
            # One decode timestep per video. Diffusers makes one per prompt, which its decoder cannot take
            # with num_videos_per_prompt > 1 (a shape error); per video, each clip decodes as it would alone.
            temb = torch.full(
                (latents.shape[0],), settings.decode_timestep, device=latents.device, dtype=latents.dtype
            )
            scale_t = torch.full(
                (latents.shape[0], 1, 1, 1, 1), scale, device=latents.device, dtype=latents.dtype
            )
            latents = (1 - scale_t) * latents + scale_t * noise
        latents = denormalize_video_latents(self.vae, latents)
        with requested_tiling(self.vae):  # the engine's automatic tiling of this decode
            video = self.vae.decode(
                to_module(self.vae, latents), None if temb is None else to_module(self.vae, temb)
            )
        array = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu().numpy()
        return list((array * 255).round().astype(np.uint8))  # rounding as Diffusers' processors do

    def decode_audio(self, req: Req) -> list[torch.Tensor]:
        latents = self.audio_vae.denormalize_latents(LTX2Conditioning.of(req).audio_latents)
        latents = unpack_audio_latents(latents, self.audio_vae.latent_mel_bins)
        mel = self.audio_vae.decode(to_module(self.audio_vae, latents))
        waveform = self.vocoder(to_module(self.vocoder, mel)).float().cpu()
        return list(waveform)
