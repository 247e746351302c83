"""Whole Z-Image generations: diffserve against Diffusers' ZImagePipeline, same folder and seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline

from diffserve import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.tiny_zimage import build_tiny_zimage

PSNR_BAR_DB = 40.0
PROMPT = "a red fox in the snow"


def _u8(images) -> np.ndarray:
    return np.stack([np.asarray(im) for im in images])


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = build_tiny_zimage(tmp_path_factory.mktemp("zimage"))
    return (
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False),
        ZImagePipeline.from_pretrained(root, torch_dtype=torch.float32),
    )


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
    kwargs = dict(height=height, width=width, num_inference_steps=steps, max_sequence_length=64)
    out = ours.generate(prompt=PROMPT, seed=3, **kwargs, **extra)
    ref_extra = dict(extra)
    n = ref_extra.pop("num_outputs_per_prompt", 1)
    ref = reference(
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
        num_images_per_prompt=n,
        **kwargs,
        **ref_extra,
    ).images
    ours_u8, ref_u8 = _u8(out.images), (ref * 255).round().astype(np.uint8)
    assert ours_u8.shape == ref_u8.shape == (n, height, width, 3)
    assert ref_u8.std() > 5, "the reference image is flat; the comparison would prove nothing"
    value = psnr(ours_u8, ref_u8)
    print(f"Z-Image {height}x{width} {extra}: PSNR {value:.2f} dB")
    assert value >= PSNR_BAR_DB


def test_z_image_cfg_changes_the_image(engines) -> None:
    ours, _ = engines
    kwargs = dict(height=32, width=48, num_inference_steps=3, seed=1)
    guided = ours.generate(prompt=PROMPT, guidance_scale=4.0, negative_prompt="ugly", **kwargs)
    plain = ours.generate(prompt=PROMPT, guidance_scale=0.0, **kwargs)
    assert psnr(_u8(guided.images), _u8(plain.images)) < 35


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
