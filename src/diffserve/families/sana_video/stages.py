"""SANA-Video's own stages, as Diffusers' SanaVideoPipeline does each job.

- Text: Gemma-2's last hidden states of the lower-cased prompt, read after the video "complex human
  instruction" (the prompt is its last line); of the prompt's states the first token's and the last
  max_sequence_length - 1 are kept (the instruction's tail, then the prompt). The negative prompt is read
  bare at max_sequence_length. Diffusers keeps the padding and masks it in the cross-attention (a -10000
  bias: a softmax weight of exactly 0); here each text keeps only its real tokens, which the mask always
  puts first, and texts are padded and masked again only where they share a DiT batch.
- Latents: float32 noise (batch, channels, (num_frames - 1) // temporal + 1, h, w) at the generation
  size: the requested size, or with `use_resolution_binning` the nearest of the DiT's aspect-ratio bins.
- Decoding: the VAE (Wan 2.1's, or LTX-2's in the 720p folders) after undoing its latent normalisation,
  then (binning) every frame resized (bilinear, no antialias) to cover the requested size and
  centre-cropped, before quantisation.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from diffserve import vae_tiling
from diffserve.configs.sampling_params import SamplingParams
from diffserve.distributed.parallel_vae import decode_split
from diffserve.errors import InvalidRequestError
from diffserve.families.sana_video.config import (
    BINS_BY_SAMPLE_SIZE,
    AspectRatioBin,
    sana_video_settings,
)
from diffserve.models.vaes.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from diffserve.request import LatentSize, Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout
from diffserve.stages.input_validation import InputValidationStage
from diffserve.stages.instructed_gemma_text import InstructedGemmaTextEncodingStage
from diffserve.stages.latent_preparation import initial_noise
from diffserve.stages.video_vae_decoding import VideoVaeDecodingStage

# ------------------------------------------------------------------------------ resolution binning


def nearest_bin(height: int, width: int, bins: tuple[AspectRatioBin, ...]) -> tuple[int, int]:
    """(height, width) of the bin whose ratio key is nearest height / width (the first of equals)."""
    ratio = float(height / width)
    _, bin_height, bin_width = min(bins, key=lambda entry: abs(float(entry[0]) - ratio))
    return bin_height, bin_width


class ResolutionBins:
    """Where a request is generated: its own size, or with `use_resolution_binning` (its `extra`) the
    nearest bin of the DiT's `sample_size`."""

    def __init__(self, sample_size: int) -> None:
        self.sample_size = sample_size
        self.bins = BINS_BY_SAMPLE_SIZE.get(sample_size)

    def generation_size(self, params) -> tuple[int, int]:
        if not sana_video_settings(params).use_resolution_binning:
            return params.height, params.width
        if self.bins is None:
            raise InvalidRequestError(
                f"extra['use_resolution_binning'] has no aspect-ratio bins for this SANA-Video transformer "
                f"(sample_size {self.sample_size}; Diffusers bins {sorted(BINS_BY_SAMPLE_SIZE)} only): set it "
                "to false",
                param="extra",
            )
        return nearest_bin(params.height, params.width, self.bins)


def resize_and_crop_video(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(batch, C, frames, h, w) scaled (bilinear) to cover height x width, then centre-cropped to it."""
    batch, channels, frames, current_height, current_width = video.shape
    if (current_height, current_width) == (height, width):
        return video
    scale = max(height / current_height, width / current_width)
    scaled_height, scaled_width = int(current_height * scale), int(current_width * scale)
    images = video.permute(0, 2, 1, 3, 4).reshape(batch * frames, channels, current_height, current_width)
    images = F.interpolate(images, size=(scaled_height, scaled_width), mode="bilinear", align_corners=False)
    top, left = (scaled_height - height) // 2, (scaled_width - width) // 2
    images = images[:, :, top : top + height, left : left + width]
    return images.reshape(batch, frames, channels, height, width).permute(0, 2, 1, 3, 4)


# ------------------------------------------------------------------------------------ validation


class SanaVideoInputValidationStage(InputValidationStage):
    """The shared validation, plus SANA-Video's `extra` settings and Diffusers' rule that the generated
    size (after binning) is a multiple of 32. With binning (the default) any requested size is accepted, as
    in Diffusers: the video is generated at its bin and resized and cropped back to it; without it, the
    requested size is the generated one."""

    takes_family_settings = True

    def __init__(
        self, *args, bins: ResolutionBins, generation_multiple: int, min_side: int = 0, **kwargs
    ) -> None:
        """`generation_multiple`: what the generated height and width must be multiples of (Diffusers' 32,
        and whole DiT patches of latents). `min_side`: the smallest generated height and width the VAE
        decodes (LTX-2's reflect-padded decoder needs two latents a side). The shared size check takes any
        positive size (`pixel_multiple` 1): this stage checks the generated size instead."""
        super().__init__(*args, pixel_multiple=1, **kwargs)
        self.bins = bins
        self.generation_multiple = generation_multiple
        self.min_side = min_side

    def probe_extra(self) -> tuple[tuple[str, object], ...]:
        """Resolution binning off: with it, every square probe is generated at one bin (624x624 at 480p,
        refused as no multiple of 32), and both calibration sizes at the same one, so the memory line
        would be fitted to two equal points and charged to the sizes asked for. Off, a probe runs at its
        own size, which is what a request's memory cost counts."""
        return (("use_resolution_binning", False),)

    def generated_size(self, params: SamplingParams) -> tuple[int, int]:
        """The bin `use_resolution_binning` (on by default) generates at, else the size asked: what the
        latents, the DiT and the VAE's decode run at, and the memory model costs."""
        return self.bins.generation_size(params)

    def resolve(self, params):
        resolved = super().resolve(params)
        sana_video_settings(resolved)  # raises on unknown keys or bad values
        height, width = self.bins.generation_size(resolved)
        m = self.generation_multiple
        binned = sana_video_settings(resolved).use_resolution_binning
        if binned and (height % m or width % m):
            raise InvalidRequestError(
                f"extra['use_resolution_binning'] maps {resolved.height}x{resolved.width} to the bin "
                f"{height}x{width}, which is not a multiple of {m} (SanaVideoPipeline refuses it too): ask "
                "for another aspect ratio, or set it to false",
                param="extra",
            )
        for name, value in (("height", height), ("width", width)):
            if not binned and value % m:
                lower = max(m, value - value % m)
                raise InvalidRequestError(
                    f"{name}={value} is not a multiple of {m} (this model's pixel granularity); try {lower} or "
                    f"{lower + m}, or leave extra['use_resolution_binning'] on (the default): it takes any size",
                    param=name,
                )
        if min(height, width) < self.min_side:
            raise InvalidRequestError(
                f"height and width must be at least {self.min_side} for this model (two latents: its VAE "
                f"decoder pads by reflection), got {height}x{width}",
                param="height" if height < self.min_side else "width",
            )
        return resolved


# ------------------------------------------------------------------------------------------ text


class SanaVideoTextEncodingStage(InstructedGemmaTextEncodingStage):
    """SanaVideoPipeline's prompt encoding (its video instruction), under SANA-Video's own stage name."""


# --------------------------------------------------------------------------------------- latents


class SanaVideoLatentPreparationStage(Stage):
    """Float32 noise (batch, channels, latent frames, h, w) at the generation size, from the request's CPU
    generator (Diffusers keeps SANA-Video's latents and scheduler in float32)."""

    needs = ("generator", "prompt_embeds")
    sets = ("latents", "latent_size")

    def __init__(
        self, channels: int, spatial: int, temporal: int, bins: ResolutionBins, device: torch.device
    ) -> None:
        self.channels, self.spatial, self.temporal = channels, spatial, temporal
        self.bins, self.device = bins, device

    def forward(self, req: Req) -> Req:
        p = req.params
        height, width = self.bins.generation_size(p)
        frames = (p.num_frames - 1) // self.temporal + 1
        h, w = height // self.spatial, width // self.spatial
        shape = (p.num_outputs_per_prompt, self.channels, frames, h, w)
        req.latents = initial_noise(req, shape, torch.float32).to(self.device)
        req.latent_size = LatentSize(h, w)
        return req


# -------------------------------------------------------------------------------------- decoding


def _latent_statistics(vae: nn.Module, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent (mean, std), (1, channels, 1, 1, 1) in the latents' dtype: Wan's from its
    config, LTX-2's from its buffers (what Diffusers' SanaVideoPipeline reads for each)."""
    if isinstance(vae, AutoencoderKLLTX2Video):
        mean, std = vae.latents_mean, vae.latents_std
    else:
        mean, std = torch.tensor(vae.config["latents_mean"]), torch.tensor(vae.config["latents_std"])
    shape = (1, -1, 1, 1, 1)
    return (
        mean.view(shape).to(latents.device, latents.dtype),
        std.view(shape).to(latents.device, latents.dtype),
    )


def _without_chunk_handout():
    """A scope in which the VAE hands no decoded chunk out early (a streamed job's frames): a binned clip is
    resized after its decode, so its chunks are not its frames."""
    return vae_tiling.decode_output_scope(None)


class SanaVideoDecodingStage(VideoVaeDecodingStage):
    """The VAE's decode after undoing its latent normalisation (Diffusers divides by 1 / std, then adds the
    mean: same rounding), then (binning) the frames resized and cropped back to the requested size."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__(vae)
        self.ltx2_vae = isinstance(vae, AutoencoderKLLTX2Video)

    def decode_layout(self) -> DecodeLayout:
        if self.ltx2_vae:
            raise NotImplementedError(
                "SANA-Video with LTX-2's VAE has no mid-denoising previews (its latent statistics are buffers)"
            )
        return super().decode_layout()

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        latents = to_module(self.vae, req.latents)
        mean, std = _latent_statistics(self.vae, latents)
        latents = latents / (1.0 / std) + mean
        p = req.params
        binned = sana_video_settings(p).use_resolution_binning
        with _without_chunk_handout() if binned else nullcontext():
            video = decode_split(self.vae, latents)
        if binned:
            video = resize_and_crop_video(video, p.height, p.width)
        array = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu().numpy()
        req.outputs.frames = list((array * 255).round().astype(np.uint8))  # rounded as Diffusers' processors
        return req
