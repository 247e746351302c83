"""What a Chroma request carries beyond `Req`: its position ids and its T5 padding masks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.request import Conditioning, role


@dataclass
class ChromaConditioning(Conditioning):
    """Set by `ChromaTextEncodingStage` (the text's) and `ChromaLatentPreparationStage` (the image's)."""

    #: (text tokens, 3) zeros: the text's RoPE positions.
    text_ids: torch.Tensor | None = None
    #: (packed tokens, 3) ids (0, row, col) of the packed latent grid.
    image_ids: torch.Tensor | None = None
    #: (outputs, text tokens) 0/1 in the activations' dtype: the prompt's tokens and one padding token
    #: kept, the rest of T5's padding masked (the DiT's `text_mask`).
    text_mask: torch.Tensor | None = None
    #: The same for the negative prompt (CFG).
    negative_text_mask: torch.Tensor | None = field(default=None, metadata=role(negative_of="text_mask"))
