"""LTX-2's initial latents, as Diffusers' `prepare_latents` then `prepare_audio_latents`, from the request's
CPU generator in that order: the video noise (batch, channels, frames, h, w) packed into tokens
(batch, frames * h * w, channels) (LTX-2's DiT patches are 1x1x1), then the audio noise
(batch, channels, steps, mel bins / 4) packed as (batch, steps, channels * mel bins / 4). The audio is as
long as the clip: round(num_frames / fps * latent steps per second), 25 steps a second for LTX-2's 16 kHz
mel spectrograms (hop 160, 4x compression).

Image-to-video (`LTX2ImageToVideoPipeline`): the input image, re-compressed as an H.264 frame at the
model's CRF (the compression it was trained with), resized (bilinear) to the output size and VAE-encoded
(posterior mode, normalised), is the first latent frame; the rest is noise. The denoiser keeps that frame
(its tokens run at timestep 0 and are never stepped), as Diffusers does."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torch import nn

from diffserve.families.ltx2.conditioning import LTX2Conditioning
from diffserve.families.ltx2.config import ltx2_guidance
from diffserve.request import LatentSize, Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.latent_preparation import initial_noise


def pack_video_latents(latents: torch.Tensor) -> torch.Tensor:
    """(batch, channels, frames, h, w) -> (batch, frames * h * w, channels): 1x1x1 patches, frame-major."""
    return latents.flatten(2).transpose(1, 2)


def unpack_video_latents(tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack_video_latents`."""
    return tokens.transpose(1, 2).unflatten(2, (frames, height, width))


def pack_audio_latents(latents: torch.Tensor) -> torch.Tensor:
    """(batch, channels, steps, mel) -> (batch, steps, channels * mel), channel-major per step."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio_latents(tokens: torch.Tensor, mel_bins: int) -> torch.Tensor:
    """Inverse of `pack_audio_latents`."""
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)


def audio_latent_steps(num_frames: int, fps: float, latents_per_second: float) -> int:
    """Audio latent steps of a clip of `num_frames` at `fps` (Diffusers: round(duration * steps per second))."""
    return round(num_frames / fps * latents_per_second)


def recompress_frame(image: Image.Image, crf: int) -> Image.Image:
    """The image as one H.264 frame at `crf` would show it (even-cropped, yuv420p, x264 "veryfast"),
    decoded back to RGB; crf 0 returns it unchanged. LTX-2 conditions on images compressed like this."""
    if crf == 0:
        return image
    import av  # lazily: only image-to-video needs it

    rgb = np.array(image.convert("RGB"))
    rgb = rgb[: rgb.shape[0] // 2 * 2, : rgb.shape[1] // 2 * 2]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=1, options={"crf": str(crf), "preset": "veryfast"})
        stream.height, stream.width = rgb.shape[:2]
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    buffer.seek(0)
    with av.open(buffer) as container:
        decoded = next(container.decode(video=0))
        return Image.fromarray(decoded.to_ndarray(format="rgb24"))


def image_to_tensor(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """Diffusers' video processor with bilinear resampling: (1, 3, height, width) float32 in [-1, 1]."""
    resized = image.resize((width, height), resample=Image.Resampling.BILINEAR)
    array = np.array(resized).astype(np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).unsqueeze(0) * 2.0 - 1.0


def normalize_video_latents(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """VAE latents -> the DiT's space: (z - mean) / std per channel (Diffusers' I2V scaling factor is 1)."""
    mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    return (latents - mean) * 1.0 / std


class FirstFrameCondition:
    """Image-to-video: the input image's normalised latents (1, channels, 1, h, w), float32; `crf` is the
    model's default re-compression (a request's `image_crf` overrides it)."""

    def __init__(self, vae: nn.Module, crf: int) -> None:
        self.vae = vae
        self.crf = crf

    @torch.inference_mode()
    def latents(self, image: Image.Image, height: int, width: int, crf: int | None) -> torch.Tensor:
        image = recompress_frame(image, self.crf if crf is None else crf)
        pixels = image_to_tensor(image, height, width).unsqueeze(2)
        encoded = self.vae.encode(to_module(self.vae, pixels)).mode()
        return normalize_video_latents(self.vae, encoded.float())


class LTX2LatentPreparationStage(Stage):
    needs = ("generator", "prompt_embeds")
    sets = ("latents", "conditioning.audio_latents", "latent_size")

    def __init__(
        self,
        channels: int,
        audio_channels: int,
        audio_mel_bins: int,
        spatial: int,
        temporal: int,
        audio_latents_per_second: float,
        device: torch.device,
        first_frame: FirstFrameCondition | None = None,
    ) -> None:
        self.channels = channels
        self.audio_channels = audio_channels
        self.audio_mel_bins = audio_mel_bins
        self.spatial = spatial
        self.temporal = temporal
        self.audio_latents_per_second = audio_latents_per_second
        self.device = device
        self.first_frame = first_frame

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        p = req.params
        n = req.batch_size
        frames = (p.num_frames - 1) // self.temporal + 1
        h, w = p.height // self.spatial, p.width // self.spatial
        shape = (n, self.channels, frames, h, w)
        if self.first_frame is None:
            video = initial_noise(req, shape, torch.float32)
        else:
            crf = ltx2_guidance(p, image_to_video=True).image_crf
            image = self.first_frame.latents(p.input_images[0], p.height, p.width, crf).cpu()
            noise = initial_noise(req, shape, torch.float32)
            mask = torch.zeros(n, 1, frames, h, w)
            mask[:, :, 0] = 1.0
            video = image.repeat(1, 1, frames, 1, 1) * mask + noise * (1 - mask)
        steps = audio_latent_steps(p.num_frames, float(p.fps), self.audio_latents_per_second)
        audio = initial_noise(req, (n, self.audio_channels, steps, self.audio_mel_bins), torch.float32)
        req.latents = pack_video_latents(video).to(self.device)
        LTX2Conditioning.of(req).audio_latents = pack_audio_latents(audio).to(self.device)
        req.latent_size = LatentSize(h, w)
        return req
