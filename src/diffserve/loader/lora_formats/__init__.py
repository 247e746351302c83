"""LoRA adapter files read and converted into `ConvertedLora` (Diffusers module paths, one pair per
Linear), whatever layout they were saved in, following Diffusers' `lora_state_dict` of each family.

`read_lora_file(path)` gives a safetensors file's tensors and metadata; `convert_lora(state_dict,
metadata, dit_class, facts)` picks the converter by architecture and key layout:
- a family's community formats (FLUX: kohya, XLabs, BFL, ...): its record's `LoraFacts.community`, tried first;
- kohya `lora_unet_…` and original-checkpoint `diffusion_model.…` keys (Qwen-Image, Z-Image, Wan):
  `kohya.py`;
- Diffusers / PEFT keys (`transformer.<module>.lora_A.weight`), every family: `peft_diffusers.py`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diffserve.loader.dit_facts import DitFactsTable
from diffserve.loader.lora_formats.architectures import architecture
from diffserve.loader.lora_formats.kohya import convert_original_lora, original_layout
from diffserve.loader.lora_formats.pairs import describe, lora_error
from diffserve.loader.lora_formats.peft_diffusers import PEFT_PREFIX, convert_peft_lora
from diffserve.loader.lora_formats.safetensors_file import read_lora_file
from diffserve.loader.lora_weights import ConvertedLora

__all__ = ["convert_lora", "lora_file_format", "read_lora_file"]


def lora_file_format(state_dict: Mapping[str, torch.Tensor]) -> str:
    """The key layout of a state dict, whatever the architecture: `"kohya"`, `"diffusion_model"`,
    `"peft"` (PEFT's `base_model.model.` prefix) or `"diffusers"`."""
    keys = list(state_dict)
    layout = original_layout(keys)
    if layout is not None:
        return layout
    return "peft" if any(k.startswith(PEFT_PREFIX) for k in keys) else "diffusers"


def convert_lora(
    state_dict: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    dit_class: str,
    facts: DitFactsTable,
    *,
    source: str = "file",
) -> ConvertedLora:
    """Convert a LoRA state dict for the DiT `dit_class` (its Diffusers class name). `metadata` is the
    file's safetensors metadata; `facts` holds every DiT's facts (the registry's `DIT_FACTS`); `source`
    names the file or adapter in error messages. `LoraError` for an unsupported architecture or layout,
    keys of no known layout, malformed pairs, or a file with no LoRA pair the family can use."""
    arch = architecture(dit_class, facts)
    if not state_dict:
        raise lora_error(source, "the file holds no tensors")
    converted = None
    if arch.community is not None:
        converted = arch.community(state_dict)
    if converted is None:
        layout = original_layout(list(state_dict))
        if layout is not None:
            converted = convert_original_lora(state_dict, arch, layout, source)
        else:
            converted = convert_peft_lora(state_dict, metadata, arch, source)
    if not converted.targets:
        unsupported = (
            f"; unsupported keys: {describe(list(converted.unsupported))}" if converted.unsupported else ""
        )
        raise lora_error(
            source, f"no LoRA pair in the {converted.format}-format file applies to {dit_class}{unsupported}"
        )
    return converted
