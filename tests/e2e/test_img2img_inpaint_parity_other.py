"""Image-to-image and inpainting on the other image families, served from their text-to-image folders:
diffserve against Diffusers' `StableDiffusion3Img2ImgPipeline` / `StableDiffusion3InpaintPipeline`, `ZImageImg2ImgPipeline` /
`ZImageInpaintPipeline`, `QwenImageImg2ImgPipeline` / `QwenImageInpaintPipeline` on the
same tiny folder, input image, mask and seed (fp32, PSNR >= 40 dB), plus a control run with one input
changed that must score below the bar (so a pass shows the input image and mask are really used).

Diffusers' SD3 inpaint pipeline decodes `latents / scaling_factor` without adding the VAE's
`shift_factor` back (its text-to-image and img2img pipelines add it); diffserve decodes every SD3 output
the same, correct way, so the inpaint reference's latents are decoded as `StableDiffusion3Pipeline` does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (
    QwenImageImg2ImgPipeline,
    QwenImageInpaintPipeline,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    ZImageImg2ImgPipeline,
    ZImageInpaintPipeline,
)
from PIL import Image

from diffserve import DiffGenerator, SamplingParams
from diffserve.families.qwen_image.tiny import build_tiny_qwen_image
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.request import Req
from diffserve.testing.parity import (
    assert_images_match,
    denoise_together,
    diffusers_uint8,
    max_pixel_diff,
    smooth_random_image,
    stack_uint8,
    to_uint8,
)

PSNR_BAR_DB = 40.0
PROMPT = "a fox in the snow"
HEIGHT, WIDTH = 32, 48


IMAGE = smooth_random_image(WIDTH, HEIGHT, seed=1)
MASK = Image.new("L", (WIDTH, HEIGHT), 0)
MASK.paste(255, (8, 8, 32, 24))


def assert_matches(ours_u8: np.ndarray, ref_u8: np.ndarray, label: str, other: np.ndarray) -> None:
    assert_images_match(ours_u8, ref_u8, label, min_db=PSNR_BAR_DB, control=other)


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    root = build_tiny_sd3(tmp_path_factory.mktemp("tiny-sd3-i2i"), TinySD3Spec(seed=0))
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    img2img = StableDiffusion3Img2ImgPipeline.from_pretrained(root, torch_dtype=torch.float32)
    return ours, img2img, StableDiffusion3InpaintPipeline(**img2img.components)


def sd3_reference(pipe, seed: int, **kwargs) -> np.ndarray:
    return diffusers_uint8(
        pipe, seed=seed, prompt=PROMPT, height=HEIGHT, width=WIDTH, max_sequence_length=24, **kwargs
    )


def sd3_inpaint_reference(pipe, seed: int, **kwargs) -> np.ndarray:
    """Diffusers' inpainting latents, decoded with the shift factor (see the module docstring)."""
    latents = pipe(
        prompt=PROMPT,
        height=HEIGHT,
        width=WIDTH,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="latent",
        max_sequence_length=24,
        **kwargs,
    ).images
    with torch.no_grad():
        config = pipe.vae.config
        pixels = pipe.vae.decode(latents / config.scaling_factor + config.shift_factor, return_dict=False)[0]
    return to_uint8(pipe.image_processor.postprocess(pixels, output_type="np"))


@pytest.mark.parametrize(("strength", "extra"), [(0.3, {}), (0.8, {"guidance_scale": 1.0})])
def test_sd3_img2img_matches_diffusers(sd3, strength, extra) -> None:
    ours, img2img, _ = sd3
    kwargs = dict(num_inference_steps=3, **extra)
    out = ours.generate(
        prompt=PROMPT, image=IMAGE, strength=strength, seed=5, max_sequence_length=24, **kwargs
    )
    ref = sd3_reference(img2img, 5, image=IMAGE, strength=strength, **kwargs)
    other = stack_uint8(
        ours.generate(
            prompt=PROMPT, seed=5, height=HEIGHT, width=WIDTH, max_sequence_length=24, **kwargs
        ).images
    )
    assert_matches(stack_uint8(out.images), ref, f"sd3 img2img strength {strength} {extra}", other)


def test_sd3_inpaint_two_outputs_match_diffusers(sd3) -> None:
    ours, _, inpaint = sd3
    kwargs = dict(num_inference_steps=3, strength=0.7)
    out = ours.generate(
        prompt=PROMPT,
        image=IMAGE,
        mask=MASK,
        seed=4,
        num_outputs_per_prompt=2,
        max_sequence_length=24,
        **kwargs,
    )
    ref = sd3_inpaint_reference(inpaint, 4, image=IMAGE, mask_image=MASK, num_images_per_prompt=2, **kwargs)
    other = stack_uint8(
        ours.generate(
            prompt=PROMPT, image=IMAGE, seed=4, num_outputs_per_prompt=2, max_sequence_length=24, **kwargs
        ).images
    )
    assert_matches(stack_uint8(out.images), ref, "sd3 inpaint n=2 strength 0.7", other)


# -- Z-Image: Diffusers encodes the input image at its own size, which is diffserve's default output size.
@pytest.fixture(scope="module")
def z_image(tmp_path_factory):
    root = build_tiny_zimage(tmp_path_factory.mktemp("tiny-zimage-i2i"))
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    img2img = ZImageImg2ImgPipeline.from_pretrained(root, torch_dtype=torch.float32)
    return ours, img2img, ZImageInpaintPipeline(**img2img.components)


def z_image_reference(pipe, seed: int, **kwargs) -> np.ndarray:
    return diffusers_uint8(pipe, seed=seed, prompt=PROMPT, max_sequence_length=64, **kwargs)


@pytest.mark.parametrize(
    ("strength", "extra"), [(0.3, {"guidance_scale": 0.0}), (0.8, {"guidance_scale": 3.0})]
)
def test_z_image_img2img_matches_diffusers(z_image, strength, extra) -> None:
    ours, img2img, _ = z_image
    kwargs = dict(num_inference_steps=3, max_sequence_length=64, **extra)
    out = ours.generate(prompt=PROMPT, image=IMAGE, strength=strength, seed=5, **kwargs)
    ref = z_image_reference(img2img, 5, image=IMAGE, strength=strength, num_inference_steps=3, **extra)
    other = stack_uint8(ours.generate(prompt=PROMPT, seed=5, height=HEIGHT, width=WIDTH, **kwargs).images)
    assert_matches(stack_uint8(out.images), ref, f"z-image img2img strength {strength} {extra}", other)


def test_z_image_inpaint_matches_diffusers(z_image) -> None:
    """Z-Image's inpainting default strength is 1.0 (its img2img's 0.6); n=2 with CFG."""
    ours, _, inpaint = z_image
    kwargs = dict(num_inference_steps=3, guidance_scale=2.0)
    out = ours.generate(
        prompt=PROMPT,
        image=IMAGE,
        mask=MASK,
        seed=4,
        num_outputs_per_prompt=2,
        max_sequence_length=64,
        **kwargs,
    )
    ref = z_image_reference(inpaint, 4, image=IMAGE, mask_image=MASK, num_images_per_prompt=2, **kwargs)
    other = stack_uint8(
        ours.generate(
            prompt=PROMPT, image=IMAGE, seed=4, num_outputs_per_prompt=2, max_sequence_length=64, **kwargs
        ).images
    )
    assert_matches(stack_uint8(out.images), ref, "z-image inpaint n=2 default strength 1.0", other)


# -- Qwen-Image ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_image(tmp_path_factory):
    root = build_tiny_qwen_image(tmp_path_factory.mktemp("tiny-qwen-i2i"))
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    img2img = QwenImageImg2ImgPipeline.from_pretrained(root, torch_dtype=torch.float32)
    return ours, img2img, QwenImageInpaintPipeline(**img2img.components)


def qwen_reference(pipe, seed: int, **kwargs) -> np.ndarray:
    return diffusers_uint8(
        pipe, seed=seed, prompt=PROMPT, height=HEIGHT, width=WIDTH, max_sequence_length=64, **kwargs
    )


@pytest.mark.parametrize(
    ("strength", "extra"),
    [(0.3, {"true_cfg_scale": 1.0}), (0.8, {"true_cfg_scale": 3.0, "negative_prompt": "blurry"})],
)
def test_qwen_image_img2img_matches_diffusers(qwen_image, strength, extra) -> None:
    ours, img2img, _ = qwen_image
    kwargs = dict(num_inference_steps=3, **extra)
    out = ours.generate(
        prompt=PROMPT, image=IMAGE, strength=strength, seed=5, max_sequence_length=64, **kwargs
    )
    ref = qwen_reference(img2img, 5, image=IMAGE, strength=strength, **kwargs)
    other = stack_uint8(
        ours.generate(
            prompt=PROMPT, seed=5, height=HEIGHT, width=WIDTH, max_sequence_length=64, **kwargs
        ).images
    )
    assert_matches(stack_uint8(out.images), ref, f"qwen-image img2img strength {strength} {extra}", other)


def test_qwen_image_inpaint_two_outputs_match_diffusers(qwen_image) -> None:
    ours, _, inpaint = qwen_image
    kwargs = dict(num_inference_steps=3, strength=0.7, true_cfg_scale=1.0)
    out = ours.generate(
        prompt=PROMPT,
        image=IMAGE,
        mask=MASK,
        seed=4,
        num_outputs_per_prompt=2,
        max_sequence_length=64,
        **kwargs,
    )
    ref = qwen_reference(inpaint, 4, image=IMAGE, mask_image=MASK, num_images_per_prompt=2, **kwargs)
    other = stack_uint8(
        ours.generate(
            prompt=PROMPT, image=IMAGE, seed=4, num_outputs_per_prompt=2, max_sequence_length=64, **kwargs
        ).images
    )
    assert_matches(stack_uint8(out.images), ref, "qwen-image inpaint n=2 strength 0.7", other)


# -- batch invariance on the spatial-latent families (FLUX's: test_flux_img2img_inpaint_parity.py) -----
@pytest.mark.parametrize("family", ["sd3", "z_image", "qwen_image"])
def test_mixed_strengths_share_steps_and_match_each_run_alone(request, family) -> None:
    """Text-to-image, img2img and inpainting requests start at different steps of their schedules, share
    DiT batches, and each one's pixels are what it gives alone."""
    ours = request.getfixturevalue(family)[0]
    pipeline = ours.pipeline
    base = dict(height=HEIGHT, width=WIDTH, num_inference_steps=4, max_sequence_length=24)
    params = [
        SamplingParams(prompt="a", seed=1, **base),
        SamplingParams(prompt="b", seed=2, input_images=[IMAGE], strength=0.5, **base),
        SamplingParams(
            prompt="c",
            seed=3,
            input_images=[smooth_random_image(WIDTH, HEIGHT, 4)],
            mask_image=MASK,
            strength=0.7,
            **base,
        ),
    ]
    alone = [stack_uint8(ours.generate_from_params(p).images) for p in params]
    running = [pipeline.run_pre_denoise(pipeline.validate(Req(params=p))) for p in params]
    assert [r.num_steps for r in running] == [4, 2, 3]
    assert len({pipeline.batch_key(r) for r in running}) == 1
    done, step_sizes = denoise_together(pipeline, running)
    assert max(step_sizes) == 3
    for p, want in zip(params, alone, strict=True):
        got = stack_uint8(done[p.prompt].outputs.images)
        diff = max_pixel_diff(got, want)
        print(f"{family} batched vs alone {p.prompt!r} (strength {p.strength}): max diff {diff}")
        assert diff <= 1
