"""`HunyuanImageConditioning`: what a HunyuanImage 2.1 request carries beyond `Req`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffserve.families.hunyuan_image.guider import AdaptiveProjectedMixGuidance
from diffserve.request import role
from diffserve.stages.glyph_text_encoding import GlyphTextConditioning


@dataclass
class HunyuanImageConditioning(GlyphTextConditioning):
    """The DiT reads fixed-length padded text with its mask: each text branch has the (batch, tokens) mask of
    its Qwen2.5-VL states and ByT5's states of the prompt's quoted text with their mask
    (`GlyphTextConditioning`). `guider` is the folder guider the request's prompt chose (set at
    validation; None: no guidance), `momentum` its APG momentum buffer, advanced with the request's steps."""

    guider: AdaptiveProjectedMixGuidance | None = None
    momentum: torch.Tensor | None = field(default=None, metadata=role(stepped=True))
