"""Image-to-image and inpainting on the other image families, served from their text-to-image folders:
diffserve against Diffusers' `StableDiffusion3Img2ImgPipeline` / `StableDiffusion3InpaintPipeline`, `ZImageImg2ImgPipeline` /
`ZImageInpaintPipeline`, `QwenImageImg2ImgPipeline` / `QwenImageInpaintPipeline` on the
same tiny folder, input image, mask and seed (fp32, PSNR >= 40 dB), plus a control run with one input
changed that must score below the bar (so a pass shows the input image and mask are really used).

Diffusers' SD3 inpaint pipeline decodes `latents / scaling_factor` without adding the VAE's
`shift_factor` back (its text-to-image and img2img pipelines add it); diffserve decodes every SD3 output
the same, correct way, so the inpaint reference's latents are decoded as `StableDiffusion3Pipeline` does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    assert_batched_as_alone,
    assert_images_match,
    diffusers_uint8,
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


@dataclass(frozen=True)
class Family:
    build: Callable[[Path], Path]
    img2img: type
    inpaint: type
    max_sequence_length: int
    #: Diffusers' size arguments (Z-Image's encodes the input image at its own size, which is diffserve's
    #: default output size).
    size: dict[str, int]
    #: (strength, extra arguments) of the img2img cases.
    img2img_cases: list[tuple[float, dict[str, object]]]
    #: The inpainting arguments, and the label's words for them.
    inpaint_kwargs: dict[str, object]
    inpaint_label: str
    #: Diffusers' inpainting pixels (default: `reference`).
    inpaint_reference: Callable[..., np.ndarray] | None = None

    def reference(self, pipe, seed: int, **kwargs) -> np.ndarray:
        return diffusers_uint8(
            pipe,
            seed=seed,
            prompt=PROMPT,
            max_sequence_length=self.max_sequence_length,
            **self.size,
            **kwargs,
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


FAMILIES = {
    "sd3": Family(
        lambda root: build_tiny_sd3(root, TinySD3Spec(seed=0)),
        StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline, 24, dict(height=HEIGHT, width=WIDTH),
        [(0.3, {}), (0.8, {"guidance_scale": 1.0})],
        dict(num_inference_steps=3, strength=0.7), "strength 0.7", sd3_inpaint_reference,
    ),
    "z_image": Family(
        build_tiny_zimage, ZImageImg2ImgPipeline, ZImageInpaintPipeline, 64, {},
        [(0.3, {"guidance_scale": 0.0}), (0.8, {"guidance_scale": 3.0})],
        # Z-Image's inpainting default strength is 1.0 (its img2img's 0.6); n=2 with CFG.
        dict(num_inference_steps=3, guidance_scale=2.0), "default strength 1.0",
    ),
    "qwen_image": Family(
        build_tiny_qwen_image, QwenImageImg2ImgPipeline, QwenImageInpaintPipeline, 64,
        dict(height=HEIGHT, width=WIDTH),
        [(0.3, {"true_cfg_scale": 1.0}), (0.8, {"true_cfg_scale": 3.0, "negative_prompt": "blurry"})],
        dict(num_inference_steps=3, strength=0.7, true_cfg_scale=1.0), "strength 0.7",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> Callable[[str], tuple[DiffGenerator, object, object]]:
    """A family's (diffserve generator, Diffusers img2img, Diffusers inpaint) on one tiny folder (made once)."""
    cache: dict[str, tuple[DiffGenerator, object, object]] = {}

    def get(family: str) -> tuple[DiffGenerator, object, object]:
        if family not in cache:
            spec = FAMILIES[family]
            root = spec.build(tmp_path_factory.mktemp(f"tiny-{family}-i2i"))
            ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
            img2img = spec.img2img.from_pretrained(root, torch_dtype=torch.float32)
            cache[family] = (ours, img2img, spec.inpaint(**img2img.components))
        return cache[family]

    return get


IMG2IMG = [(family, *case) for family, spec in FAMILIES.items() for case in spec.img2img_cases]


@pytest.mark.parametrize(("family", "strength", "extra"), IMG2IMG)
def test_img2img_matches_diffusers(pipelines, family: str, strength: float, extra: dict) -> None:
    spec = FAMILIES[family]
    ours, img2img, _ = pipelines(family)
    kwargs = dict(num_inference_steps=3, **extra)
    length = dict(max_sequence_length=spec.max_sequence_length)
    out = ours.generate(prompt=PROMPT, image=IMAGE, strength=strength, seed=5, **length, **kwargs)
    ref = spec.reference(img2img, 5, image=IMAGE, strength=strength, **kwargs)
    other = stack_uint8(
        ours.generate(prompt=PROMPT, seed=5, height=HEIGHT, width=WIDTH, **length, **kwargs).images
    )
    label = f"{family.replace('_', '-')} img2img strength {strength} {extra}"
    assert_images_match(stack_uint8(out.images), ref, label, min_db=PSNR_BAR_DB, control=other)


@pytest.mark.parametrize("family", FAMILIES)
def test_inpaint_two_outputs_match_diffusers(pipelines, family: str) -> None:
    spec = FAMILIES[family]
    ours, _, inpaint = pipelines(family)
    kwargs = spec.inpaint_kwargs
    common = dict(prompt=PROMPT, image=IMAGE, seed=4, num_outputs_per_prompt=2)
    length = dict(max_sequence_length=spec.max_sequence_length)
    out = ours.generate(mask=MASK, **common, **length, **kwargs)
    reference = spec.inpaint_reference or spec.reference
    ref = reference(inpaint, 4, image=IMAGE, mask_image=MASK, num_images_per_prompt=2, **kwargs)
    other = stack_uint8(ours.generate(**common, **length, **kwargs).images)
    label = f"{family.replace('_', '-')} inpaint n=2 {spec.inpaint_label}"
    assert_images_match(stack_uint8(out.images), ref, label, min_db=PSNR_BAR_DB, control=other)


# -- batch invariance on the spatial-latent families (FLUX's: test_flux_img2img_inpaint_parity.py) -----
@pytest.mark.parametrize("family", ["sd3", "z_image", "qwen_image"])
def test_mixed_strengths_share_steps_and_match_each_run_alone(pipelines, family: str) -> None:
    """Text-to-image, img2img and inpainting requests start at different steps of their schedules, share
    DiT batches, and each one's pixels are what it gives alone."""
    ours = pipelines(family)[0]
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

    def check_prepared(running: list[Req]) -> None:
        assert [r.num_steps for r in running] == [4, 2, 3]

    assert max(assert_batched_as_alone(ours, params, family, check_prepared)) == 3
