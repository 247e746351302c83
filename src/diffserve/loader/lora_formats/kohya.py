"""Non-Diffusers LoRA files of Qwen-Image, Z-Image and Wan: kohya / musubi-tuner keys
(`lora_unet_<module with underscores>.lora_down.weight`, `.lora_up.weight`, `.alpha`) and
original-checkpoint keys (`diffusion_model.<dotted module>.lora_A.weight`, ComfyUI / ai-toolkit /
lightx2v), mapped to Diffusers module paths through the architecture's module table
(`module_rules.py`), as Diffusers' `_convert_non_diffusers_{qwen,z_image,wan}_lora_to_diffusers` and
`_convert_musubi_wan_lora_to_diffusers` do.

Diffusers folds each module's `alpha / rank` into its factors; here the alpha stays in
`LoraWeights.alpha` (the same delta), and a module without `.alpha` has alpha = rank. A kohya name must
be in the table (its dots cannot be recovered otherwise); a dotted name the table does not rename is
taken as Diffusers' own. Text-encoder keys (`lora_te_`, `lora_te1_`, ...) go to `unsupported`: these
families' Diffusers loaders load only the transformer. The safetensors `lora_adapter_metadata` is not
read for these layouts (their trainers do not write it). SD3 has no such conversion in Diffusers, and
none here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from diffserve.loader.lora_formats.architectures import Architecture
from diffserve.loader.lora_formats.module_rules import Resolved
from diffserve.loader.lora_formats.pairs import (
    ModuleTensors,
    Role,
    checked_factors,
    describe,
    lora_error,
    parse_suffix,
    split_pair,
)
from diffserve.loader.lora_weights import ConvertedLora, LoraWeights

KOHYA = "kohya"
DIFFUSION_MODEL = "diffusion_model"
KOHYA_UNET_PREFIX = "lora_unet_"
DIFFUSION_MODEL_PREFIX = "diffusion_model."
_KOHYA_TEXT_ENCODER = re.compile(r"lora_te\d*_")
_TRANSFORMER = "transformer"


def original_layout(keys: list[str]) -> str | None:
    """`"kohya"` or `"diffusion_model"` when the keys use one of these layouts, else None."""
    if any(k.startswith(KOHYA_UNET_PREFIX) or _KOHYA_TEXT_ENCODER.match(k) for k in keys):
        return KOHYA
    if any(k.startswith(DIFFUSION_MODEL_PREFIX) for k in keys):
        return DIFFUSION_MODEL
    return None


@dataclass
class _Group:
    """The keys of one file module: where it lands and its tensors."""

    name: str
    resolved: Resolved
    tensors: ModuleTensors = field(default_factory=ModuleTensors)


def convert_original_lora(
    state_dict: Mapping[str, torch.Tensor], arch: Architecture, layout: str, source: str
) -> ConvertedLora:
    """Convert a kohya or `diffusion_model.` state dict for `arch`; `LoraError` for keys outside the
    layout, kohya names of no module in the table, a factor without its partner or mismatched ranks."""
    if arch.table is None:
        raise lora_error(
            source,
            f"{layout}-format LoRA files are not supported for {arch.dit_class} (Diffusers does not convert "
            "them either); use a Diffusers/PEFT-format file (`transformer.<module>.lora_A.weight` keys)",
        )
    groups: dict[tuple[tuple[str, ...], bool], _Group] = {}
    unknown: list[str] = []
    unmapped: list[str] = []
    unsupported: list[str] = []
    for key, tensor in state_dict.items():
        if layout == KOHYA and _KOHYA_TEXT_ENCODER.match(key):
            unsupported.append(key)
            continue
        prefix = KOHYA_UNET_PREFIX if layout == KOHYA else DIFFUSION_MODEL_PREFIX
        parsed = parse_suffix(key.removeprefix(prefix)) if key.startswith(prefix) else None
        if parsed is None:
            unknown.append(key)
            continue
        if parsed.role is Role.UNSUPPORTED:
            unsupported.append(key)
            continue
        if layout == KOHYA:
            resolved = arch.table.resolve_flat(parsed.module)
        else:
            resolved = arch.table.resolve_dotted(parsed.module) or Resolved((parsed.module,), False)
        if resolved is None:
            unmapped.append(key)
            continue
        group = groups.setdefault((resolved.targets, resolved.alias), _Group(parsed.module, resolved))
        group.tensors.put(parsed.role, tensor, key, parsed.module, source)
    if unknown:
        raise lora_error(
            source, f"keys outside the {layout} layout for {arch.dit_class}: {describe(sorted(unknown))}"
        )
    if unmapped:
        raise lora_error(
            source,
            f"kohya keys that name no {arch.dit_class} module known to diffserve: {describe(sorted(unmapped))}",
        )

    direct = {
        target for group in groups.values() if not group.resolved.alias for target in group.resolved.targets
    }
    targets: dict[str, LoraWeights] = {}
    for group in groups.values():
        if not group.tensors.has_pair_part:
            continue  # an `.alpha` without factors changes nothing (Diffusers drops it too)
        if group.resolved.alias and direct.intersection(group.resolved.targets):
            continue  # a second copy under an original name: Diffusers ignores it next to the direct keys
        factors = checked_factors(group.name, group.tensors, source)
        if factors is None:
            unsupported.extend(group.tensors.all_keys())
            continue
        down, up = factors
        alpha = group.tensors.alpha(source)
        paths = group.resolved.targets
        pairs = (
            [LoraWeights(down, up, alpha)]
            if len(paths) == 1
            else split_pair(group.name, down, up, alpha, len(paths), source)
        )
        for path, pair in zip(paths, pairs, strict=True):
            label = f"{_TRANSFORMER}.{path}"
            if label in targets:
                raise lora_error(
                    source, f"two modules of the file land on {label} (the second is {group.name})"
                )
            targets[label] = pair
    return ConvertedLora(targets, layout, tuple(unsupported))
