"""Random LoRA files for a tiny Qwen-Image, Z-Image or Wan 2.1 folder in the non-Diffusers layouts that
Diffusers' loaders of these families convert, for parity tests: no hub, any rank, chosen alphas.

Two key layouts, as `write_original_lora` writes them:
- kohya / musubi-tuner: `lora_unet_<module, dots as underscores>.lora_down.weight` / `.lora_up.weight`
  and `.alpha` (Diffusers: `_convert_non_diffusers_qwen_lora_to_diffusers`,
  `_convert_non_diffusers_z_image_lora_to_diffusers`, `_convert_musubi_wan_lora_to_diffusers`);
- original checkpoint: `diffusion_model.<dotted module>.lora_A.weight` / `.lora_B.weight` and `.alpha`
  (ComfyUI, ai-toolkit, lightx2v; Diffusers: the same Qwen and Z-Image converters,
  `_convert_non_diffusers_wan_lora_to_diffusers`).

The module names are the ones such files use, written out here independently of diffserve's own
conversion tables (so a parity test of that conversion is not circular): Qwen-Image's are Diffusers'
own; Z-Image's are Diffusers' own or, with `fused_attention`, the original tree's fused `attention.qkv`
and `attention.out`; Wan's are the original checkpoint's (`blocks.0.self_attn.q`, `head.head`, ...).
Each family's module list keeps to what its Diffusers converter accepts (see the `*_modules` functions).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffserve.testing.tiny_lora import dit_linears


class Layout(Enum):
    """Key layout of a written file."""

    KOHYA = "kohya"  # lora_unet_<module_with_underscores>.lora_down.weight
    DIFFUSION_MODEL = "diffusion_model"  # diffusion_model.<dotted.module>.lora_A.weight


class Suffix(Enum):
    """How a file spells its two factors: (down, up)."""

    DOWN_UP = ("lora_down.weight", "lora_up.weight")  # kohya, musubi-tuner, some ComfyUI files
    A_B = ("lora_A.weight", "lora_B.weight")  # PEFT spelling under `diffusion_model.` (ai-toolkit)
    #: trainers over Z-Image's original tree; the only spelling in which Diffusers splits a
    #: `diffusion_model.` file's fused `attention.qkv` (it reads kohya's `lora_down` as this one)
    DOTTED = ("lora.down.weight", "lora.up.weight")


@dataclass(frozen=True)
class FileModule:
    """One LoRA-trained Linear as the file names it (dotted), its shape, and whether the family's
    Diffusers converter accepts an `.alpha` for it."""

    name: str
    out_features: int
    in_features: int
    takes_alpha: bool = True


def qwen_image_modules(model_path: str | Path) -> list[FileModule]:
    """Every Linear of a Qwen-Image DiT (blocks and top-level), under Diffusers' names, which are also
    the original code's."""
    return [FileModule(name, out, inp) for name, (out, inp) in dit_linears(model_path).items()]


_Z_IMAGE_PROJECTIONS = re.compile(r"(?P<block>.+\.attention)\.to_(?P<proj>[qkv])$")


def z_image_modules(model_path: str | Path, fused_attention: bool = False) -> list[FileModule]:
    """Every Linear of a Z-Image DiT under Diffusers' names; with `fused_attention` the attention
    projections as Z-Image's original tree names them instead: one `attention.qkv` (q, k, v stacked in
    the output rows) and `attention.out` for `attention.to_out.0`."""
    modules: list[FileModule] = []
    for name, (out, inp) in dit_linears(model_path).items():
        projection = _Z_IMAGE_PROJECTIONS.fullmatch(name)
        if not fused_attention:
            modules.append(FileModule(name, out, inp))
        elif projection is None:
            modules.append(FileModule(name.replace("attention.to_out.0", "attention.out"), out, inp))
        elif projection["proj"] == "q":
            modules.append(FileModule(f"{projection['block']}.qkv", 3 * out, inp))
    return modules


#: Diffusers' Wan module names -> the original checkpoint's (`{n}`: block index).
_WAN_BLOCK_NAMES = {
    **{f"attn1.{d}": f"self_attn.{o}" for d, o in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"))},
    "attn1.to_out.0": "self_attn.o",
    **{f"attn2.{d}": f"cross_attn.{o}" for d, o in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"))},
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
_WAN_TOP_NAMES = {
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "proj_out": "head.head",
}
_WAN_BLOCK = re.compile(r"blocks\.(?P<n>\d+)\.(?P<rest>.+)")


def wan_modules(model_path: str | Path, blocks_only: bool = False) -> list[FileModule]:
    """Every Linear of a Wan 2.1 DiT under the original checkpoint's names. Diffusers' converter of
    `diffusion_model.` files scales by `.alpha` only inside the blocks (an alpha elsewhere is an error
    there), so the top-level modules take none. `blocks_only`: just the blocks' Linears, all of which
    musubi-tuner's files hold and Diffusers' musubi converter requires."""
    modules: list[FileModule] = []
    for name, (out, inp) in dit_linears(model_path).items():
        block = _WAN_BLOCK.fullmatch(name)
        if block is not None:
            modules.append(FileModule(f"blocks.{block['n']}.{_WAN_BLOCK_NAMES[block['rest']]}", out, inp))
        elif not blocks_only:
            modules.append(FileModule(_WAN_TOP_NAMES[name], out, inp, takes_alpha=False))
    return modules


def write_original_lora(
    modules: list[FileModule],
    out_file: str | Path,
    layout: Layout,
    suffix: Suffix = Suffix.DOWN_UP,
    rank: int = 4,
    alphas: tuple[float, ...] = (),
    seed: int = 0,
    std: float = 0.1,
) -> Path:
    """Write a random rank-`rank` LoRA on `modules` to `out_file` in `layout` with factor spelling
    `suffix`. Module i (of those that take one) gets the alpha `alphas[i % len(alphas)]`; no `alphas`
    writes no `.alpha` keys (alpha = rank). Both factors are random (std `std`), so the adapter visibly
    changes the output; no safetensors metadata beyond the format, as kohya-style trainers write."""
    g = torch.Generator().manual_seed(seed)
    down_suffix, up_suffix = suffix.value
    tensors: dict[str, torch.Tensor] = {}
    for i, module in enumerate(modules):
        if layout is Layout.KOHYA:
            key = "lora_unet_" + module.name.replace(".", "_")
        else:
            key = "diffusion_model." + module.name
        tensors[f"{key}.{down_suffix}"] = torch.randn(rank, module.in_features, generator=g) * std
        tensors[f"{key}.{up_suffix}"] = torch.randn(module.out_features, rank, generator=g) * std
        if alphas and module.takes_alpha:
            tensors[f"{key}.alpha"] = torch.tensor(alphas[i % len(alphas)])
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt"})
    return out
