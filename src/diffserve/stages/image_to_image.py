"""Image-to-image: the input image's VAE latents, noised to the first step a request's `strength` keeps.

Diffusers' img2img and inpaint pipelines (FLUX, SD3, Z-Image, Qwen-Image) share one recipe, kept here:

1. the input image, resized to the output size (Lanczos), is VAE-encoded with a *sampled* posterior
   (`latent_dist.sample(generator)`): this is the request generator's first draw, before the initial noise;
2. the full schedule is computed as for text-to-image (FLUX: `mu` from the full output size), then its
   first `t_start = int(n - n * strength)` steps are dropped (`get_timesteps`);
3. the start latents are `sigma * noise + (1 - sigma) * image_latents` at the first kept sigma
   (`FlowMatchEulerDiscreteScheduler.scale_noise`), in the latents' dtype.

A request without an input image passes through these stages untouched (text-to-image is unchanged).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import InputLatents, Req, from_step
from diffserve.stages.base import Stage, to_module
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.video_vae_decoding import latent_stats

#: (batch, channels, h, w) VAE latents -> the layout the family's latents have (FLUX: packed tokens).
LatentLayout = Callable[[torch.Tensor], torch.Tensor]
#: (vae, (1, 3, H, W) pixels in [-1, 1], generator) -> the DiT's (1, channels, h, w) latents, sampled.
LatentEncoder = Callable[[nn.Module, torch.Tensor, torch.Generator], torch.Tensor]


def spatial_latents(latents: torch.Tensor) -> torch.Tensor:
    """The layout of families whose DiT patchifies (batch, channels, h, w) latents itself (SD3, Z-Image)."""
    return latents


def kept_steps(num_steps: int, strength: float) -> int:
    """Steps left of `num_steps` at `strength` (Diffusers' `get_timesteps`)."""
    return num_steps - first_kept_step(num_steps, strength)


def first_kept_step(num_steps: int, strength: float) -> int:
    """Index of the first step kept: `int(max(n - min(n * strength, n), 0))`, as Diffusers computes it."""
    return int(max(num_steps - min(num_steps * strength, num_steps), 0))


def input_image_size(
    params: SamplingParams, pixel_multiple: int, default: tuple[int, int]
) -> tuple[int, int]:
    """(height, width) when the request leaves them unset: the input image's, floored to `pixel_multiple`
    (an edit keeps its picture's size), else `default`."""
    if not params.input_images:
        return default
    width, height = params.input_images[0].size
    return (
        max(pixel_multiple, height // pixel_multiple * pixel_multiple),
        max(pixel_multiple, width // pixel_multiple * pixel_multiple),
    )


def resized_input(req: Req) -> Image.Image:
    """The request's input image at its output size (Diffusers' `VaeImageProcessor.resize`: Lanczos)."""
    p = req.params
    return p.input_images[0].resize((p.width, p.height), Image.Resampling.LANCZOS)


def encode_sampled(vae: nn.Module, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(1, 3, H, W) pixels in [-1, 1] -> scaled VAE latents drawn from the posterior with `generator`
    (Diffusers' `retrieve_latents` in sample mode), `(z - shift) * scale`."""
    scaling = float(vae.config["scaling_factor"])
    shift = float(vae.config.get("shift_factor") or 0.0)
    latents = vae.encode(to_module(vae, pixels)).sample(generator)
    return (latents - shift) * scaling


def encode_sampled_video_vae(
    vae: nn.Module, pixels: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """The same for a causal video VAE (Qwen-Image): the image as one frame, the latents normalised by
    the VAE's per-channel statistics as Diffusers does, `(z - mean) * (1 / std)`, the frame axis dropped."""
    latents = vae.encode(to_module(vae, pixels.unsqueeze(2))).sample(generator)
    mean, std = latent_stats(vae, latents.device, latents.dtype)
    return ((latents - mean) * (1.0 / std))[:, :, 0]


class InputImageEncodingStage(Stage):
    """Encodes the input image (step 1 above) into `input_latents` with `encode`, in the family's latent
    layout, one copy per output. Runs before latent preparation: its posterior draw comes first from the
    generator."""

    needs = ("generator",)

    def __init__(
        self,
        vae: nn.Module,
        layout: LatentLayout,
        device: torch.device,
        dtype: torch.dtype,
        encode: LatentEncoder = encode_sampled,
    ) -> None:
        self.vae = vae
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.encode = encode

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        if not req.params.input_images:
            return req
        latents = self.encode(self.vae, image_to_tensor(resized_input(req)), req.generator)
        latents = self.layout(latents.to(device=self.device, dtype=self.dtype))
        req.input_latents = InputLatents(latents.repeat(req.batch_size, *([1] * (latents.dim() - 1))))
        return req


def truncate_schedule(req: Req, start: int) -> None:
    """Drop the request's first `start` steps from every per-step table it carries: what its schedule
    and its conditioning declare `per_step` (the sigmas and timesteps, e.g. a DiT's own time axis)."""
    assert req.schedule is not None
    req.schedule = from_step(req.schedule, start)
    if req.conditioning is not None:
        req.conditioning = from_step(req.conditioning, start)


def noised(init_latents: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Flow matching's forward process at `sigma` (a 0-d tensor), in the latents' dtype (`scale_noise`)."""
    sigma = sigma.to(init_latents.dtype)
    return sigma * noise + (1.0 - sigma) * init_latents


class ImageToImageNoisingStage(Stage):
    """Steps 2 and 3 above, after timestep preparation: the schedule truncated by `strength`, and the
    start latents noised to its first sigma. The drawn noise is kept in `input_latents.noise` for
    inpainting."""

    needs = ("latents", "schedule")

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        source = req.input_latents
        if source is None:
            return req
        truncate_schedule(req, first_kept_step(req.num_steps, req.params.strength))
        source.noise = req.latents
        req.latents = noised(source.latents, source.noise, req.schedule.sigmas[0])
        return req
