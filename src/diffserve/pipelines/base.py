"""`Pipeline`: an ordered list of stages over one `Req`, plus the loaded components they share."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from diffserve.configs.sampling_params import SamplingParams
from diffserve.loader.component_loader import LoadedComponent
from diffserve.platforms import Platform
from diffserve.request import Req
from diffserve.stages.base import Stage

logger = logging.getLogger("diffserve.pipeline")


@dataclass(frozen=True)
class PipelineContext:
    """What every pipeline is built from: loaded components and where they run."""

    components: dict[str, LoadedComponent]
    platform: Platform
    dtype: torch.dtype
    show_progress: bool = True
    #: Sampling defaults the model folder itself recommends (its diffserve.json), over the family's.
    folder_sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        return self.components[name].value

    def get_optional(self, name: str) -> Any | None:
        """An optional component's value, or None when the folder does not have it."""
        component = self.components.get(name)
        return None if component is None else component.value


class Pipeline:
    """Subclasses list their required components and build their stages in `build_stages`."""

    required_components: ClassVar[tuple[str, ...]] = ()
    #: Components the pipeline uses when the folder has them (model_index.json may set them to null).
    optional_components: ClassVar[tuple[str, ...]] = ()
    #: Height and width must be multiples of this (set by `build_stages` from the loaded VAE).
    pixel_multiple: int

    def __init__(self, context: PipelineContext) -> None:
        self.context = context
        self.stages: list[Stage] = self.build_stages(context)
        logger.info("Pipeline stages: %s", [s.name for s in self.stages])

    def build_stages(self, context: PipelineContext) -> list[Stage]:
        raise NotImplementedError

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        """The params with family defaults applied, validated (raises InvalidRequestError)."""
        raise NotImplementedError

    def run(self, req: Req) -> Req:
        for stage in self.stages:
            req = stage(req)
        return req
