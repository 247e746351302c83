"""The SANA family's records: `SanaPipeline` (flow DPM-Solver++) and SANA-Sprint (SCM, one to a few
steps), which share the SANA linear-attention DiT and the DC-AE."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.families.sana.pipeline import SanaPipeline, SanaSprintPipeline
from diffserve.loader.dit_facts import DitFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.sana import SanaTransformer2DModel
from diffserve.models.schedulers.dpm_solver_flow import DPMSolverFlowScheduler
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.scm import SCMScheduler
from diffserve.models.vaes.autoencoder_dc import AutoencoderDC

#: The tiny builder; each record names its variant of the spec.
_tiny = partial(lazy_tiny_builder, "diffserve.families.sana.tiny", "build_tiny_sana", "TinySanaSpec")

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
    tiny_builder=_tiny(),
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
        tiny_builder=_tiny(sprint=True, sample_size=32),
        aliases=("sana_sprint",),
    ),
)
