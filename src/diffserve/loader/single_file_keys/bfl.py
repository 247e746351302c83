"""Black Forest Labs' original DiT names (as BFL, ComfyUI, Kijai and city96's GGUF files use them) to
Diffusers' names, for the DiTs built on FLUX.1's blocks: FLUX.1's `FluxTransformer2DModel` and Chroma's
(whose family adds its guidance approximator's names, `families/chroma/single_file_keys.py`).

The Linear modules map as in `loader/bfl_names.py` (shared with FLUX LoRAs): `qkv` splits into equal
thirds, a single block's `linear1` into q, k, v (hidden-size rows each) and the MLP (the rest), and the
final AdaLN's (shift, scale) rows swap to (scale, shift). The sizes come from the file's shapes, so any
width loads (Diffusers' converters assume FLUX.1's 3072). The QK RMSNorms are named `.scale`.
"""

from __future__ import annotations

from diffserve.loader.bfl_names import Split, bfl_target
from diffserve.loader.single_file_keys.plan import KeyPlan, Piece, Shapes, add_row_split

_NORMS = {
    "img_attn.norm.query_norm": "attn.norm_q",
    "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q",
    "txt_attn.norm.key_norm": "attn.norm_added_k",
    "norm.query_norm": "attn.norm_q",  # single blocks
    "norm.key_norm": "attn.norm_k",
}


def bfl_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of a BFL-named file with tensors `shapes` (modules a DiT lacks are not in the file)."""
    del model_keys  # the file's shapes say everything
    plan: KeyPlan = {}
    modules = sorted({name.rsplit(".", 1)[0] for name in shapes})
    for module in modules:
        target = bfl_target(module)
        if target is not None:
            _add_linear(plan, shapes, module, target.paths, target.split, target.swap_halves)
            continue
        block, _, rest = module.partition(".")
        index, _, norm = rest.partition(".")
        if block in ("double_blocks", "single_blocks") and norm in _NORMS:
            prefix = "transformer_blocks" if block == "double_blocks" else "single_transformer_blocks"
            plan[f"{prefix}.{index}.{_NORMS[norm]}.weight"] = Piece(f"{module}.scale")
    return plan


def _add_linear(
    plan: KeyPlan, shapes: Shapes, module: str, paths: tuple[str, ...], split: Split, swap: bool
) -> None:
    if split is Split.NONE:
        for param in ("weight", "bias"):
            if f"{module}.{param}" in shapes:
                plan[f"{paths[0]}.{param}"] = Piece(f"{module}.{param}", swap_halves=swap)
        return
    sizes = None
    if split is Split.ATTN_MLP:
        rows, hidden = shapes.get(f"{module}.weight", (0, 0))[:2]
        sizes = [hidden, hidden, hidden, rows - 3 * hidden]
    add_row_split(plan, shapes, paths, module, sizes)
