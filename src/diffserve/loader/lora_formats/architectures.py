"""What LoRA conversion needs to know per DiT architecture (named by its Diffusers class), built from the
family's `LoraFacts` (its record): which components Diffusers' LoRA loader of that family loads, which
non-Diffusers layouts it converts and with which module table, and how it fills in a missing alpha."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from diffserve.loader.dit_facts import CommunityLoraConverter, DitFactsTable, LoraFacts
from diffserve.loader.lora_formats.module_rules import ModuleTable


@dataclass(frozen=True)
class Architecture:
    """`components`, `first_alpha_fill` and `community` as in `LoraFacts`; `table`: the module table for
    kohya `lora_unet_` and `diffusion_model.` files, None where Diffusers converts neither."""

    dit_class: str
    components: frozenset[str]
    table: ModuleTable | None
    first_alpha_fill: bool = False
    community: CommunityLoraConverter | None = None


def architecture(dit_class: str, facts: DitFactsTable) -> Architecture:
    """The conversion facts of `dit_class`; a `LoraError` for a DiT without LoRA support."""
    return _architecture(dit_class, facts.lora(dit_class))


@cache
def _architecture(dit_class: str, lora: LoraFacts) -> Architecture:
    return Architecture(
        dit_class=dit_class,
        components=frozenset(lora.components),
        table=ModuleTable(list(lora.rules)) if lora.rules is not None else None,
        first_alpha_fill=lora.first_alpha_fill,
        community=lora.community,
    )
