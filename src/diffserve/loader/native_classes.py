"""The component classes the loader accepts: each family's native classes, and transformers' generic ones.

A family's native classes (its DiT, VAE and schedulers) are listed in its registry record
(`diffserve.registry`) as a `NativeClasses` table and handed to the loader with the folder; the
transformers classes below (text encoders, tokenizers, processors) are not family-specific. A component
whose class is in neither is refused with a message naming what is supported; diffserve never hands a
component to diffusers behind the user's back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from diffserve.loader.processors import IMAGE_ONLY_PROCESSORS


class NativeModelClass(Protocol):
    """A native weights-bearing class (a DiT or a VAE) as the loader uses it: it names the Diffusers class
    it implements and builds itself (on the meta device) from that class's config.json."""

    diffusers_class_name: str

    def from_config(self, config: dict[str, Any]) -> nn.Module: ...


class NativeSchedulerClass(Protocol):
    """A native scheduler class: it names the Diffusers scheduler it implements and builds itself from
    that scheduler's scheduler_config.json."""

    diffusers_class_name: str

    def from_config(self, config: dict[str, Any]) -> object: ...


@dataclass(frozen=True)
class NativeClasses:
    """One family's table from Diffusers `_class_name` to the native class that implements it: the
    weights-bearing models (loaded from config.json and safetensors) and the schedulers (from
    scheduler_config.json). The loader loads a Diffusers component only through this table, so a
    folder naming a class its family does not implement is refused before anything loads."""

    models: Mapping[str, NativeModelClass]
    schedulers: Mapping[str, NativeSchedulerClass]

    @classmethod
    def of(
        cls, models: Sequence[NativeModelClass], schedulers: Sequence[NativeSchedulerClass]
    ) -> NativeClasses:
        """The table of these classes, each under the Diffusers class name it declares (so the name is
        written once, on the class)."""
        return cls(
            models={model.diffusers_class_name: model for model in models},
            schedulers={scheduler.diffusers_class_name: scheduler for scheduler in schedulers},
        )

    def class_names(self) -> frozenset[str]:
        """Every Diffusers class name in the table."""
        return frozenset(self.models) | frozenset(self.schedulers)


#: transformers classes accepted for text encoders (loaded by transformers itself).
TRANSFORMERS_ENCODERS: frozenset[str] = frozenset(
    {
        "CLIPTextModel",
        "CLIPTextModelWithProjection",
        "T5EncoderModel",
        "Qwen2_5_VLForConditionalGeneration",  # Qwen-Image (its language model; the vision tower for edits)
        "Qwen3Model",  # Z-Image
        "UMT5EncoderModel",  # Wan
        "CLIPVisionModel",  # Wan image-to-video's image encoder
    }
)

#: transformers multimodal processors (tokenizer + image preprocessing) accepted as components.
TRANSFORMERS_PROCESSORS: frozenset[str] = frozenset(IMAGE_ONLY_PROCESSORS)

#: transformers image processors accepted as components (Wan image-to-video's CLIP preprocessing).
TRANSFORMERS_IMAGE_PROCESSORS: frozenset[str] = frozenset({"CLIPImageProcessor"})

#: transformers tokenizer class names accepted in model_index.json; the slow/fast spellings are
#: both accepted and resolved to whichever class this transformers version provides.
TRANSFORMERS_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "CLIPTokenizer": ("CLIPTokenizerFast", "CLIPTokenizer"),
    "CLIPTokenizerFast": ("CLIPTokenizerFast", "CLIPTokenizer"),
    "T5Tokenizer": ("T5TokenizerFast", "T5Tokenizer"),
    "T5TokenizerFast": ("T5TokenizerFast", "T5Tokenizer"),
    "Qwen2Tokenizer": ("Qwen2TokenizerFast", "Qwen2Tokenizer"),
    "Qwen2TokenizerFast": ("Qwen2TokenizerFast", "Qwen2Tokenizer"),
    # A generic tokenizer.json (e.g. a word-level vocabulary, as the shipped demo model uses).
    "PreTrainedTokenizerFast": ("PreTrainedTokenizerFast",),
}
