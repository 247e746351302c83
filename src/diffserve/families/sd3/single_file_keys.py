"""Stable Diffusion 3 / 3.5 DiT: Stability AI's original MMDiT names (`joint_blocks.N.x_block...`, as
the released single files and ComfyUI use them) to Diffusers' `SD3Transformer2DModel` names.

Each attention's fused `qkv` splits into equal thirds; SD3.5's QK norms are `ln_q` / `ln_k`, its dual
attention layers `x_block.attn2`. The last block's context stream only modulates (no output projection,
no MLP) and, like the final layer, stores its AdaLN as (shift, scale): swapped to Diffusers' order.
"""

from __future__ import annotations

from diffserve.loader.single_file_keys.plan import (
    KeyPlan,
    Piece,
    Shapes,
    add_param_pair,
    add_row_split,
    layer_indices,
)

_QKV = ("to_q", "to_k", "to_v")
_ADDED_QKV = ("add_q_proj", "add_k_proj", "add_v_proj")


def sd3_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of an original-named SD3 file with tensors `shapes`."""
    del model_keys
    plan: KeyPlan = {"pos_embed.pos_embed": Piece("pos_embed")}
    add_param_pair(plan, "pos_embed.proj", "x_embedder.proj")
    add_param_pair(plan, "time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0")
    add_param_pair(plan, "time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2")
    add_param_pair(plan, "time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0")
    add_param_pair(plan, "time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2")
    add_param_pair(plan, "context_embedder", "context_embedder")
    add_param_pair(plan, "proj_out", "final_layer.linear")
    add_param_pair(plan, "norm_out.linear", "final_layer.adaLN_modulation.1", swap_halves=True)
    indices = layer_indices(shapes, "joint_blocks.")
    for i in indices:
        _add_block(plan, shapes, i, last=i == indices[-1])
    return plan


def _add_block(plan: KeyPlan, shapes: Shapes, i: int, last: bool) -> None:
    out, x, ctx = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
    add_row_split(plan, shapes, [out + "attn." + t for t in _QKV], x + "attn.qkv")
    add_row_split(plan, shapes, [out + "attn." + t for t in _ADDED_QKV], ctx + "attn.qkv")
    add_param_pair(plan, out + "attn.to_out.0", x + "attn.proj")
    add_param_pair(plan, out + "norm1.linear", x + "adaLN_modulation.1")
    add_param_pair(plan, out + "norm1_context.linear", ctx + "adaLN_modulation.1", swap_halves=last)
    add_param_pair(plan, out + "ff.net.0.proj", x + "mlp.fc1")
    add_param_pair(plan, out + "ff.net.2", x + "mlp.fc2")
    if not last:
        add_param_pair(plan, out + "attn.to_add_out", ctx + "attn.proj")
        add_param_pair(plan, out + "ff_context.net.0.proj", ctx + "mlp.fc1")
        add_param_pair(plan, out + "ff_context.net.2", ctx + "mlp.fc2")
    _add_qk_norms(plan, shapes, out + "attn.", x + "attn.", ("norm_q", "norm_k"))
    _add_qk_norms(plan, shapes, out + "attn.", ctx + "attn.", ("norm_added_q", "norm_added_k"))
    if f"{x}attn2.qkv.weight" in shapes:
        add_row_split(plan, shapes, [out + "attn2." + t for t in _QKV], x + "attn2.qkv")
        add_param_pair(plan, out + "attn2.to_out.0", x + "attn2.proj")
        _add_qk_norms(plan, shapes, out + "attn2.", x + "attn2.", ("norm_q", "norm_k"))


def _add_qk_norms(plan: KeyPlan, shapes: Shapes, target: str, source: str, names: tuple[str, str]) -> None:
    for norm, name in zip(("ln_q", "ln_k"), names, strict=True):
        if f"{source}{norm}.weight" in shapes:
            plan[f"{target}{name}.weight"] = Piece(f"{source}{norm}.weight")
