"""`MochiConditioning`: what a Mochi request carries beyond `Req`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.request import Conditioning, role


@dataclass
class MochiConditioning(Conditioning):
    """Set by `MochiTextEncodingStage`."""

    #: (outputs, text tokens) bool: T5's attention mask of the prompt (False on its padding), which the DiT
    #: leaves out of its attention and its text pool.
    text_mask: torch.Tensor | None = None
    #: The same for the negative prompt (CFG).
    negative_text_mask: torch.Tensor | None = field(default=None, metadata=role(negative_of="text_mask"))
