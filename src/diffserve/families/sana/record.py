"""The SANA family's records: `SanaPipeline` (flow DPM-Solver++) and SANA-Sprint (SCM, one to a few
steps), which share the SANA linear-attention DiT and the DC-AE."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.families.sana.pipeline import SanaPipeline, SanaSprintPipeline
from diffserve.loader.dit_facts import DitFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.sana import SanaTransformer2DModel
from diffserve.models.schedulers.dpm_solver_flow import DPMSolverFlowScheduler
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.scm import SCMScheduler
from diffserve.models.vaes.autoencoder_dc import AutoencoderDC


def _tiny_sana(out_dir: Path, options: TinyCheckpointOptions, **spec: Any) -> Path:
    """A SANA folder (`spec`: fields of `TinySanaSpec`, SANA-Sprint's). Imports its module when called
    (transformers model classes the registry does not need)."""
    from diffserve.families.sana.tiny import TinySanaSpec, build_tiny_sana

    return build_tiny_sana(out_dir, TinySanaSpec(seed=options.seed, **spec))


#: No quantization, LoRA or single-file support yet: the loader refuses them naming the DiT.
_DIT_FACTS = DitFacts(class_name=SanaTransformer2DModel.diffusers_class_name)

_SANA = ModelFamily(
    name="sana",
    diffusers_pipeline="SanaPipeline",
    pipeline_cls=SanaPipeline,
    native_classes=NativeClasses.of(
        models=(SanaTransformer2DModel, AutoencoderDC),
        # What SANA's folders ship (flow DPM-Solver++), and the flow-match Euler its converter also writes.
        schedulers=(DPMSolverFlowScheduler, FlowMatchEulerScheduler),
        encoders=("Gemma2Model",),
    ),
    task="text-to-image",
    tiny_builder=_tiny_sana,
    dit_facts=_DIT_FACTS,
)

FAMILIES: tuple[ModelFamily, ...] = (
    _SANA,
    replace(
        _SANA,
        name="sana-sprint",
        diffusers_pipeline="SanaSprintPipeline",
        pipeline_cls=SanaSprintPipeline,
        native_classes=NativeClasses.of(
            models=(SanaTransformer2DModel, AutoencoderDC),
            schedulers=(SCMScheduler,),
            encoders=("Gemma2Model",),
        ),
        tiny_builder=partial(_tiny_sana, sprint=True, sample_size=32),
        aliases=("sana_sprint",),
    ),
)
