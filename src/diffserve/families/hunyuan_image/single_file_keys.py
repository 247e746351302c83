"""HunyuanImage 2.1 DiT: Tencent's original names (the `dit/hunyuanimage2.1*.safetensors` files of
tencent/HunyuanImage-2.1, which ComfyUI loads as they are and Comfy-Org repackages, and GGUFs made from
them) to Diffusers' `HunyuanImageTransformer2DModel` names, as Diffusers'
`scripts/convert_hunyuan_image_to_diffusers.py` maps them.

The released files keep the blocks' projections apart (`img_attn_q` / `_k` / `_v`, `linear1_q` / `_k` / `_v`
/ `_mlp`, `linear2.fc`); Tencent's code also reads the fused HunyuanVideo layout (`img_attn_qkv`, a single
block's `linear1` = q, k, v of `hidden` rows each then the MLP rows, `linear2`), which splits here by rows.
The token refiner's `self_attn_qkv` is always fused (equal thirds). The final AdaLN stores (shift, scale)
where Diffusers stores (scale, shift): its halves swap. Names no rule knows pass through unchanged, so a
Diffusers-named tensor maps to itself and a foreign one is reported as unexpected.
"""

from __future__ import annotations

import re

from diffserve.loader.single_file_keys.plan import KeyPlan, Piece, Shapes, add_row_split

_GLOBAL = {
    "img_in.proj": "x_embedder.proj",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
    "byt5_in.layernorm": "context_embedder_2.norm",
    "byt5_in.fc1": "context_embedder_2.linear_1",
    "byt5_in.fc2": "context_embedder_2.linear_2",
    "byt5_in.fc3": "context_embedder_2.linear_3",
    "time_in.mlp.0": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_guidance_embed.timestep_embedder.linear_2",
    "time_r_in.mlp.0": "time_guidance_embed.timestep_embedder_r.linear_1",
    "time_r_in.mlp.2": "time_guidance_embed.timestep_embedder_r.linear_2",
    "guidance_in.mlp.0": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.mlp.2": "time_guidance_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
#: (shift, scale) in the file, (scale, shift) in Diffusers' `norm_out`.
_FINAL_ADALN = ("final_layer.adaLN_modulation.1", "norm_out.linear")

_DOUBLE = {
    "img_mod.linear": "norm1.linear",
    "txt_mod.linear": "norm1_context.linear",
    "img_attn_q": "attn.to_q",
    "img_attn_k": "attn.to_k",
    "img_attn_v": "attn.to_v",
    "img_attn_q_norm": "attn.norm_q",
    "img_attn_k_norm": "attn.norm_k",
    "img_attn_proj": "attn.to_out.0",
    "img_mlp.fc1": "ff.net.0.proj",
    "img_mlp.fc2": "ff.net.2",
    "txt_attn_q": "attn.add_q_proj",
    "txt_attn_k": "attn.add_k_proj",
    "txt_attn_v": "attn.add_v_proj",
    "txt_attn_q_norm": "attn.norm_added_q",
    "txt_attn_k_norm": "attn.norm_added_k",
    "txt_attn_proj": "attn.to_add_out",
    "txt_mlp.fc1": "ff_context.net.0.proj",
    "txt_mlp.fc2": "ff_context.net.2",
}
_DOUBLE_FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}

_SINGLE = {
    "modulation.linear": "norm.linear",
    "linear1_q": "attn.to_q",
    "linear1_k": "attn.to_k",
    "linear1_v": "attn.to_v",
    "linear1_mlp": "proj_mlp",
    "q_norm": "attn.norm_q",
    "k_norm": "attn.norm_k",
    "linear2.fc": "proj_out",
    "linear2": "proj_out",
}
_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")

_REFINER = {
    "norm1": "norm1",
    "norm2": "norm2",
    "self_attn_proj": "attn.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm_out.linear",
}
_REFINER_FUSED = {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}

#: Block containers: original prefix -> (Diffusers prefix, renames, fused modules split in equal parts).
_BLOCKS = {
    "double_blocks": ("transformer_blocks", _DOUBLE, _DOUBLE_FUSED),
    "single_blocks": ("single_transformer_blocks", _SINGLE, {}),
    "txt_in.individual_token_refiner.blocks": (
        "context_embedder.token_refiner.refiner_blocks",
        _REFINER,
        _REFINER_FUSED,
    ),
}
_BLOCK = re.compile(r"(double_blocks|single_blocks|txt_in\.individual_token_refiner\.blocks)\.(\d+)\.(.+)")


def hunyuan_image_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of a HunyuanImage 2.1 file in Tencent's names with tensors `shapes` (its shapes say
    every split; `model_keys` are not needed)."""
    del model_keys
    plan: KeyPlan = {}
    for name in shapes:
        module, _, param = name.rpartition(".")
        if module == _FINAL_ADALN[0]:
            plan[f"{_FINAL_ADALN[1]}.{param}"] = Piece(name, swap_halves=True)
        elif module in _GLOBAL:
            plan[f"{_GLOBAL[module]}.{param}"] = Piece(name)
        elif (block := _BLOCK.fullmatch(module)) is not None:
            _add_block_tensor(plan, shapes, name, block.groups(), param)
        else:
            plan[name] = Piece(name)
    return plan


def _add_block_tensor(plan: KeyPlan, shapes: Shapes, name: str, groups: tuple[str, ...], param: str) -> None:
    container, index, sub = groups
    target_prefix, renames, fused = _BLOCKS[container]
    target = f"{target_prefix}.{index}."
    source = f"{container}.{index}.{sub}"
    if sub in renames:
        plan[f"{target}{renames[sub]}.{param}"] = Piece(name)
    elif sub in fused:
        add_row_split(plan, shapes, [target + path for path in fused[sub]], source)
    elif container == "single_blocks" and sub == "linear1":
        # q, k, v of `hidden` rows each (the Linear's input width), then the MLP's rows.
        rows, hidden = shapes.get(f"{source}.weight", (0, 0))[:2]
        sizes = [hidden, hidden, hidden, rows - 3 * hidden]
        add_row_split(plan, shapes, [target + path for path in _SINGLE_FUSED], source, sizes)
    else:
        plan[name] = Piece(name)
