"""`WanConditioning`: what a Wan request carries beyond `Req` when it starts from an input image."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.request import Conditioning, role


@dataclass
class WanConditioning(Conditioning):
    """Empty for text-to-video. Requests in one DiT batch need equal shapes of both (they are batched)."""

    #: Image-to-video: the first-frame mask and the input clip's VAE latents, concatenated with the noisy
    #: latents on channels (Wan 2.1 I2V, Wan 2.2 A14B I2V); TI2V (`expand_timesteps`): the image's
    #: latents (batch, channels, 1, h, w) in place of the first latent frame.
    condition_latents: torch.Tensor | None = field(default=None, metadata=role(batch="shape"))
    #: Wan 2.1 I2V: the input image's CLIP vision states (batch, tokens, dim), cross-attended by the DiT.
    image_embeds: torch.Tensor | None = field(default=None, metadata=role(batch="shape"))
