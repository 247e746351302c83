"""The native classes a family implements its Diffusers components with, as its registry record lists them.
A Diffusers component whose class is not in its family's table is refused, never handed to diffusers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn


class NativeModelClass(Protocol):
    """A native DiT or VAE class: the Diffusers class it implements, built (on meta) from its config.json."""

    diffusers_class_name: str

    def from_config(self, config: dict[str, Any]) -> nn.Module: ...


class NativeSchedulerClass(Protocol):
    """A native scheduler class: the Diffusers scheduler it implements, built from scheduler_config.json."""

    diffusers_class_name: str

    def from_config(self, config: dict[str, Any]) -> object: ...


@dataclass(frozen=True)
class NativeClasses:
    """One family's table from Diffusers `_class_name` to the native model or scheduler implementing it.
    The loader loads a Diffusers component only through this table, so a folder naming a class its family
    does not implement is refused before anything loads."""

    models: Mapping[str, NativeModelClass]
    schedulers: Mapping[str, NativeSchedulerClass]
    #: Guider components (Diffusers' `guiders`, read from `guider_config.json`), e.g. HunyuanVideo 1.5's CFG.
    guiders: Mapping[str, NativeSchedulerClass] = field(default_factory=dict)
    #: The transformers model classes (by name) the family loads as text or image encoders; a folder
    #: naming another is refused at load, not at its first request. Tokenizers and processors are any that
    #: transformers has (`processors.transformers_role`).
    encoders: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls,
        models: Sequence[NativeModelClass],
        schedulers: Sequence[NativeSchedulerClass],
        guiders: Sequence[NativeSchedulerClass] = (),
        encoders: Sequence[str] = (),
    ) -> NativeClasses:
        """The table of these classes, each under the Diffusers class name it declares, and the transformers
        encoder classes the family loads."""
        return cls(
            models={model.diffusers_class_name: model for model in models},
            schedulers={scheduler.diffusers_class_name: scheduler for scheduler in schedulers},
            guiders={guider.diffusers_class_name: guider for guider in guiders},
            encoders=frozenset(encoders),
        )
