"""LongCat-Image DiT: Black Forest Labs' FLUX.1 names, which ComfyUI's LongCat-Image support reads (the
Comfy-Org repackaged files, converted from Meituan's Diffusers-named release) and the community GGUFs use,
to Diffusers' `LongCatImageTransformer2DModel` names.

The DiT is FLUX.1's blocks, so its files are FLUX.1's layout (`loader/single_file_keys/bfl.py`: fused
`qkv` and `linear1` split by the file's shapes, the final AdaLN's halves swapped, `.scale` norms) without
`vector_in` / `guidance_in`; only the timestep MLP lands elsewhere: `time_in` is Diffusers'
`time_embed.timestep_embedder`, not FLUX.1's `time_text_embed.timestep_embedder`. Meituan's own files
use Diffusers' names and load as they are.
"""

from __future__ import annotations

from diffserve.loader.single_file_keys.bfl import bfl_plan
from diffserve.loader.single_file_keys.plan import KeyPlan, Shapes

_FLUX_TIME = "time_text_embed.timestep_embedder."
_LONGCAT_TIME = "time_embed.timestep_embedder."


def longcat_image_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of a BFL-named LongCat-Image file with tensors `shapes`."""
    plan = bfl_plan(shapes, model_keys)
    return {
        (_LONGCAT_TIME + target[len(_FLUX_TIME) :] if target.startswith(_FLUX_TIME) else target): piece
        for target, piece in plan.items()
    }
