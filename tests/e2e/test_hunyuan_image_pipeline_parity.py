"""Whole HunyuanImage 2.1 generations: diffserve against Diffusers' `HunyuanImagePipeline`, same tiny folder
and seed, fp32. The tiny guiders start APG at step 0, so three steps run CFG then APG with momentum.

Cases: the guider (CFG + APG) with and without a negative prompt, non-square; a prompt with quoted text
(ByT5 glyphs, the `ocr_guider` at its own scale); a request's guidance_scale replacing the guider's, and 1
(no CFG); two outputs per prompt; requests sharing steps equal to each alone; the guidance-distilled
MeanFlow folder (no guiders, extra's distilled_guidance_scale); the text encoding alone; the refusals.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers import HunyuanImagePipeline as DiffusersHunyuanImage
from diffusers.pipelines.hunyuan_image.pipeline_hunyuanimage import extract_glyph_text

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.hunyuan_image.folder_checks import check_hunyuan_image_folder
from diffserve.families.hunyuan_image.text_encoding import glyph_text
from diffserve.families.hunyuan_image.tiny import TinyHunyuanImageSpec, build_tiny_hunyuan_image
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    diffusers_uint8,
    generator_and_reference,
    stack_uint8,
)

PSNR_BAR_DB = 40.0
PROMPT = "A red fox running in the snow"
GLYPH_PROMPT = "a shop sign that says \"OPEN\" and '24h'"
OTHER_PROMPT = "a blue bird on a branch"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = build_tiny_hunyuan_image(tmp_path_factory.mktemp("hunyuan-image"), TinyHunyuanImageSpec())
    return generator_and_reference(DiffGenerator, root, DiffusersHunyuanImage)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    spec = TinyHunyuanImageSpec(distilled=True, seed=1)
    root = build_tiny_hunyuan_image(tmp_path_factory.mktemp("hunyuan-image-distilled"), spec)
    return generator_and_reference(DiffGenerator, root, DiffusersHunyuanImage)


def _ours(gen: DiffGenerator, **kwargs) -> np.ndarray:
    return stack_uint8(gen.generate_from_params(SamplingParams(**kwargs)).images)


CASES = [
    # (prompt, height, width, our options, Diffusers' options)
    (PROMPT, 32, 64, {}, {}),
    (PROMPT, 64, 32, {"negative_prompt": "blurry"}, {"negative_prompt": "blurry"}),
    (GLYPH_PROMPT, 32, 64, {}, {}),
]


@pytest.mark.parametrize(("prompt", "height", "width", "ours", "theirs"), CASES)
def test_guided_generation_matches_diffusers(base, prompt, height, width, ours, theirs) -> None:
    gen, reference = base
    common = dict(height=height, width=width, num_inference_steps=3)
    got = _ours(gen, prompt=prompt, seed=3, **common, **ours)
    want = diffusers_uint8(reference, seed=3, prompt=prompt, **common, **theirs)
    control = _ours(gen, prompt=OTHER_PROMPT, seed=3, **common, **ours)
    assert_images_match(
        got, want, f"HunyuanImage {prompt!r} {height}x{width} {ours}", min_db=PSNR_BAR_DB, control=control
    )


@pytest.mark.parametrize("scale", [1.0, 7.0])
def test_request_guidance_scale_replaces_the_guiders(base, scale) -> None:
    gen, reference = base
    common = dict(prompt=PROMPT, height=32, width=32, num_inference_steps=3)
    got = _ours(gen, seed=4, guidance_scale=scale, **common)
    default_guider = reference.guider
    reference.guider = default_guider.new(guidance_scale=scale)
    try:
        want = diffusers_uint8(reference, seed=4, **common)
    finally:
        reference.guider = default_guider
    # The control: the guider's own scale (3.5) against 1, no CFG against 7 (the scale acts at step 0 only:
    # the tiny guiders switch to APG, at its own scale, after it).
    control = (
        _ours(gen, seed=4, **common) if scale == 1.0 else _ours(gen, seed=4, guidance_scale=1.0, **common)
    )
    assert_images_match(
        got, want, f"HunyuanImage guidance_scale {scale}", min_db=PSNR_BAR_DB, control=control
    )


def test_two_outputs_per_prompt_match(base) -> None:
    gen, reference = base
    common = dict(prompt=PROMPT, height=32, width=64, num_inference_steps=2)
    got = _ours(gen, seed=2, num_outputs_per_prompt=2, **common)
    want = diffusers_uint8(reference, seed=2, num_images_per_prompt=2, **common)
    assert got.shape[0] == 2
    assert_images_match(got, want, "HunyuanImage 2 per prompt", min_db=PSNR_BAR_DB)


def test_requests_share_steps_and_match_each_alone(base) -> None:
    gen, _ = base
    common = dict(height=32, width=32)
    params = [
        SamplingParams(prompt="a cat", seed=5, num_inference_steps=3, **common),
        SamplingParams(prompt='a "STOP" sign', seed=6, num_inference_steps=2, guidance_scale=1.0, **common),
    ]
    step_sizes = assert_batched_as_alone(gen, params, "HunyuanImage")
    assert step_sizes[0] == 2


@pytest.mark.parametrize("scale", [None, 4.5])
def test_distilled_meanflow_matches_diffusers(distilled, scale) -> None:
    gen, reference = distilled
    common = dict(prompt=GLYPH_PROMPT, height=32, width=64, num_inference_steps=3)
    extra = {} if scale is None else {"distilled_guidance_scale": scale}
    got = _ours(gen, seed=7, extra=extra, **common)
    want = diffusers_uint8(reference, seed=7, distilled_guidance_scale=scale or 3.25, **common)
    control = _ours(gen, seed=7, extra={"distilled_guidance_scale": 9.0}, **common)
    assert_images_match(got, want, f"HunyuanImage distilled {extra}", min_db=PSNR_BAR_DB, control=control)
    with pytest.raises(InvalidRequestError, match="no enabled guider"):
        gen.generate(guidance_scale=2.0, seed=7, **common)


def test_text_encoding_matches_diffusers(base) -> None:
    gen, reference = base
    stage = gen.pipeline.stages[1]
    prompts = [PROMPT, GLYPH_PROMPT, ""]
    got = stage.encode(prompts)
    for prompt, ours in zip(prompts, got, strict=True):
        want = reference.encode_prompt(prompt)
        for name, a, b in zip(("states", "mask", "glyph states", "glyph mask"), ours, want, strict=True):
            torch.testing.assert_close(a.to(b.dtype), b, rtol=1e-5, atol=1e-5, msg=f"{prompt!r} {name}")
    assert got[1].glyph_mask.any() and not got[0].glyph_mask.any()
    for prompt in (PROMPT, GLYPH_PROMPT, "it's 'a' “b” ‘c’ \"d\" and 'a'", "“”"):
        assert glyph_text(prompt) == extract_glyph_text(prompt)


def test_family_options_are_checked(base) -> None:
    gen, _ = base
    common = dict(prompt=PROMPT, height=32, width=32, num_inference_steps=2)
    with pytest.raises(InvalidRequestError, match="extra"):
        gen.generate(extra={"distilled_guidance_scale": 3.0}, **common)
    with pytest.raises(InvalidRequestError, match="true_cfg_scale"):
        gen.generate(true_cfg_scale=4.0, **common)


@pytest.mark.parametrize(
    ("dit_change", "message"),
    [
        ({"patch_size": (1, 2)}, r"patch_size=\[1, 2\] is not square"),
        ({"out_channels": 4}, "out_channels=4 differs from in_channels=8"),
        ({"in_channels": 16, "out_channels": 16}, "in_channels=16 differs from the VAE's latent_channels"),
        ({"text_embed_dim": 16}, "text_embed_dim=16 differs from the text encoder's hidden_size"),
        ({"text_embed_2_dim": 16}, "text_embed_2_dim=16 differs from text_encoder_2's d_model"),
    ],
)
def test_folders_whose_components_do_not_fit_are_refused(base, dit_change, message) -> None:
    """Configs that make Diffusers' pipeline fail mid-generation with a shape error (or, for a patch that is
    not square, run only some sizes) are refused at load, naming the keys; the tiny folder itself fits."""
    gen, _ = base
    dit = gen.pipeline.context.get("transformer").config
    check_hunyuan_image_folder(dit, 8, 32, 32)
    with pytest.raises(ModelLoadError, match=message):
        check_hunyuan_image_folder(dataclasses.replace(dit, **dit_change), 8, 32, 32)
