"""The FLUX.1 family's records: text-to-image (`FluxPipeline`), Kontext editing and Fill inpainting, which
share the FLUX.1 DiT and its loader facts."""

from __future__ import annotations

from dataclasses import replace

from diffserve.families.flux.fill_pipeline import FluxFillPipeline
from diffserve.families.flux.kontext_pipeline import FluxKontextPipeline
from diffserve.families.flux.lora_formats import convert_flux_lora
from diffserve.families.flux.pipeline import FluxPipeline
from diffserve.families.record import ModelFamily, lazy_tiny_builder
from diffserve.loader.dit_facts import DitFacts, LoraFacts, SingleFileKeys
from diffserve.loader.native_classes import NativeClasses
from diffserve.loader.single_file_keys.bfl import bfl_plan
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.runtime.cuda_graph.padders import FixedLengthPadder

# Each tiny builder imports its module when called: those import transformers model classes that loading
# the registry (every engine start) does not need.


_CLASSES = NativeClasses.of(
    models=(FluxTransformer2DModel, AutoencoderKL),
    schedulers=(FlowMatchEulerScheduler,),
    encoders=("CLIPTextModel", "T5EncoderModel"),
)
_DIT_FACTS = DitFacts(
    class_name=FluxTransformer2DModel.diffusers_class_name,
    full_precision_modules=frozenset(
        {"time_text_embed", "context_embedder", "x_embedder", "norm_out", "proj_out"}
    ),
    lora=LoraFacts(
        components=("transformer", "text_encoder"), first_alpha_fill=True, community=convert_flux_lora
    ),
    single_file=SingleFileKeys(
        "FLUX.1", bfl_plan, gguf_arches=("flux",), markers=("double_blocks.", "single_transformer_blocks.")
    ),
)

_FLUX = ModelFamily(
    name="flux",
    diffusers_pipeline="FluxPipeline",
    pipeline_cls=FluxPipeline,
    native_classes=_CLASSES,
    task="text-to-image",
    tiny_builder=lazy_tiny_builder(
        "diffserve.families.flux.tiny", "build_tiny_flux", "TinyFluxSpec", ("guidance_embeds",)
    ),
    dit_facts=_DIT_FACTS,
    extra_tiny_builders=(
        (
            "flux-controlnet",
            lazy_tiny_builder(
                "diffserve.families.flux.tiny_controlnet",
                "build_tiny_flux_controlnet_for",
                "TinyFluxSpec",
                ("guidance_embeds",),
            ),
        ),
    ),
    # T5 runs at its max_sequence_length: only the batch is padded.
    prompt_padder=FixedLengthPadder(
        rows_from="hidden_states",
        batch_tensors=(
            "hidden_states",
            "encoder_hidden_states",
            "context",
            "pooled_projections",
            "timestep",
            "guidance",
        ),
    ),  # fmt: skip
)

FAMILIES: tuple[ModelFamily, ...] = (
    _FLUX,
    replace(
        _FLUX,
        name="flux-kontext",
        diffusers_pipeline="FluxKontextPipeline",
        pipeline_cls=FluxKontextPipeline,
        task="image-edit",
        tiny_builder=lazy_tiny_builder(
            "diffserve.families.flux.tiny_kontext",
            "build_tiny_flux_kontext",
            "TinyFluxSpec",
            ("guidance_embeds",),
        ),
        aliases=("kontext", "flux_kontext"),
        extra_tiny_builders=(),
    ),
    replace(
        _FLUX,
        name="flux-fill",
        diffusers_pipeline="FluxFillPipeline",
        pipeline_cls=FluxFillPipeline,
        task="image-edit",
        tiny_builder=lazy_tiny_builder(
            "diffserve.families.flux.tiny_fill", "build_tiny_flux_fill", "TinyFluxSpec", ("guidance_embeds",)
        ),
        aliases=("flux_fill",),
        extra_tiny_builders=(),
    ),
)
