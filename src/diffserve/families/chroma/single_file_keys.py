"""Chroma DiT: the original names (lodestones' and ComfyUI's files: FLUX.1's BFL names without the per-block
modulation, plus the distilled guidance approximator) to Diffusers' `ChromaTransformer2DModel` names.

The blocks, embedders and output Linear map as FLUX.1's (`loader/single_file_keys/bfl.py`: fused `qkv`
and `linear1` split by the file's shapes, so any width loads; Diffusers' converter assumes 3072). The
approximator's `layers.<i>.in_layer` / `out_layer` become `linear_1` / `linear_2` and its RMSNorms' `.scale`
`.weight`, as Diffusers' `convert_chroma_transformer_checkpoint_to_diffusers` names them.
"""

from __future__ import annotations

import re

from diffserve.loader.single_file_keys.bfl import bfl_plan
from diffserve.loader.single_file_keys.plan import KeyPlan, Piece, Shapes

_APPROXIMATOR = "distilled_guidance_layer."
_LAYER = re.compile(r"distilled_guidance_layer\.layers\.(\d+)\.(in_layer|out_layer)\.(weight|bias)")
_NORM = re.compile(r"distilled_guidance_layer\.norms\.(\d+)\.scale")
_LINEAR = {"in_layer": "linear_1", "out_layer": "linear_2"}


def chroma_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """The plan of an original-named Chroma file with tensors `shapes`."""
    plan = bfl_plan({k: v for k, v in shapes.items() if not k.startswith(_APPROXIMATOR)}, model_keys)
    for name in shapes:
        if not name.startswith(_APPROXIMATOR):
            continue
        if layer := _LAYER.fullmatch(name):
            index, linear, param = layer.groups()
            plan[f"{_APPROXIMATOR}layers.{index}.{_LINEAR[linear]}.{param}"] = Piece(name)
        elif norm := _NORM.fullmatch(name):
            plan[f"{_APPROXIMATOR}norms.{norm.group(1)}.weight"] = Piece(name)
        else:  # in_proj, out_proj: Diffusers' names
            plan[name] = Piece(name)
    return plan
