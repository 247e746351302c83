"""HunyuanVideo's LoRA check: files in the original checkpoint's names (`double_blocks.<n>.img_attn_qkv`,
`single_blocks.<n>.linear1`, under `diffusion_model.`, `transformer.` or no prefix: diffusion-pipe,
musubi-tuner's converted files) are refused with that reason, rather than as files of another family.

Diffusers converts them (`_convert_hunyuan_video_lora_to_diffusers`); diffserve does not yet: the single
blocks' fused `linear1` splits into q, k, v (the width each) and the MLP (the rest), which the equal-part
module rules cannot express, and Diffusers' converter fixes that width at 3072 (the published DiT's).
Diffusers/PEFT-format files (`transformer_blocks.<n>.attn.to_q`) load as for every family.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from diffserve.errors import LoraError
from diffserve.loader.lora_formats.pairs import describe

#: Diffusers reads a file as original-format when a key names `img_attn_qkv`; the other original block
#: names mark such a file too.
_ORIGINAL = re.compile(r"(?:^|[._])(?:img_attn_qkv|txt_attn_qkv|double_blocks|single_blocks)(?:[._]|$)")


def refuse_original_names(state_dict: Mapping[str, torch.Tensor]) -> None:
    """`LoraFacts.community` of HunyuanVideo: a LoraError for an original-format file; None otherwise
    (the generic converters then read the file)."""
    original = sorted(key for key in state_dict if _ORIGINAL.search(key))
    if original:
        raise LoraError(
            "HunyuanVideo LoRA files in the original checkpoint's names (double_blocks / single_blocks, "
            f"which Diffusers converts) are not supported yet: {describe(original)}; use a Diffusers/PEFT-"
            "format file (transformer.transformer_blocks.<n>.attn.to_q.lora_A.weight ...)"
        )
    return None
