"""Qwen-Image 2.1 DiT: its single files (ComfyUI's) to Diffusers' `QwenImage21Transformer2DModel` names.

The files use Diffusers' names but for the blocks' SwiGLU, whose gate and up projections ComfyUI fuses into
one `img_mlp.gate_up` (gate rows first): it splits into `gate_layer` and `proj`, as Diffusers'
`convert_qwen_image21_transformer_checkpoint_to_diffusers` does. Diffusers-name files pass as they are.
"""

from __future__ import annotations

from diffserve.loader.single_file_keys.plan import KeyPlan, Piece, Shapes, add_row_split

_FUSED = ".img_mlp.gate_up.weight"


def qwen_image21_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of a Qwen-Image 2.1 file with tensors `shapes` (`model_keys` are not needed)."""
    del model_keys
    plan: KeyPlan = {}
    for name in shapes:
        if name.endswith(_FUSED):
            module = name[: -len(".gate_up.weight")]
            add_row_split(plan, shapes, [f"{module}.gate_layer", f"{module}.proj"], f"{module}.gate_up")
        else:
            plan[name] = Piece(name)
    return plan
