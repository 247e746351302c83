"""Wan's LoRA-able Linears: the original Wan checkpoint names that `diffusion_model.` files
(ComfyUI, lightx2v) and musubi-tuner's kohya files (`lora_unet_blocks_0_self_attn_q`) use, renamed to
Diffusers' as `_convert_non_diffusers_wan_lora_to_diffusers` / `_convert_musubi_wan_lora_to_diffusers`
do, plus Diffusers' own names."""

from __future__ import annotations

from diffserve.loader.lora_formats.module_rules import ModuleRule, renamed, same

_BLOCK = "blocks.{n}"
_ATTENTION = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))
_IMAGE_KV = (("k_img", "add_k_proj"), ("v_img", "add_v_proj"))

WAN_RULES: list[ModuleRule] = [
    *(renamed(f"{_BLOCK}.self_attn.{o}", f"{_BLOCK}.attn1.{d}") for o, d in _ATTENTION),
    *(renamed(f"{_BLOCK}.cross_attn.{o}", f"{_BLOCK}.attn2.{d}") for o, d in (*_ATTENTION, *_IMAGE_KV)),
    renamed(f"{_BLOCK}.ffn.0", f"{_BLOCK}.ffn.net.0.proj"),
    renamed(f"{_BLOCK}.ffn.2", f"{_BLOCK}.ffn.net.2"),
    renamed("time_projection.1", "condition_embedder.time_proj"),
    renamed("head.head", "proj_out"),
    renamed("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    renamed("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    renamed("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    renamed("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    renamed("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    renamed("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    *same(
        *(f"{_BLOCK}.attn1.{d}" for _, d in _ATTENTION),
        *(f"{_BLOCK}.attn2.{d}" for _, d in (*_ATTENTION, *_IMAGE_KV)),
        f"{_BLOCK}.ffn.net.0.proj",
        f"{_BLOCK}.ffn.net.2",
        "condition_embedder.time_proj",
        "condition_embedder.text_embedder.linear_1",
        "condition_embedder.text_embedder.linear_2",
        "condition_embedder.time_embedder.linear_1",
        "condition_embedder.time_embedder.linear_2",
        "condition_embedder.image_embedder.ff.net.0.proj",
        "condition_embedder.image_embedder.ff.net.2",
        "proj_out",
    ),
]
