"""Wan 2.1 / 2.2 DiT: the original Wan names (as Wan-AI's, Comfy-Org's, Kijai's and city96's files use
them) to Diffusers' `WanTransformer3DModel` names.

Pure renames, applied in order as substring replacements: the attentions become `attn1` / `attn2`
with `to_q`... projections, the image-conditioning projections of the I2V models `add_k_proj` /
`add_v_proj`, the modulation tables `scale_shift_table`, and the block norms `norm2` and `norm3` trade
places (the original's `norm3` is the cross-attention norm, Diffusers' `norm2`).
"""

from __future__ import annotations

from diffserve.loader.single_file_keys.plan import KeyPlan, Shapes, renamed_plan

_RENAMES: tuple[tuple[str, str], ...] = (
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("self_attn", "attn1"),
    ("cross_attn", "attn2"),
    (".q.", ".to_q."),
    (".k.", ".to_k."),
    (".v.", ".to_v."),
    (".o.", ".to_out.0."),
    (".k_img.", ".add_k_proj."),
    (".v_img.", ".add_v_proj."),
    (".norm_k_img.", ".norm_added_k."),
    ("head.modulation", "scale_shift_table"),
    ("head.head", "proj_out"),
    ("modulation", "scale_shift_table"),
    ("ffn.0", "ffn.net.0.proj"),
    ("ffn.2", "ffn.net.2"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
    # after the norm swap, which must not touch the image embedder's norm2
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
    ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
)


def wan_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of an original-named Wan file with tensors `shapes`."""
    del model_keys
    return renamed_plan(shapes, _RENAMES)
