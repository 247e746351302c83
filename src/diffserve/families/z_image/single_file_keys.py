"""Z-Image DiT: the original Z-Image (Lumina-style NextDiT) names, as Tongyi-MAI's and Comfy-Org's
single files use them, to Diffusers' `ZImageTransformer2DModel` names.

Each attention's fused `qkv` splits into equal thirds, `out` becomes `to_out.0`, `q_norm` / `k_norm`
become `norm_q` / `norm_k`; the patch embedder and final layer live under Diffusers' per-patch-size
names (`all_x_embedder.2-1`), whose key the model itself gives. The original's `norm_final` is a
norm Diffusers' model does not have (its final layer normalises without weights): it is not loaded.
"""

from __future__ import annotations

from diffserve.loader.single_file_keys.plan import KeyPlan, Piece, Shapes, add_row_split

#: A tensor of the original checkpoints that no Diffusers module uses.
UNUSED = frozenset({"norm_final.weight"})


_RENAMES = (
    (".attention.out.", ".attention.to_out.0."),
    (".attention.q_norm.", ".attention.norm_q."),
    (".attention.k_norm.", ".attention.norm_k."),
)


def z_image_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of an original-named Z-Image file with tensors `shapes`; `model_keys` (the model's
    Diffusers names) give the per-patch-size prefix of the embedder and the final layer."""
    embedder = _patch_prefix(model_keys, "all_x_embedder.", default="all_x_embedder.2-1.")
    final = _patch_prefix(model_keys, "all_final_layer.", default="all_final_layer.2-1.")
    plan: KeyPlan = {}
    for name in shapes:
        if name in UNUSED:
            continue
        if name.endswith(".attention.qkv.weight"):
            module = name[: -len(".qkv.weight")]
            add_row_split(plan, shapes, [f"{module}.{p}" for p in ("to_q", "to_k", "to_v")], f"{module}.qkv")
            continue
        target = name
        if target.startswith("x_embedder."):
            target = embedder + target[len("x_embedder.") :]
        elif target.startswith("final_layer."):
            target = final + target[len("final_layer.") :]
        for old, new in _RENAMES:
            target = target.replace(old, new)
        plan[target] = Piece(name)
    return plan


def _patch_prefix(model_keys: frozenset[str], root: str, default: str) -> str:
    """`root` + the model's one patch-size key (`2-1.`); `default` if the model has none or several."""
    found = {key[: key.index(".", len(root)) + 1] for key in model_keys if key.startswith(root)}
    return found.pop() if len(found) == 1 else default
