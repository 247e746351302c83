"""The SANA-Video family's record: `SanaVideoPipeline` (text-to-video), its linear-attention video DiT on
Wan 2.1 (480p) or LTX-2 (720p) VAE latents, flow DPM-Solver++."""

from __future__ import annotations

from pathlib import Path

from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.families.sana_video.pipeline import SanaVideoPipeline
from diffserve.loader.dit_facts import DitFacts
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.sana_video import SanaVideoTransformer3DModel
from diffserve.models.schedulers.dpm_solver_flow import DPMSolverFlowScheduler
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan


def _tiny_sana_video(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    """Imports its module when called (transformers model classes the registry does not need)."""
    from diffserve.families.sana_video.tiny import TinySanaVideoSpec, build_tiny_sana_video

    return build_tiny_sana_video(out_dir, TinySanaVideoSpec(seed=options.seed))


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="sana-video",
        diffusers_pipeline="SanaVideoPipeline",
        pipeline_cls=SanaVideoPipeline,
        native_classes=NativeClasses.of(
            # The 480p folders ship Wan 2.1's VAE, the 720p ones LTX-2's (Diffusers also takes a DC-AE).
            models=(SanaVideoTransformer3DModel, AutoencoderKLWan, AutoencoderKLLTX2Video),
            schedulers=(DPMSolverFlowScheduler, FlowMatchEulerScheduler),
            encoders=("Gemma2Model",),
        ),
        task="text-to-video",
        tiny_builder=_tiny_sana_video,
        # --quantization keeps the embedders and the output head in full precision. No LoRA or single-file
        # support yet: the loader refuses them naming the DiT.
        dit_facts=DitFacts(
            class_name=SanaVideoTransformer3DModel.diffusers_class_name,
            full_precision_modules=frozenset(
                {"patch_embedding", "time_embed", "caption_projection", "proj_out"}
            ),
        ),
        aliases=("sana_video",),
    ),
)
