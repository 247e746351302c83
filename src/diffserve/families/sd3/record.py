"""The Stable Diffusion 3 / 3.5 family's record (`StableDiffusion3Pipeline`)."""

from __future__ import annotations

from pathlib import Path

from diffserve.families.record import ModelFamily, TinyCheckpointOptions
from diffserve.families.sd3.pipeline import SD3Pipeline
from diffserve.families.sd3.single_file_keys import sd3_plan
from diffserve.loader.dit_facts import DitFacts, LoraFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL

#: The tiny DiT's position table of `make-tiny sd3`, in patches a side: 32 patches of 16 pixels take up to
#: 512 x 512 pixels, the server's largest memory-calibration probe (`runtime/memory.py`), which a smaller
#: table refuses (SD3's largest side, `families/sd3/validation.py`). The tests' `TinySD3Spec` keeps 16.
MAKE_TINY_POS_EMBED_MAX_SIZE = 32


def _tiny_sd3(out_dir: Path, options: TinyCheckpointOptions) -> Path:
    """SD3, or with `options.sd35` the SD3.5 layout (qk RMSNorm, dual attention in block 0). Imports its
    module when called (transformers model classes the registry does not need)."""
    from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3

    table = MAKE_TINY_POS_EMBED_MAX_SIZE
    if options.sd35:
        return build_tiny_sd3(
            out_dir,
            TinySD3Spec(
                seed=options.seed, qk_norm="rms_norm", dual_attention_layers=(0,), pos_embed_max_size=table
            ),
        )
    return build_tiny_sd3(out_dir, TinySD3Spec(seed=options.seed, pos_embed_max_size=table))


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="sd3",
        diffusers_pipeline="StableDiffusion3Pipeline",
        pipeline_cls=SD3Pipeline,
        native_classes=NativeClasses.of(
            models=(SD3Transformer2DModel, AutoencoderKL),
            schedulers=(FlowMatchEulerScheduler,),
            encoders=("CLIPTextModelWithProjection", "T5EncoderModel"),
        ),
        task="text-to-image",
        tiny_builder=_tiny_sd3,
        dit_facts=DitFacts(
            class_name=SD3Transformer2DModel.diffusers_class_name,
            full_precision_modules=frozenset({"time_text_embed", "context_embedder", "norm_out", "proj_out"}),
            lora=LoraFacts(components=("transformer", "text_encoder", "text_encoder_2")),
            single_file=SingleFileKeys(
                "SD3", sd3_plan, gguf_arches=("sd3",), markers=("joint_blocks.", "pos_embed.pos_embed")
            ),
        ),
    ),
)
