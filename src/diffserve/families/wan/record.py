"""The Wan family's records (Wan 2.1 and 2.2): text-to-video (`WanPipeline`, also Wan 2.2 A14B's two
experts and TI2V-5B) and image-to-video (`WanImageToVideoPipeline`), which share the Wan DiT's facts; and
SkyReels-V2's (`SkyReelsV2Pipeline`, `SkyReelsV2ImageToVideoPipeline`, and the diffusion-forcing text-,
image- and video-to-video pipelines): Wan 2.1's pipelines over its own
DiT (Wan's with float64 timestep sinusoids, fps injection and block-causal attention)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.families.wan.lora_rules import WAN_RULES
from diffserve.families.wan.pipeline import WanImageToVideoPipeline, WanPipeline
from diffserve.families.wan.single_file_keys import wan_plan
from diffserve.families.wan.skyreels_v2 import (
    SkyReelsV2DiffusionForcingImageToVideoPipeline,
    SkyReelsV2DiffusionForcingPipeline,
    SkyReelsV2ImageToVideoPipeline,
    SkyReelsV2Pipeline,
)
from diffserve.families.wan.skyreels_v2_v2v import SkyReelsV2DiffusionForcingVideoToVideoPipeline
from diffserve.loader.dit_facts import DitFacts, LoraFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.skyreels_v2 import SkyReelsV2Transformer3DModel
from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan


def _tiny_wan(out_dir: Path, options: TinyCheckpointOptions, image_to_video: bool) -> Path:
    """A Wan text-to-video or image-to-video folder (Wan 2.1, or `options.wan_variant`). Imports its module
    when called (transformers model classes the registry does not need)."""
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    spec = TinyWanSpec(
        image_to_video=image_to_video,
        scheduler=options.scheduler,
        seed=options.seed,
        variant=options.wan_variant,
    )
    return build_tiny_wan(out_dir, spec)


def _tiny_skyreels_v2(
    out_dir: Path,
    options: TinyCheckpointOptions,
    image_to_video: bool,
    diffusion_forcing: bool = False,
    video_to_video: bool = False,
) -> Path:
    """A SkyReels-V2 text-to-video, image-to-video or diffusion-forcing (text-, image- or video-to-video)
    folder; imports its module when called."""
    from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2

    spec = TinySkyReelsV2Spec(
        image_to_video=image_to_video,
        diffusion_forcing=diffusion_forcing,
        video_to_video=video_to_video,
        seed=options.seed,
    )
    return build_tiny_skyreels_v2(out_dir, spec)


_CLASSES = NativeClasses.of(
    models=(WanTransformer3DModel, AutoencoderKLWan),
    schedulers=(UniPCFlowScheduler, FlowMatchEulerScheduler),
    encoders=("UMT5EncoderModel", "CLIPVisionModel"),
)
_DIT_FACTS = DitFacts(
    class_name=WanTransformer3DModel.diffusers_class_name,
    full_precision_modules=frozenset({"condition_embedder", "proj_out"}),
    lora=LoraFacts(rules=tuple(WAN_RULES)),
    single_file=SingleFileKeys(
        "Wan",
        wan_plan,
        gguf_arches=("wan",),
        markers=("head.head.", "text_embedding.", "condition_embedder.", "patch_embedding."),
    ),
)

_WAN_T2V = ModelFamily(
    name="wan-t2v",
    diffusers_pipeline="WanPipeline",
    pipeline_cls=WanPipeline,
    native_classes=_CLASSES,
    task="text-to-video",
    tiny_builder=partial(_tiny_wan, image_to_video=False),
    dit_facts=_DIT_FACTS,
)

FAMILIES: tuple[ModelFamily, ...] = (
    _WAN_T2V,
    replace(
        _WAN_T2V,
        name="wan-i2v",
        diffusers_pipeline="WanImageToVideoPipeline",
        pipeline_cls=WanImageToVideoPipeline,
        task="image-to-video",
        tiny_builder=partial(_tiny_wan, image_to_video=True),
    ),
)

_SKYREELS_V2_T2V = ModelFamily(
    name="skyreels-v2",
    diffusers_pipeline="SkyReelsV2Pipeline",
    pipeline_cls=SkyReelsV2Pipeline,
    native_classes=NativeClasses.of(
        models=(SkyReelsV2Transformer3DModel, AutoencoderKLWan),
        schedulers=(UniPCFlowScheduler, FlowMatchEulerScheduler),
        encoders=("UMT5EncoderModel", "T5EncoderModel", "CLIPVisionModelWithProjection", "CLIPVisionModel"),
    ),
    task="text-to-video",
    tiny_builder=partial(_tiny_skyreels_v2, image_to_video=False),
    dit_facts=DitFacts(
        class_name=SkyReelsV2Transformer3DModel.diffusers_class_name,
        full_precision_modules=frozenset(
            {"condition_embedder", "proj_out", "fps_embedding", "fps_projection"}
        ),
        # Wan's module names: Diffusers converts SkyReels-V2's musubi and original-name files as Wan's.
        lora=LoraFacts(rules=tuple(WAN_RULES)),
    ),
    aliases=("skyreels-v2-t2v", "skyreels_v2"),
)

FAMILIES += (
    _SKYREELS_V2_T2V,
    replace(
        _SKYREELS_V2_T2V,
        name="skyreels-v2-i2v",
        diffusers_pipeline="SkyReelsV2ImageToVideoPipeline",
        pipeline_cls=SkyReelsV2ImageToVideoPipeline,
        task="image-to-video",
        tiny_builder=partial(_tiny_skyreels_v2, image_to_video=True),
        aliases=("skyreels_v2_i2v",),
    ),
    replace(
        _SKYREELS_V2_T2V,
        name="skyreels-v2-df",
        diffusers_pipeline="SkyReelsV2DiffusionForcingPipeline",
        pipeline_cls=SkyReelsV2DiffusionForcingPipeline,
        tiny_builder=partial(_tiny_skyreels_v2, image_to_video=False, diffusion_forcing=True),
        aliases=("skyreels_v2_df",),
    ),
    replace(
        _SKYREELS_V2_T2V,
        name="skyreels-v2-df-i2v",
        diffusers_pipeline="SkyReelsV2DiffusionForcingImageToVideoPipeline",
        pipeline_cls=SkyReelsV2DiffusionForcingImageToVideoPipeline,
        task="image-to-video",
        tiny_builder=partial(_tiny_skyreels_v2, image_to_video=True, diffusion_forcing=True),
        aliases=("skyreels_v2_df_i2v",),
    ),
    replace(
        _SKYREELS_V2_T2V,
        name="skyreels-v2-df-v2v",
        diffusers_pipeline="SkyReelsV2DiffusionForcingVideoToVideoPipeline",
        pipeline_cls=SkyReelsV2DiffusionForcingVideoToVideoPipeline,
        task="video-to-video",
        tiny_builder=partial(
            _tiny_skyreels_v2, image_to_video=False, diffusion_forcing=True, video_to_video=True
        ),
        aliases=("skyreels_v2_df_v2v",),
    ),
)
