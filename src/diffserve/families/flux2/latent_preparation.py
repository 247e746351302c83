"""FLUX.2's latent plumbing, as Diffusers' Flux2Pipeline / Flux2KleinPipeline do it: the initial noise
(drawn directly in the patchified (B, 4 * C, h/2, w/2) layout, then flattened row-major into tokens), the
tokens' 4-axis position ids, the sigma schedule (shifted by BFL's empirical `mu`, which depends on the
step count as well as the image size), and the decoding (tokens -> patchified latents -> undo the VAE's
`bn` normalisation -> unpatchify -> VAE decoder).
"""

from __future__ import annotations

import torch
from PIL import Image

from diffserve.distributed.parallel_vae import decode_split
from diffserve.families.flux2.conditioning import Flux2Conditioning
from diffserve.models.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffserve.request import LatentSize, Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import tensor_to_pil
from diffserve.stages.latent_preparation import initial_noise
from diffserve.stages.timestep_preparation import TimestepPreparationStage


def flux2_grid_ids(rows: int, cols: int, time: int, device: torch.device) -> torch.Tensor:
    """(rows * cols, 4) ids (T, H, W, L) = (time, h, w, 0) of a token grid in row-major order: time 0 for
    the noisy latents, 10, 20, ... for reference images (Diffusers' `_prepare_latent_ids` /
    `_prepare_image_ids`)."""
    h = torch.arange(rows, device=device).repeat_interleave(cols)
    w = torch.arange(cols, device=device).repeat(rows)
    return torch.stack([torch.full_like(h, time), h, w, torch.zeros_like(h)], dim=-1)


def tokens_from_grid(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) patchified latents -> (B, h * w, C) tokens, row-major (Diffusers' `_pack_latents`)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def grid_from_tokens(tokens: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `tokens_from_grid`: (B, rows * cols, C) -> (B, C, rows, cols). Diffusers scatters the
    tokens by their ids (`_unpack_latents_with_ids`); for the row-major ids they carry that is this."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, rows, cols)


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """BFL's schedule shift for FLUX.2 (Diffusers' `compute_empirical_mu`): linear in the token count, fitted
    at 10 and 200 steps and interpolated in the step count below 4300 tokens; above, the 200-step line."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    mu_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return float(mu_200)
    mu_10 = a1 * image_seq_len + b1
    slope = (mu_200 - mu_10) / 190.0
    intercept = mu_200 - 200.0 * slope
    return float(slope * num_steps + intercept)


class Flux2LatentPreparationStage(Stage):
    """Initial noise as (batch, tokens, in_channels) and the noisy grid's ids; the latent grid is
    `latent_size` latent pixels (two per token side)."""

    needs = ("generator", "prompt_embeds")
    sets = ("latents", "conditioning.image_ids", "latent_size")

    def __init__(self, in_channels: int, vae_scale_factor: int, device: torch.device, dtype: torch.dtype):
        self.in_channels = in_channels
        self.vae_scale_factor = vae_scale_factor
        self.device = device
        self.dtype = dtype

    def forward(self, req: Req) -> Req:
        p = req.params
        rows = p.height // (self.vae_scale_factor * 2)
        cols = p.width // (self.vae_scale_factor * 2)
        noise = initial_noise(req, (p.num_outputs_per_prompt, self.in_channels, rows, cols), self.dtype)
        req.latents = tokens_from_grid(noise).to(self.device)
        Flux2Conditioning.of(req).image_ids = flux2_grid_ids(rows, cols, 0, self.device)
        req.latent_size = LatentSize(2 * rows, 2 * cols)
        return req


class Flux2TimestepPreparationStage(TimestepPreparationStage):
    """Sigmas linspace(1, 1/n, n) shifted by `compute_empirical_mu(tokens, n)`; with `guidance_embeds`
    (FLUX.2-dev) the request's guidance scale, which the DiT embeds."""

    def shift_mu(self, image_seq_len: int, steps: int) -> float:
        return compute_empirical_mu(image_seq_len, steps)


class Flux2DecodingStage(Stage):
    """Tokens -> patchified grid -> `bn` denormalised -> unpatchified -> VAE decoder -> PIL images."""

    needs = ("latents", "latent_size")
    sets = ("outputs.images",)

    def __init__(self, vae: AutoencoderKLFlux2) -> None:
        self.vae = vae

    def vae_latents(self, tokens: torch.Tensor, req: Req) -> torch.Tensor:
        """The decoder's input (B, latent_channels, h, w) for (B, tokens, C) in the DiT's latent space."""
        grid = grid_from_tokens(tokens, req.latent_size.height // 2, req.latent_size.width // 2)
        return self.vae.unpatchify(self.vae.denormalize_latents(grid))

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, req: Req) -> list[Image.Image]:
        return tensor_to_pil(decode_split(self.vae, to_module(self.vae, self.vae_latents(tokens, req))))

    def forward(self, req: Req) -> Req:
        req.outputs.images = self.decode(req.latents, req)
        return req
