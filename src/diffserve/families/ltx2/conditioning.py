"""`LTX2Conditioning`: what an LTX-2 request carries beyond `Req`: its soundtrack's stream (the video
stream's are `Req.latents` and `Req.prompt_embeds`) and the text mask both streams attend with."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.request import Conditioning, role


@dataclass
class LTX2Conditioning(Conditioning):
    """Set by LTX-2's text encoding and latent preparation; the denoiser reads and steps it."""

    #: (batch, seq) mask of the text states per CFG branch, shared by the video and the audio stream.
    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="prompt_embeds_mask")
    )
    #: The audio stream's text states (batch, seq, dim) per CFG branch.
    audio_prompt_embeds: torch.Tensor | None = None
    negative_audio_prompt_embeds: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="audio_prompt_embeds")
    )
    #: The audio stream's packed latents (batch, tokens, channels), advanced by every denoising step as
    #: `Req.latents` is; requests in one DiT batch need equal audio lengths.
    audio_latents: torch.Tensor | None = field(default=None, metadata=role(stepped=True, batch="shape"))
