"""`FluxFillConditioning`: what a FLUX.1 Fill request carries beyond `Req`. (Kontext's input image is
`stages/reference_images.ReferenceImages`, the conditioning every family that appends input-image tokens
shares; plain FLUX.1 needs none.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffserve.request import Conditioning


@dataclass
class FluxFillConditioning(Conditioning):
    """Set by `FluxFillPreparationStage`."""

    #: Per image token, the masked input image's packed latents and the packed mask pixels
    #: (batch, tokens, channels), appended to the noisy tokens' channels (not to the token sequence).
    channel_condition: torch.Tensor | None = None
