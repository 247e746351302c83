"""Z-Image's LoRA-able Linears, for kohya (`lora_unet_layers_0_attention_to_q`) and `diffusion_model.`
files, as Diffusers' `_convert_non_diffusers_z_image_lora_to_diffusers` maps them.

Besides Diffusers' own names, files written over Z-Image's original module tree use `attention.qkv`
(one fused projection: the up factor's rows are q, k, v in equal thirds, the down factor is shared)
and `attention.out` (Diffusers' `attention.to_out.0`); some trainers write `attention.to.q` with a dot.
Those three are aliases (`ModuleRule.alias`): next to Diffusers-named keys of the same modules, which
some trainers write side by side with them, they are ignored, as Diffusers ignores them.
"""

from __future__ import annotations

from diffserve.loader.lora_formats.module_rules import ModuleRule, renamed, same, split

_REFINED_BLOCKS = ("layers.{n}", "noise_refiner.{n}", "context_refiner.{n}", "siglip_refiner.{n}")
_MODULATED_BLOCKS = ("layers.{n}", "noise_refiner.{n}")
_PROJECTIONS = ("to_q", "to_k", "to_v")


def _block_rules(block: str) -> list[ModuleRule]:
    attention = f"{block}.attention"
    return [
        *same(*(f"{attention}.{name}" for name in (*_PROJECTIONS, "to_out.0"))),
        *same(*(f"{block}.feed_forward.{name}" for name in ("w1", "w2", "w3"))),
        split(f"{attention}.qkv", *(f"{attention}.{name}" for name in _PROJECTIONS), alias=True),
        renamed(f"{attention}.out", f"{attention}.to_out.0", alias=True),
        *(renamed(f"{attention}.to.{name[-1]}", f"{attention}.{name}", alias=True) for name in _PROJECTIONS),
    ]


Z_IMAGE_RULES: list[ModuleRule] = [
    *(rule for block in _REFINED_BLOCKS for rule in _block_rules(block)),
    *same(*(f"{block}.adaLN_modulation.0" for block in _MODULATED_BLOCKS)),
    *same(
        "all_x_embedder.{p}",
        "all_final_layer.{p}.linear",
        "all_final_layer.{p}.adaLN_modulation.1",
        "cap_embedder.1",
        "siglip_embedder.1",
        "t_embedder.mlp.0",
        "t_embedder.mlp.2",
    ),
]
