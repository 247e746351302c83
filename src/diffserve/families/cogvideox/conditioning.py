"""`CogVideoXConditioning`: what a CogVideoX request carries beyond `Req`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.request import Conditioning, role


@dataclass
class CogVideoXConditioning(Conditioning):
    #: The request's timesteps as host integers: the schedulers' steps read them without touching a tensor.
    host_timesteps: list[int] | None = None
    #: CogVideoX 1.5: latent frames added in front so the frame count divides the temporal patch; dropped
    #: before decoding (as Diffusers drops the first ones).
    padding_frames: int = field(default=0, metadata=role(batch="value"))
    #: Image-to-video: the input image's scaled VAE latents then zero frames, (batch, frames, channels, h, w)
    #: in Diffusers' layout, concatenated with the noisy latents on channels at every step.
    image_latents: torch.Tensor | None = field(default=None, metadata=role(batch="shape"))
