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
