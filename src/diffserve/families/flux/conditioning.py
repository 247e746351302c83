"""What a FLUX.1 request carries beyond `Req`: `FluxConditioning`, the position ids every FLUX.1 request's
RoPE reads, and its variants' additions: Fill's channel condition (`FluxFillConditioning`), and Kontext's
input image (`FluxKontextConditioning`, with `stages/reference_images.ReferenceImages`, the conditioning
every family that appends input-image tokens shares)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from diffserve.request import Conditioning
from diffserve.stages.reference_images import ReferenceImages

if TYPE_CHECKING:
    from diffserve.families.flux.controlnet import FluxControls


@dataclass
class FluxConditioning(Conditioning):
    """FLUX.1's position ids, (tokens, 3) on the latents' device: a function of the text length and of the
    latent grid, shared by every row of the request (`FluxDenoiser.rope_for` builds RoPE tables from them)."""

    #: (text tokens, 3) zeros (set by `FluxTextEncodingStage`).
    text_ids: torch.Tensor | None = None
    #: (packed tokens, 3) ids (0, row, col) of the packed latent grid (set by `FluxLatentPreparationStage`).
    image_ids: torch.Tensor | None = None
    #: The request's ControlNet entries, encoded (set by `ControlImageEncodingStage`; None without any).
    controls: FluxControls | None = None


@dataclass
class FluxFillConditioning(FluxConditioning):
    """Set by `FluxFillPreparationStage`."""

    #: Per image token, the masked input image's packed latents and the packed mask pixels
    #: (batch, tokens, channels), appended to the noisy tokens' channels (not to the token sequence).
    channel_condition: torch.Tensor | None = None


@dataclass
class FluxKontextConditioning(ReferenceImages, FluxConditioning):
    """FLUX.1 Kontext's: the position ids, and its input image as `ReferenceImages` (set by
    `FluxKontextPreparationStage`)."""
