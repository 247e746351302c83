"""What a LongCat-Image request carries beyond `Req`: the position ids its RoPE reads, and an edit's input
image (`ReferenceImages`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffserve.request import Conditioning
from diffserve.stages.reference_images import ReferenceImages


@dataclass
class LongCatImageConditioning(Conditioning):
    """The position ids, (tokens, 3) float32 on the latents' device, shared by every row of the request: a
    function of the latent grid alone (every prompt is `tokenizer_max_length` tokens)."""

    #: (text tokens, 3): (0, i, i) for text token i (set by `LongCatTextEncodingStage`).
    text_ids: torch.Tensor | None = None
    #: (packed tokens, 3): (1, text + row, text + col) over the packed grid (set by
    #: `LongCatLatentPreparationStage`).
    image_ids: torch.Tensor | None = None


@dataclass
class LongCatImageEditConditioning(ReferenceImages, LongCatImageConditioning):
    """LongCat-Image-Edit's: the position ids (the image's then the input image's), and the input image as
    `ReferenceImages` (set by `LongCatEditPreparationStage`)."""
