"""What LoRA conversion needs to know per DiT architecture (named by its Diffusers class): which
components Diffusers' LoRA loader of that family loads, which non-Diffusers layouts it converts and
with which module table, and how it fills in a missing alpha."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from diffserve.errors import LoraError
from diffserve.loader.lora_formats.module_rules import ModuleTable
from diffserve.loader.lora_formats.qwen_image import QWEN_IMAGE_RULES
from diffserve.loader.lora_formats.wan import WAN_RULES
from diffserve.loader.lora_formats.z_image import Z_IMAGE_RULES


@dataclass(frozen=True)
class Architecture:
    """`components`: the pipeline components the family's `LoraLoaderMixin` loads adapters into
    (`_lora_loadable_modules` minus second transformers, which no file key names). `table`: the module
    table for kohya `lora_unet_` and `diffusion_model.` files, None where Diffusers converts neither.
    `first_alpha_fill`: Diffusers passes the file's `.alpha` tensors to PEFT as `network_alphas`
    (FLUX), so a module without one gets the component's first alpha in file order (PEFT's default
    `lora_alpha`: Diffusers picks the "most common" alpha, but counts tensors, which hash by identity),
    not alpha = rank."""

    dit_class: str
    components: frozenset[str]
    table: ModuleTable | None
    first_alpha_fill: bool = False


_COMPONENTS = {
    "FluxTransformer2DModel": ("transformer", "text_encoder"),
    "SD3Transformer2DModel": ("transformer", "text_encoder", "text_encoder_2"),
    "QwenImageTransformer2DModel": ("transformer",),
    "ZImageTransformer2DModel": ("transformer",),
    "WanTransformer3DModel": ("transformer",),
}
_RULES = {
    "QwenImageTransformer2DModel": QWEN_IMAGE_RULES,
    "ZImageTransformer2DModel": Z_IMAGE_RULES,
    "WanTransformer3DModel": WAN_RULES,
}


@cache
def architecture(dit_class: str) -> Architecture:
    """The conversion facts of `dit_class`; a `LoraError` for a DiT without LoRA support."""
    if dit_class not in _COMPONENTS:
        raise LoraError(
            f"LoRA adapters are not supported for {dit_class}; supported: {', '.join(sorted(_COMPONENTS))}"
        )
    rules = _RULES.get(dit_class)
    return Architecture(
        dit_class=dit_class,
        components=frozenset(_COMPONENTS[dit_class]),
        table=ModuleTable(rules) if rules is not None else None,
        first_alpha_fill=dit_class == "FluxTransformer2DModel",
    )


def supported_dit_classes() -> tuple[str, ...]:
    return tuple(sorted(_COMPONENTS))
