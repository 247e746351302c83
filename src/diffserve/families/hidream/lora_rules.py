"""HiDream-I1's LoRA check: adapters on the routed MoE experts (`ff_i.experts.<n>.w1|w2|w3`) are refused.

Diffusers applies them, but diffserve's per-request adapters add each row's term by batch row, and the
routed experts run on tokens gathered across the batch (`MoEFeedForward`), which carry no batch row.
Everything else Diffusers' `HiDreamImageLoraLoaderMixin` loads is applied: attention, adaLN, the shared
expert and the text stream's feed-forward. (Trainers commonly leave the routed experts out: Diffusers'
HiDream DreamBooth LoRA script defaults to the attention projections.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from diffserve.errors import LoraError
from diffserve.loader.lora_formats.pairs import describe

#: A routed expert's Linear, dotted (Diffusers, `diffusion_model.`) or kohya-flattened; not `shared_experts`.
_ROUTED_EXPERT = re.compile(r"(?:^|[._])ff_i[._]experts[._]\d+[._]")


def refuse_routed_experts(state_dict: Mapping[str, torch.Tensor]) -> None:
    """`LoraFacts.community` of HiDream: a LoraError naming the keys on routed experts; None otherwise
    (the generic converters then read the file)."""
    routed = sorted(key for key in state_dict if _ROUTED_EXPERT.search(key))
    if routed:
        raise LoraError(
            f"LoRA on HiDream's routed MoE experts (ff_i.experts.<n>) is not supported yet (their tokens "
            f"are routed across the batch, which per-request adapters need by row): {describe(routed)}; "
            "train without them (attention, adaLN, shared experts and ff_t are supported)"
        )
    return None
