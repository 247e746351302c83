"""`Flux2Conditioning`: what a FLUX.2 request carries beyond `Req`: the position ids its RoPE reads, and its
optional reference images (`stages/reference_images.ReferenceImages`, whose tokens are appended to the
noisy ones)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffserve.stages.reference_images import ReferenceImages


@dataclass
class Flux2Conditioning(ReferenceImages):
    """FLUX.2's 4-axis (T, H, W, L) position ids, on the latents' device, shared by every row of the
    request; its reference images' own ids follow from `condition_shapes` (`Flux2Denoiser.rope_for`)."""

    #: (text tokens, 4) ids (0, 0, 0, l) (set by `Flux2TextEncodingStage`).
    text_ids: torch.Tensor | None = None
    #: (noisy tokens, 4) ids (0, row, col, 0) of the noisy grid (set by `Flux2LatentPreparationStage`).
    image_ids: torch.Tensor | None = None
