"""CogVideoX's own stages, as Diffusers' CogVideoX pipelines do each job.

- Text: T5's last hidden states of the prompt padded (and truncated) to `max_sequence_length` tokens, the
  padding included: Diffusers passes T5 no attention mask, so the padding's states are part of the text.
- Latents: noise drawn in Diffusers' layout (batch, latent frames, channels, h, w) in the model's dtype on the
  request's CPU generator, kept as (batch, channels, frames, h, w). CogVideoX 1.5 pads the latent frames to
  whole temporal patches (`padding_frames` more, as Diffusers adds `additional_frames`). Image-to-video first
  samples the input image's VAE posterior on the same generator (Diffusers' order), scales it by the VAE's
  `scaling_factor` (divides with `invert_scale_latents`) and follows it with zero frames.
- Timesteps: the scheduler's integer timesteps; the host copy stays on the request's conditioning.
- Decoding: the padding frames dropped (the first ones, as Diffusers drops them), the latents divided by
  `scaling_factor`, the VAE's decode.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from diffserve.distributed.parallel_vae import decode_split
from diffserve.errors import InvalidRequestError
from diffserve.families.cogvideox.conditioning import CogVideoXConditioning
from diffserve.families.cogvideox.config import cogvideox_settings
from diffserve.request import LatentSize, Req
from diffserve.stages.base import Stage, to_module
from diffserve.stages.decoding import DecodeLayout
from diffserve.stages.image_tensor import image_to_tensor
from diffserve.stages.input_validation import InputValidationStage
from diffserve.stages.text_encoding import SequenceTextEncodingStage, tokenize
from diffserve.stages.timestep_preparation import set_schedule
from diffserve.stages.video_vae_decoding import video_to_uint8


class CogVideoXInputValidationStage(InputValidationStage):
    """The shared validation, plus CogVideoX's `extra` settings and the sizes the DiT's positions allow, each
    refused here with a clear message where Diffusers' DiT fails deep in its forward (and the native DiT
    would too, after the request had been queued):

    - `exact_text_length`: a DiT that adds positions over its text slots (sin-cos or learned) takes a text
      length of exactly `max_text_seq_length`.
    - `exact_size`: a DiT with learned positions (CogVideoX 1.0-5B-I2V) has them for its sample size only,
      (height, width) in pixels.
    - `max_size`: CogVideoX 1.5's rotary positions cover the sample size's patch grid (no crop or resize of
      the grid, as 1.0's), so height and width are at most these pixels.
    """

    takes_family_settings = True

    def __init__(
        self,
        *args,
        exact_text_length: int | None,
        exact_size: tuple[int, int] | None = None,
        max_size: tuple[int, int] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.exact_text_length = exact_text_length
        self.exact_size = exact_size
        self.max_size = max_size

    def resolve(self, params):
        resolved = super().resolve(params)
        cogvideox_settings(resolved)  # raises on unknown keys or bad values
        n = self.exact_text_length
        if n is not None and resolved.max_sequence_length != n:
            raise InvalidRequestError(
                f"max_sequence_length must be {n} for this model: its DiT adds positions over exactly {n} text "
                f"tokens; got {resolved.max_sequence_length}",
                param="max_sequence_length",
            )
        self.check_size(resolved.height, resolved.width)
        return resolved

    def probe_size(self) -> tuple[int, int] | None:
        """The one size a DiT with learned positions makes: the server's probes ask for it."""
        return self.exact_size

    def check_size(self, height: int, width: int) -> None:
        """InvalidRequestError (naming height or width) for a size the DiT's positions do not cover."""
        if self.exact_size is not None and (height, width) != self.exact_size:
            want_h, want_w = self.exact_size
            raise InvalidRequestError(
                f"this model makes {want_h}x{want_w} (height x width) videos only: its DiT has learned "
                f"positions for that size; got {height}x{width} (leave height and width unset)",
                param="height" if height != want_h else "width",
            )
        if self.max_size is not None:
            for name, value, most in zip(("height", "width"), (height, width), self.max_size, strict=True):
                if value > most:
                    raise InvalidRequestError(
                        f"{name} must be at most {most} for this model: its DiT's rotary positions cover "
                        f"{self.max_size[0]}x{self.max_size[1]} (height x width) pixels; got {value}",
                        param=name,
                    )


class CogVideoXTextEncodingStage(SequenceTextEncodingStage):
    @torch.inference_mode()
    def encode(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """(len(prompts), max_sequence_length, dim): T5's states of the padded tokens, no attention mask."""
        device = next(self.text_encoder.parameters()).device
        ids = tokenize(self.tokenizer, prompts, max_sequence_length, device)
        return self.text_encoder(ids)[0].to(self.output_dtype)


def to_diffusers_layout(latents: torch.Tensor) -> torch.Tensor:
    """(batch, channels, frames, h, w) -> Diffusers' (batch, frames, channels, h, w), and back (the same swap)."""
    return latents.transpose(1, 2)


def padding_frames(latent_frames: int, patch_size_t: int | None) -> int:
    """CogVideoX 1.5: latent frames to add so `latent_frames` divides into temporal patches."""
    if patch_size_t is None or latent_frames % patch_size_t == 0:
        return 0
    return patch_size_t - latent_frames % patch_size_t


class CogVideoXLatentPreparationStage(Stage):
    """Initial noise, (batch, channels, frames, h, w), drawn as Diffusers draws it (see the module docstring);
    image-to-video (`vae` given) the input image's latents first."""

    needs = ("generator", "prompt_embeds")
    sets: tuple[str, ...] = ("latents", "latent_size", "conditioning.padding_frames")

    def __init__(
        self,
        channels: int,
        spatial: int,
        temporal: int,
        patch_size_t: int | None,
        device: torch.device,
        dtype: torch.dtype,
        vae: nn.Module | None = None,
    ) -> None:
        self.channels, self.spatial, self.temporal = channels, spatial, temporal
        self.patch_size_t = patch_size_t
        self.device, self.dtype = device, dtype
        self.vae = vae
        if vae is not None:
            self.sets = (*self.sets, "conditioning.image_latents")

    @torch.inference_mode()
    def image_latents(self, req: Req, frames: int) -> torch.Tensor:
        """(batch, frames, channels, h, w): the image's sampled, scaled latents, then zero frames."""
        p = req.params
        image = p.input_images[0]
        pixels = image_to_tensor(image.resize((p.width, p.height), Image.Resampling.LANCZOS)).unsqueeze(2)
        pixels = to_module(self.vae, pixels.to(self.dtype))
        first = self.vae.encode(pixels).sample(req.generator).to(self.dtype)
        first = to_diffusers_layout(first)
        factor = float(self.vae.config["scaling_factor"])
        first = (1 / factor) * first if self.vae.config["invert_scale_latents"] else factor * first
        zeros = first.new_zeros(1, frames - 1, *first.shape[2:])
        return torch.cat([first, zeros], dim=1).repeat(p.num_outputs_per_prompt, 1, 1, 1, 1)

    def forward(self, req: Req) -> Req:
        p = req.params
        frames = (p.num_frames - 1) // self.temporal + 1
        extra = padding_frames(frames, self.patch_size_t)
        frames += extra
        h, w = p.height // self.spatial, p.width // self.spatial
        conditioning = CogVideoXConditioning.of(req)
        conditioning.padding_frames = extra
        if self.vae is not None:
            conditioning.image_latents = self.image_latents(req, frames).to(self.device)
        shape = (p.num_outputs_per_prompt, frames, self.channels, h, w)
        noise = torch.randn(shape, generator=req.generator, device="cpu", dtype=self.dtype)
        req.latents = to_diffusers_layout(noise).contiguous().to(self.device)
        req.latent_size = LatentSize(h, w)
        return req


class CogVideoXTimestepPreparationStage(Stage):
    needs = ("latents",)
    sets = ("schedule", "conditioning.host_timesteps")

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def forward(self, req: Req) -> Req:
        steps = req.params.num_inference_steps
        set_schedule(req, self.scheduler.schedule(steps))
        CogVideoXConditioning.of(req).host_timesteps = self.scheduler.timesteps(steps).tolist()
        return req


class CogVideoXDecodingStage(Stage):
    """(batch, channels, frames, h, w) latents -> one uint8 (frames, H, W, 3) array per output video."""

    needs = ("latents",)
    sets = ("outputs.frames",)

    def __init__(self, vae: nn.Module) -> None:
        self.vae = vae

    def decode_layout(self) -> DecodeLayout:
        raise NotImplementedError(
            "CogVideoX's previews are its pipeline's own (`preview_images`: the sampler's predicted clean "
            "sample, not a flow step back)"
        )

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        latents = req.latents[:, :, CogVideoXConditioning.of(req).padding_frames :]
        latents = (1 / float(self.vae.config["scaling_factor"])) * to_module(self.vae, latents)
        req.outputs.frames = video_to_uint8(decode_split(self.vae, latents))
        return req
