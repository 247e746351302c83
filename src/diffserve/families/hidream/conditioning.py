"""`HiDreamConditioning`: what a HiDream-I1 request carries beyond `Req`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.request import Conditioning, role


@dataclass
class HiDreamConditioning(Conditioning):
    """Set by `HiDreamTextEncodingStage` (the T5 states are `Req.prompt_embeds`, the pooled CLIP
    embeddings `Req.pooled_prompt_embeds`)."""

    #: (Llama layers, outputs, tokens, width): the Llama encoder's hidden states after every layer, the
    #: DiT's per-block text (it picks the layers its `llama_layers` name).
    llama_states: torch.Tensor | None = None
    #: The same for the negative prompt (CFG).
    negative_llama_states: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="llama_states")
    )
