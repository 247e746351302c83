"""`HunyuanVideoConditioning`: what a HunyuanVideo request carries beyond `Req`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.request import Conditioning, role


@dataclass
class HunyuanVideoConditioning(Conditioning):
    """Set by `HunyuanVideoTextEncodingStage`. (CLIP's pooled text is `Req.pooled_prompt_embeds`.)"""

    #: (outputs, text tokens) bool: the Llama attention mask of the prompt after the template crop (False
    #: on its padding), which the DiT reads as the count of valid tokens.
    text_mask: torch.Tensor | None = None
    #: The same for the negative prompt (true CFG).
    negative_text_mask: torch.Tensor | None = field(default=None, metadata=role(negative_of="text_mask"))


@dataclass
class HunyuanVideoImageConditioning(HunyuanVideoConditioning):
    """Image-to-video adds the input image's latents (`HunyuanVideoImageLatentsStage`), float32: for
    "token_replace" the first latent frame (outputs, C, 1, h, w) that replaces the latents' first frame in
    every DiT input; for "latent_concat" (outputs, C + 1, F, h, w), the image's latent frame (then zeros)
    and a mask of ones on the first frame, concatenated to the latents on channels."""

    image_latents: torch.Tensor | None = None
