"""Qwen-Image 2.1's LoRA-able Linears, for kohya (`lora_unet_transformer_blocks_0_attn_to_q`) and
`diffusion_model.` files. Diffusers' `QwenImage21Pipeline` loads LoRAs with Qwen-Image's mixin
(`QwenImageLoraLoaderMixin`), whose `_convert_non_diffusers_qwen_lora_to_diffusers` strips either prefix
and splits kohya names with Qwen-Image's protected n-grams. Qwen-Image 2.1's original code already uses
Diffusers' module names, so every rule is an identity: the table is what lets an underscore-joined kohya
name be split back into its module path.

The table names every Linear, also the four whose kohya names Diffusers' n-grams (written for Qwen-Image)
split wrongly and so never reach a module there: `transformer_blocks_{n}_img_mlp_gate_layer`,
`txt_in_in_layer`, `txt_in_out_layer` and `modulation_1`; here they land on their modules.
"""

from __future__ import annotations

from diffserve.loader.lora_formats.module_rules import ModuleRule, same

_BLOCK = "transformer_blocks.{n}"

QWEN_IMAGE21_RULES: list[ModuleRule] = same(
    "img_in",
    "txt_in.in_layer",
    "txt_in.out_layer",
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "modulation.1",
    "norm_out.linear",
    "proj_out",
    *(f"{_BLOCK}.attn.{name}" for name in ("to_q", "to_k", "to_v", "to_out.0")),
    *(f"{_BLOCK}.img_mlp.{name}" for name in ("proj", "out", "gate_layer")),
)
