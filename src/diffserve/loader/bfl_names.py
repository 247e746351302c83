"""FLUX.1's module names as its community LoRA formats and original single files write them, mapped to
Diffusers' module paths (outside the FLUX family's package: Chroma's single files use the BFL names too).

FLUX files name the transformer's Linears three ways: Black Forest Labs' original names
(`double_blocks.0.img_attn.qkv`, written with dots by BFL / ComfyUI files and with underscores by kohya
`lora_unet_` files), Diffusers' names with underscores (`lora_transformer_transformer_blocks_0_attn_to_q`,
ai-toolkit and OneTrainer), and XLabs' attention-processor names (`double_blocks.0.processor.qkv_lora1`).
The CLIP text encoder appears as kohya's `lora_te1_text_model_encoder_layers_0_self_attn_q_proj`.
Several original modules fuse projections that Diffusers keeps apart (`qkv` is to_q, to_k and to_v;
a single block's `linear1` is to_q, to_k, to_v and proj_mlp): a `FluxTarget` says how to split them.
Paths here are relative to the component; `flux.py` adds the component prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Split(Enum):
    """How a fused module's output rows divide among its Diffusers targets."""

    NONE = "none"  # one target, rows as they are
    EQUAL = "equal"  # q, k, v: equal thirds
    ATTN_MLP = "attn_mlp"  # single block linear1: q, k, v of in_features rows each, then the MLP rows


@dataclass(frozen=True)
class FluxTarget:
    """The Diffusers module(s) one file module lands on. `swap_halves` marks the final AdaLN
    modulation, whose output is (shift, scale) in BFL's layout and (scale, shift) in Diffusers'."""

    paths: tuple[str, ...]
    split: Split = Split.NONE
    swap_halves: bool = False


def _single(path: str, swap_halves: bool = False) -> FluxTarget:
    return FluxTarget((path,), Split.NONE, swap_halves)


_ATTN_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_ADDED_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")

# BFL double-block sub-module -> Diffusers FluxTransformerBlock sub-module(s).
_BFL_DOUBLE: dict[str, FluxTarget] = {
    "img_attn.qkv": FluxTarget(_ATTN_QKV, Split.EQUAL),
    "txt_attn.qkv": FluxTarget(_ADDED_QKV, Split.EQUAL),
    "img_attn.proj": _single("attn.to_out.0"),
    "txt_attn.proj": _single("attn.to_add_out"),
    "img_mlp.0": _single("ff.net.0.proj"),
    "img_mlp.2": _single("ff.net.2"),
    "txt_mlp.0": _single("ff_context.net.0.proj"),
    "txt_mlp.2": _single("ff_context.net.2"),
    "img_mod.lin": _single("norm1.linear"),
    "txt_mod.lin": _single("norm1_context.linear"),
}

# BFL single-block sub-module -> Diffusers FluxSingleTransformerBlock sub-module(s).
_BFL_SINGLE: dict[str, FluxTarget] = {
    "linear1": FluxTarget((*_ATTN_QKV, "proj_mlp"), Split.ATTN_MLP),
    "linear2": _single("proj_out"),
    "modulation.lin": _single("norm.linear"),
}

# BFL modules outside the blocks -> Diffusers FluxTransformer2DModel modules.
_BFL_GLOBAL: dict[str, FluxTarget] = {
    "img_in": _single("x_embedder"),
    "txt_in": _single("context_embedder"),
    "time_in.in_layer": _single("time_text_embed.timestep_embedder.linear_1"),
    "time_in.out_layer": _single("time_text_embed.timestep_embedder.linear_2"),
    "vector_in.in_layer": _single("time_text_embed.text_embedder.linear_1"),
    "vector_in.out_layer": _single("time_text_embed.text_embedder.linear_2"),
    "guidance_in.in_layer": _single("time_text_embed.guidance_embedder.linear_1"),
    "guidance_in.out_layer": _single("time_text_embed.guidance_embedder.linear_2"),
    "final_layer.linear": _single("proj_out"),
    "final_layer.adaLN_modulation.1": _single("norm_out.linear", swap_halves=True),
}

# Every Linear of Diffusers' FluxTransformer2DModel, per block kind and outside the blocks.
DIFFUSERS_DOUBLE_LINEARS: tuple[str, ...] = (
    "norm1.linear",
    "norm1_context.linear",
    *_ATTN_QKV,
    *_ADDED_QKV,
    "attn.to_out.0",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
DIFFUSERS_SINGLE_LINEARS: tuple[str, ...] = ("norm.linear", *_ATTN_QKV, "proj_mlp", "proj_out")
DIFFUSERS_GLOBAL_LINEARS: tuple[str, ...] = (
    "x_embedder",
    "context_embedder",
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "time_text_embed.text_embedder.linear_1",
    "time_text_embed.text_embedder.linear_2",
    "time_text_embed.guidance_embedder.linear_1",
    "time_text_embed.guidance_embedder.linear_2",
    "norm_out.linear",
    "proj_out",
)

# XLabs attention-processor LoRAs -> Diffusers sub-modules (as Diffusers maps them).
_XLABS_DOUBLE: dict[str, FluxTarget] = {
    "qkv_lora1": FluxTarget(_ATTN_QKV, Split.EQUAL),
    "qkv_lora2": FluxTarget(_ADDED_QKV, Split.EQUAL),
    "proj_lora1": _single("attn.to_out.0"),
    "proj_lora2": _single("attn.to_add_out"),
}
_XLABS_SINGLE: dict[str, FluxTarget] = {
    "qkv_lora": FluxTarget(_ATTN_QKV, Split.EQUAL),
    "proj_lora": _single("proj_out"),
}

_CLIP_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj")
_CLIP_LINEARS = (*_CLIP_LAYER_LINEARS, "mlp.fc1", "mlp.fc2")


def _underscored(table: dict[str, FluxTarget]) -> dict[str, FluxTarget]:
    return {name.replace(".", "_"): target for name, target in table.items()}


def _underscored_paths(paths: tuple[str, ...]) -> dict[str, str]:
    return {path.replace(".", "_"): path for path in paths}


_KOHYA_DOUBLE = _underscored(_BFL_DOUBLE)
_KOHYA_SINGLE = _underscored(_BFL_SINGLE)
_KOHYA_GLOBAL = _underscored(_BFL_GLOBAL)
_DIFFUSERS_DOUBLE_U = _underscored_paths(DIFFUSERS_DOUBLE_LINEARS)
_DIFFUSERS_SINGLE_U = _underscored_paths(DIFFUSERS_SINGLE_LINEARS)
_DIFFUSERS_GLOBAL_U = _underscored_paths(DIFFUSERS_GLOBAL_LINEARS)
_CLIP_U = _underscored_paths(_CLIP_LINEARS)

_BFL_BLOCK = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.(.+)")
_KOHYA_BLOCK = re.compile(r"(double_blocks|single_blocks)_(\d+)_(.+)")
_DIFFUSERS_BLOCK_U = re.compile(r"(transformer_blocks|single_transformer_blocks)_(\d+)_(.+)")
_CLIP_LAYER_U = re.compile(r"text_model_encoder_layers_(\d+)_(.+)")
_XLABS = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.processor\.(\w+)")

# The first name component of BFL-layout transformer modules.
BFL_ROOTS: tuple[str, ...] = (
    "double_blocks.",
    "single_blocks.",
    "final_layer.",
    "img_in.",
    "txt_in.",
    "time_in.",
    "vector_in.",
    "guidance_in.",
)


def _in_block(kind: str, index: str, target: FluxTarget) -> FluxTarget:
    block = "transformer_blocks" if kind == "double_blocks" else "single_transformer_blocks"
    return FluxTarget(tuple(f"{block}.{index}.{p}" for p in target.paths), target.split, target.swap_halves)


def bfl_target(module: str) -> FluxTarget | None:
    """A BFL module name with dots (`double_blocks.0.img_attn.qkv`), or None if FLUX has no such Linear."""
    match = _BFL_BLOCK.fullmatch(module)
    if match is None:
        return _BFL_GLOBAL.get(module)
    kind, index, rest = match.groups()
    target = (_BFL_DOUBLE if kind == "double_blocks" else _BFL_SINGLE).get(rest)
    return None if target is None else _in_block(kind, index, target)


def kohya_target(name: str) -> FluxTarget | None:
    """A kohya `lora_unet_` module name without the prefix: BFL's names with underscores
    (`double_blocks_0_img_attn_qkv`), or None if it names no FLUX Linear that way."""
    match = _KOHYA_BLOCK.fullmatch(name)
    if match is None:
        return _KOHYA_GLOBAL.get(name)
    kind, index, rest = match.groups()
    target = (_KOHYA_DOUBLE if kind == "double_blocks" else _KOHYA_SINGLE).get(rest)
    return None if target is None else _in_block(kind, index, target)


def diffusers_underscored_target(name: str) -> FluxTarget | None:
    """A Diffusers module path with underscores for dots (`transformer_blocks_0_attn_to_q`, as in
    `lora_transformer_` files), or None if it names no FluxTransformer2DModel Linear."""
    match = _DIFFUSERS_BLOCK_U.fullmatch(name)
    if match is None:
        path = _DIFFUSERS_GLOBAL_U.get(name)
        return None if path is None else _single(path)
    block, index, rest = match.groups()
    path = (_DIFFUSERS_DOUBLE_U if block == "transformer_blocks" else _DIFFUSERS_SINGLE_U).get(rest)
    return None if path is None else _single(f"{block}.{index}.{path}")


def xlabs_target(module: str) -> FluxTarget | None:
    """An XLabs processor module (`double_blocks.0.processor.qkv_lora1`), or None if unknown."""
    match = _XLABS.fullmatch(module)
    if match is None:
        return None
    kind, index, name = match.groups()
    target = (_XLABS_DOUBLE if kind == "double_blocks" else _XLABS_SINGLE).get(name)
    return None if target is None else _in_block(kind, index, target)


def clip_path(name: str) -> str | None:
    """A kohya CLIP text-encoder module name without its `lora_te1_` prefix
    (`text_model_encoder_layers_0_self_attn_q_proj`) as a CLIPTextModel path, or None if it is no
    encoder-layer Linear."""
    match = _CLIP_LAYER_U.fullmatch(name)
    if match is None:
        return None
    index, rest = match.groups()
    path = _CLIP_U.get(rest)
    return None if path is None else f"text_model.encoder.layers.{index}.{path}"
