"""Qwen-Image's LoRA-able Linears, for kohya (`lora_unet_transformer_blocks_0_attn_to_q`) and
`diffusion_model.` files. Qwen-Image's original code already uses Diffusers' module names, so every
rule is an identity; the table is what lets an underscore-joined kohya name be split back into its
module path (Diffusers' `_convert_non_diffusers_qwen_lora_to_diffusers` does the same with protected
n-grams)."""

from __future__ import annotations

from diffserve.loader.lora_formats.module_rules import ModuleRule, same

_BLOCK = "transformer_blocks.{n}"

QWEN_IMAGE_RULES: list[ModuleRule] = same(
    "img_in",
    "txt_in",
    "proj_out",
    "norm_out.linear",
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    *(
        f"{_BLOCK}.attn.{name}"
        for name in (
            "to_q",
            "to_k",
            "to_v",
            "to_out.0",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_add_out",
        )
    ),
    *(f"{_BLOCK}.{stream}_mod.1" for stream in ("img", "txt")),
    *(f"{_BLOCK}.{stream}_mlp.{name}" for stream in ("img", "txt") for name in ("net.0.proj", "net.2")),
)
