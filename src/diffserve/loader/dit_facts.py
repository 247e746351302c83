"""What the loader needs to know about a native DiT class beyond its weights: which of its modules stay
in full precision under `--quantization`, how LoRA files for it are converted, how single-file
checkpoints of it are named. Each family states these facts in its record (`families/<name>/record.py`);
the registry gathers them into one `DitFactsTable`, which the engine hands to the loader. The loader
keeps no per-family table of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from diffserve.errors import LoraError, UserError

if TYPE_CHECKING:  # (the loader's modules import this one: names for annotations only)
    from diffserve.loader.lora_formats.module_rules import ModuleRule
    from diffserve.loader.lora_weights import ConvertedLora
    from diffserve.loader.single_file_keys.plan import KeyPlan, Shapes

#: A family's converter of its community LoRA layouts (kohya, XLabs, BFL, ...): the converted adapter, or
#: None when the state dict is in none of them (then the generic converters are tried).
CommunityLoraConverter = Callable[[Mapping[str, torch.Tensor]], "ConvertedLora | None"]
#: Builds the `KeyPlan` of an original-layout single file from its shapes and the model's key names.
PlanBuilder = Callable[["Shapes", frozenset[str]], "KeyPlan"]


@dataclass(frozen=True)
class LoraFacts:
    """`components`: the pipeline components the family's Diffusers `LoraLoaderMixin` loads adapters into
    (`_lora_loadable_modules` minus second transformers, which no file key names). `rules`: the module
    table for kohya `lora_unet_` and `diffusion_model.` files, None where Diffusers converts neither.
    `first_alpha_fill`: Diffusers passes the file's `.alpha` tensors to PEFT as `network_alphas` (FLUX), so
    a module without one gets the component's first alpha in file order, not alpha = rank.
    `community`: the family's own converter of community layouts, tried first."""

    components: tuple[str, ...] = ("transformer",)
    rules: tuple[ModuleRule, ...] | None = None
    first_alpha_fill: bool = False
    community: CommunityLoraConverter | None = None


@dataclass(frozen=True)
class SingleFileKeys:
    """How one DiT family's single files are named. `label`: how messages name the family (`FLUX.1`);
    `plan` builds the `KeyPlan` of a file; `ignored` names original tensors no Diffusers module uses;
    `gguf_arches` are the `general.architecture` strings city96's GGUF files of the family carry;
    `markers` are name fragments (original or Diffusers names) by which a file of the family is
    recognised, to tell a user which family a mismatching file looks like."""

    label: str
    plan: PlanBuilder
    ignored: frozenset[str] = frozenset()
    gguf_arches: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()


@dataclass(frozen=True)
class DitFacts:
    """The loader's facts about the native DiT of Diffusers class `class_name`; a None field means the
    feature is not supported for that DiT (and is refused with the list of DiTs that have it)."""

    class_name: str
    #: `--quantization`: top-level modules kept in full precision (embedders and the output head).
    full_precision_modules: frozenset[str] | None = None
    lora: LoraFacts | None = None
    single_file: SingleFileKeys | None = None


class DitFactsTable:
    """Every native DiT's facts by Diffusers class name (built by the registry from the family records)."""

    def __init__(self, facts: Iterable[DitFacts]) -> None:
        self._by_class: dict[str, DitFacts] = {}
        for fact in facts:
            known = self._by_class.setdefault(fact.class_name, fact)
            if known != fact:
                raise ValueError(f"two families state different facts for {fact.class_name}")

    def get(self, class_name: str) -> DitFacts | None:
        return self._by_class.get(class_name)

    def _supported(self, has: Callable[[DitFacts], object]) -> list[str]:
        return sorted(name for name, fact in self._by_class.items() if has(fact) is not None)

    def _required(self, class_name: str, field: str, refusal: Callable[[str], Exception]) -> Any:
        """The fact `field` of `class_name`'s DiT; for a DiT without it (or an unknown class), the error
        `refusal` makes of the DiTs that have it (comma-separated), raised."""
        value = getattr(self.get(class_name), field, None)
        if value is None:
            raise refusal(", ".join(self._supported(lambda f: getattr(f, field))))
        return value

    def full_precision_modules(self, class_name: str) -> frozenset[str]:
        """The modules `--quantization` keeps in full precision, or a UserError for a DiT without support."""
        return self._required(
            class_name,
            "full_precision_modules",
            lambda supported: UserError(
                f"--quantization is not supported for {class_name}; supported DiTs: {supported}"
            ),
        )

    def lora(self, class_name: str) -> LoraFacts:
        """The LoRA conversion facts of `class_name`, or a LoraError for a DiT without LoRA support."""
        return self._required(
            class_name,
            "lora",
            lambda supported: LoraError(
                f"LoRA adapters are not supported for {class_name}; supported: {supported}"
            ),
        )

    def lora_classes(self) -> tuple[str, ...]:
        """The DiT classes LoRA adapters can be loaded into."""
        return tuple(self._supported(lambda f: f.lora))

    def single_file(self, class_name: str) -> SingleFileKeys | None:
        """How single files of `class_name` are named (None: the class loads none)."""
        fact = self.get(class_name)
        return None if fact is None else fact.single_file

    def single_file_classes(self) -> tuple[str, ...]:
        """The DiT classes whose single files can be loaded."""
        return tuple(self._supported(lambda f: f.single_file))

    def guess_single_file_family(self, names: Iterable[str]) -> str | None:
        """Which family a file with tensor `names` looks like, from its names alone (None: unknown): the
        one with the most of its markers in the names (families built on FLUX.1's blocks share some of
        FLUX.1's), the first in registry order on a tie."""
        names = list(names)
        best, best_count = None, 0
        for fact in self._by_class.values():
            keys = fact.single_file
            if keys is None:
                continue
            count = sum(1 for m in keys.markers if any(m in name for name in names))
            if count > best_count:
                best, best_count = keys.label, count
        return best
