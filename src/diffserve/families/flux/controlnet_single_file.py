"""XLabs' original single-file FLUX.1 ControlNets (their canny / depth / HED `.safetensors`, x-flux's
`ControlNetFlux`) as the layout `--controlnet NAME=FILE` reads (`loader/controlnet_single_file.py`).

Such a file is a short FLUX.1 DiT in Black Forest Labs' names (`img_in`, `txt_in`, `time_in`, `vector_in`,
optional `guidance_in`, `double_blocks.N`; no single blocks, no output head) plus XLabs' own parts:
`controlnet_blocks.N` (the residual heads, named as in Diffusers), `pos_embed_input` (Diffusers'
`controlnet_x_embedder`) and `input_hint_block`, an `nn.Sequential` of eight 3x3 convs with a SiLU after
each but the last, so the convs sit at the even indices 0..14: 0 is the hint encoder's `conv_in`, 2..12 its
`blocks.0`..`blocks.5`, 14 its `conv_out` (`models/controlnets/hint_encoder.py`). The DiT part maps as a
BFL single file does (`loader/single_file_keys/bfl.py`: `qkv` split into q, k, v), so the ControlNet loads
as the `FluxControlNetModel` that XLabs' Diffusers-layout folders load as, with the same weights.

The file tells the block counts, whether guidance is embedded and the hint encoder's output channels;
the widths a ControlNet must share with the DiT it feeds (heads, head size, latent channels, text and
pooled widths, RoPE axes) come from the base model's DiT config, and the shape check then refuses a
ControlNet trained for another DiT, naming the tensor.
"""

from __future__ import annotations

import math
from typing import Any

from diffserve.loader.controlnet_single_file import ControlNetFileLayout
from diffserve.loader.single_file_keys.bfl import bfl_plan
from diffserve.loader.single_file_keys.plan import KeyPlan, Shapes, add_param_pair, layer_indices
from diffserve.models.controlnets.flux import FluxControlNetModel

_HINT = "input_hint_block"
#: x-flux's `input_hint_block` Sequential index of each conv -> its module in `ControlHintEncoder`.
_HINT_CONVS: dict[int, str] = {0: "conv_in", **{2 * k + 2: f"blocks.{k}" for k in range(6)}, 14: "conv_out"}
_HINT_OUT = f"{_HINT}.14.weight"


def xlabs_controlnet_config(shapes: Shapes, pipeline: Any) -> dict[str, Any]:
    """The `FluxControlNetModel` config of an XLabs file with tensors `shapes`, for `pipeline`'s DiT.

    ValueError when the file lacks the hint encoder's last conv, or its channels times a square patch do
    not make the DiT's `in_channels` (the hint is packed into the latents' tokens)."""
    dit = pipeline.context.get("transformer").config
    if _HINT_OUT not in shapes:
        raise ValueError(f"missing key {_HINT_OUT!r} (the hint encoder's last conv, which sets its channels)")
    channels = shapes[_HINT_OUT][0]
    patch = math.isqrt(dit.in_channels // channels) if 0 < channels <= dit.in_channels else 0
    if patch == 0 or channels * patch * patch != dit.in_channels:
        raise ValueError(
            f"{_HINT_OUT!r} has {channels} output channels; packed into square patches they must make the "
            f"DiT's {dit.in_channels} input channels"
        )
    doubles = layer_indices(shapes, "double_blocks.")
    singles = layer_indices(shapes, "single_blocks.")
    return {
        "patch_size": patch,
        "in_channels": dit.in_channels,
        "num_layers": doubles[-1] + 1 if doubles else 0,
        "num_single_layers": singles[-1] + 1 if singles else 0,
        "attention_head_dim": dit.attention_head_dim,
        "num_attention_heads": dit.num_attention_heads,
        "joint_attention_dim": dit.joint_attention_dim,
        "pooled_projection_dim": dit.pooled_projection_dim,
        "guidance_embeds": "guidance_in.in_layer.weight" in shapes,
        "axes_dims_rope": list(dit.axes_dims_rope),
        "conditioning_embedding_channels": channels,
    }


def xlabs_controlnet_plan(shapes: Shapes, model_keys: frozenset[str]) -> KeyPlan:
    """Diffusers `FluxControlNetModel` name -> its piece of an XLabs file: the BFL DiT part as
    `bfl_plan` maps it, then XLabs' parts; every hint conv and residual head is planned, so one the file
    lacks is reported missing by name."""
    plan = bfl_plan(shapes, model_keys)
    for index, module in _HINT_CONVS.items():
        add_param_pair(plan, f"{_HINT}.{module}", f"{_HINT}.{index}")
    add_param_pair(plan, "controlnet_x_embedder", "pos_embed_input")
    heads = {*layer_indices(shapes, "double_blocks."), *layer_indices(shapes, "controlnet_blocks.")}
    for index in sorted(heads):
        add_param_pair(plan, f"controlnet_blocks.{index}", f"controlnet_blocks.{index}")
    return plan


#: The layout `FluxPipeline.controlnet_file_layouts` lists.
XLABS_FLUX_CONTROLNET = ControlNetFileLayout(
    label="XLabs FLUX.1 ControlNet",
    class_name=FluxControlNetModel.diffusers_class_name,
    markers=(f"{_HINT}.0.weight", "double_blocks.0.img_attn.qkv.weight"),
    config=xlabs_controlnet_config,
    plan=xlabs_controlnet_plan,
)
