"""`HunyuanImageConditioning`: what a HunyuanImage 2.1 request carries beyond `Req`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.families.hunyuan_image.guider import AdaptiveProjectedMixGuidance
from diffserve.request import Conditioning, role


@dataclass
class HunyuanImageConditioning(Conditioning):
    """The DiT reads fixed-length padded text with its mask: each text branch has the (batch, tokens) mask of
    its Qwen2.5-VL states (`Req.prompt_embeds`) and ByT5's states of the prompt's quoted text with their
    mask; the negative branch's are paired with the prompt's (`negative_of`), which is all CFG-parallel
    views need to split them. `guider` is the folder guider the request's prompt chose (set at
    validation; None: no guidance), `momentum` its APG momentum buffer, advanced with the request's steps."""

    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="prompt_embeds_mask")
    )
    prompt_embeds_2: torch.Tensor | None = None
    negative_prompt_embeds_2: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="prompt_embeds_2")
    )
    prompt_embeds_mask_2: torch.Tensor | None = None
    negative_prompt_embeds_mask_2: torch.Tensor | None = field(
        default=None, metadata=role(negative_of="prompt_embeds_mask_2")
    )
    guider: AdaptiveProjectedMixGuidance | None = None
    momentum: torch.Tensor | None = field(default=None, metadata=role(stepped=True))
