"""Whole Z-Image generations: diffserve against Diffusers' ZImagePipeline, same folder and seed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import ZImageImg2ImgPipeline, ZImagePipeline
from transformers import PretrainedConfig

from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.z_image.pipeline import ZImagePipeline as NativeZImagePipeline
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.loader.component_loader import LoadedComponent
from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.pipelines.base import PipelineContext
from diffserve.platforms.cpu import CpuPlatform
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import (
    assert_generation_matches,
    assert_images_match,
    diffusers_uint8,
    generator_and_reference,
    smooth_random_image,
    stack_uint8,
)

PSNR_BAR_DB = 40.0
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = build_tiny_zimage(tmp_path_factory.mktemp("zimage"))
    return generator_and_reference(DiffGenerator, root, ZImagePipeline)


@pytest.mark.parametrize(
    ("height", "width", "steps", "extra"),
    [
        (64, 48, 3, {"guidance_scale": 4.0, "negative_prompt": "blurry"}),  # CFG, non-square
        (48, 80, 2, {"guidance_scale": 0.0}),  # no CFG (Turbo usage), non-square
        (32, 32, 2, {"guidance_scale": 2.0, "num_outputs_per_prompt": 2}),  # CFG with the default "" negative
    ],
)
def test_z_image_pixels_match_diffusers(engines, height, width, steps, extra) -> None:
    ours, reference = engines
    kwargs = dict(height=height, width=width, num_inference_steps=steps, max_sequence_length=64, **extra)
    label = f"Z-Image {height}x{width} {extra}"
    assert_generation_matches(ours, reference, label, min_db=PSNR_BAR_DB, prompt=PROMPT, seed=3, **kwargs)


def test_z_image_cfg_changes_the_image(engines) -> None:
    ours, _ = engines
    kwargs = dict(height=32, width=48, num_inference_steps=3, seed=1)
    guided = ours.generate(prompt=PROMPT, guidance_scale=4.0, negative_prompt="ugly", **kwargs)
    plain = ours.generate(prompt=PROMPT, guidance_scale=0.0, **kwargs)
    assert psnr(stack_uint8(guided.images), stack_uint8(plain.images)) < 35


def test_z_image_text_encoding_matches_diffusers(engines) -> None:
    """diffserve pads prompts to the batch's longest, Diffusers to max_sequence_length: same real tokens."""
    ours, reference = engines
    stage = next(s for s in ours.pipeline.stages if s.name == "ZImageTextEncodingStage")
    prompts = ["a red fox", "a much longer prompt about a blue bird on a branch"]
    embeds = stage.encode(prompts, max_sequence_length=512)
    ref, _ = reference.encode_prompt(
        prompt=list(prompts), device=torch.device("cpu"), do_classifier_free_guidance=False
    )
    for ours_embeds, ref_embeds in zip(embeds, ref, strict=True):
        assert ours_embeds.shape == ref_embeds.shape
        torch.testing.assert_close(ours_embeds, ref_embeds, rtol=1e-5, atol=1e-5)


def test_z_image_rejects_true_cfg_scale(engines) -> None:
    ours, _ = engines
    with pytest.raises(InvalidRequestError, match="true_cfg_scale.*guidance_scale") as info:
        ours.generate(prompt=PROMPT, true_cfg_scale=4.0, height=32, width=32, num_inference_steps=1)
    assert info.value.param == "true_cfg_scale"


@pytest.mark.parametrize(
    ("settings", "img2img"),
    [
        # CFG dropped at the last of 4 steps (DiT time 0.5 > 0.3), as Diffusers' ZImagePipeline does
        ({"cfg_truncation": 0.3}, False),
        # the guided prediction's norm capped at 0.8x the prompt branch's
        ({"cfg_normalization": 0.8}, False),
        # Diffusers' bool spelling (true is 1.0) with a truncation that keeps every step
        ({"cfg_normalization": True, "cfg_truncation": 0.9}, False),
        # image-to-image keeps the last 3 of 4 steps: the per-step scales are cut with the schedule
        ({"cfg_truncation": 0.2}, True),
    ],
)
def test_z_image_cfg_settings_match_diffusers(engines, settings, img2img) -> None:
    """Diffusers' `cfg_truncation` and `cfg_normalization` keywords, sent in `extra`; the output without
    them is the control (far below the bar: the settings are really applied)."""
    ours, reference = engines
    kwargs = dict(num_inference_steps=4, guidance_scale=6.0, negative_prompt="blurry", max_sequence_length=64)
    if img2img:
        image = smooth_random_image(48, 32, seed=1)
        kwargs.update(image=image, strength=0.6)
        reference = ZImageImg2ImgPipeline.from_pipe(reference)
    else:
        kwargs.update(height=32, width=48)
    got = stack_uint8(ours.generate(prompt=PROMPT, seed=2, extra=settings, **kwargs).images)
    want = diffusers_uint8(reference, seed=2, prompt=PROMPT, **kwargs, **settings)
    control = stack_uint8(ours.generate(prompt=PROMPT, seed=2, **kwargs).images)
    label = f"Z-Image {settings} img2img={img2img}"
    assert_images_match(got, want, label, min_db=PSNR_BAR_DB, shape=(1, 32, 48, 3), control=control)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"cfg_truncation": "late"}, "cfg_truncation"),
        ({"cfg_normalization": "yes"}, "cfg_normalization"),
        ({"cfg_renorm_min": 0.5}, "unknown setting.*cfg_renorm_min"),
    ],
)
def test_z_image_refuses_bad_settings(engines, extra, match) -> None:
    ours, _ = engines
    with pytest.raises(InvalidRequestError, match=match) as info:
        ours.generate(prompt=PROMPT, height=32, width=32, num_inference_steps=1, extra=extra)
    assert info.value.param == "extra"


#: A tiny DiT that fits a 32-wide text encoder and a 16-channel VAE; each refusal case changes config keys.
FIT_DIT = {"dim": 32, "n_layers": 1, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "cap_feat_dim": 32,
           "axes_dims": [4, 6, 6], "axes_lens": [64, 32, 32]}  # fmt: skip


@pytest.mark.parametrize(
    ("dit", "latent_channels", "text_width", "message"),
    [
        # Diffusers' pipeline runs the DiT at patch 2-1: an assertion in its forward without that pair
        ({"all_patch_size": [1], "all_f_patch_size": [1]}, 16, 32, "have no 2-1 pair"),
        ({"in_channels": 8}, 16, 32, "in_channels=8 differs from the VAE's latent_channels=16"),
        ({}, 16, 48, "cap_feat_dim=32 differs from the text encoder's hidden_size=48"),
    ],
)
def test_z_image_refuses_a_folder_whose_components_do_not_fit(
    dit, latent_channels, text_width, message
) -> None:
    """Configs Diffusers' ZImagePipeline fails on mid-generation are refused when the folder loads, naming the
    keys: the pipeline built from a DiT made on the meta device and config-only VAE and text-encoder
    stand-ins (the checks read only configs, before any stage is built)."""
    with torch.device("meta"):
        transformer = ZImageTransformer2DModel.from_config({**FIT_DIT, **dit})
    values = {
        "transformer": transformer,
        "vae": SimpleNamespace(config={"latent_channels": latent_channels, "block_out_channels": [16, 32]}),
        "text_encoder": SimpleNamespace(config=PretrainedConfig(hidden_size=text_width)),
        "scheduler": None,
    }
    components = {name: LoadedComponent(name, type(v).__name__, v) for name, v in values.items()}
    with pytest.raises(ModelLoadError, match=message):
        NativeZImagePipeline(PipelineContext(components, CpuPlatform(), torch.float32))
