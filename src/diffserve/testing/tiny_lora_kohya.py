"""Random FLUX LoRA files in kohya sd-scripts' layout, for parity tests against Diffusers' kohya
conversion: `lora_unet_<module>.lora_down.weight` / `.lora_up.weight` / `.alpha` over either Black
Forest Labs' module names (`lora_unet_double_blocks_0_img_attn_qkv`, with the fused q/k/v and
single-block `linear1` projections) or Diffusers' names with underscores
(`lora_transformer_transformer_blocks_0_attn_to_q`, the ai-toolkit / OneTrainer flavour). Shapes come
from the model folder's DiT config, so any tiny FLUX works; every module gets an `.alpha`, so a value
other than the rank exercises alpha scaling."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffserve.testing.tiny_lora import dit_linears

# BFL block modules -> the Diffusers Linears they fuse (in output-row order), per block kind.
_DOUBLE_FUSED: dict[str, tuple[str, ...]] = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn_proj": ("attn.to_out.0",),
    "txt_attn_proj": ("attn.to_add_out",),
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
    "img_mod_lin": ("norm1.linear",),
    "txt_mod_lin": ("norm1_context.linear",),
}
_SINGLE_FUSED: dict[str, tuple[str, ...]] = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation_lin": ("norm.linear",),
}
#: BFL names of the fused projections (their up factor may be written block-diagonal).
FUSED_QKV = ("img_attn_qkv", "txt_attn_qkv")
SINGLE_LINEAR1 = "linear1"


class KohyaNaming(Enum):
    """Which module names the `lora_<...>_` keys carry."""

    BFL = "lora_unet_"  # kohya sd-scripts: BFL names with underscores
    DIFFUSERS = "lora_transformer_"  # ai-toolkit / OneTrainer: Diffusers names with underscores


def flux_kohya_modules(model_path: str | Path, naming: KohyaNaming) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each block module a kohya file of `naming` can train, by its key
    stem (`lora_unet_double_blocks_0_img_attn_qkv`); fused BFL modules are as wide as their parts
    together. Modules outside the blocks are left out (Diffusers' kohya converter does not load them)."""
    shapes = dit_linears(model_path)
    if naming is KohyaNaming.DIFFUSERS:
        return {
            naming.value + path.replace(".", "_"): shape
            for path, shape in shapes.items()
            if path.startswith(("transformer_blocks.", "single_transformer_blocks."))
        }
    modules: dict[str, tuple[int, int]] = {}
    for block, kind, table in (
        ("transformer_blocks", "double_blocks", _DOUBLE_FUSED),
        ("single_transformer_blocks", "single_blocks", _SINGLE_FUSED),
    ):
        indices = sorted({int(p.split(".")[1]) for p in shapes if p.startswith(f"{block}.")})
        for i in indices:
            for name, parts in table.items():
                part_shapes = [shapes[f"{block}.{i}.{part}"] for part in parts]
                in_features = part_shapes[0][1]
                modules[f"{naming.value}{kind}_{i}_{name}"] = (sum(s[0] for s in part_shapes), in_features)
    return modules


def write_random_kohya_flux_lora(
    model_path: str | Path,
    out_file: str | Path,
    rank: int = 6,
    alpha: float = 3.0,
    seed: int = 0,
    std: float = 0.1,
    naming: KohyaNaming = KohyaNaming.BFL,
    pattern: re.Pattern[str] | None = None,
    block_diagonal_qkv: bool = False,
) -> Path:
    """Write a random kohya-layout FLUX LoRA of rank `rank` with `alpha` on every block module of the
    folder's DiT (those whose key stem `pattern` finds, if given). `block_diagonal_qkv` writes the fused
    q/k/v up factors block-diagonal over the rank (the "sparse" layout that Diffusers splits into
    rank/3 pairs; `rank` must then divide by 3)."""
    if block_diagonal_qkv and rank % 3:
        raise ValueError(f"a block-diagonal q/k/v up factor needs a rank divisible by 3, got {rank}")
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for stem, (out_features, in_features) in flux_kohya_modules(model_path, naming).items():
        if pattern is not None and not pattern.search(stem):
            continue
        down = torch.randn(rank, in_features, generator=g) * std
        up = torch.randn(out_features, rank, generator=g) * std
        if block_diagonal_qkv and stem.endswith(FUSED_QKV):
            rows, sub = out_features // 3, rank // 3
            mask = torch.zeros_like(up)
            for j in range(3):
                mask[j * rows : (j + 1) * rows, j * sub : (j + 1) * sub] = 1
            up = up * mask
        tensors[f"{stem}.lora_down.weight"] = down
        tensors[f"{stem}.lora_up.weight"] = up
        tensors[f"{stem}.alpha"] = torch.tensor(float(alpha))
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt"})
    return out
