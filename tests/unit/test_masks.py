"""Inpainting masks and strength: the two mask conventions, Diffusers' mask processing and schedule
truncation, and the 400s (InvalidRequestError naming `mask` or `strength`) for requests a family cannot
run. No model is loaded: the rules are checked on `ImageInputRule` and `SamplingParams` directly."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import load_image, load_images
from diffserve.masks import edit_mask, pipeline_mask
from diffserve.stages.image_to_image import first_kept_step, input_image_size, kept_steps
from diffserve.stages.input_validation import ImageInputRule
from diffserve.stages.mask_preparation import mask_pixels

IMAGE = Image.new("RGB", (40, 24), (10, 20, 30))
FLUX_LIKE = ImageInputRule(pipeline_name="FluxPipeline", max_images=1, inpainting=True, default_strength=0.6)
T2I_ONLY = ImageInputRule(pipeline_name="WanPipeline")
EDIT_ONLY = ImageInputRule(pipeline_name="FluxKontextPipeline", task="image-edit", min_images=1, max_images=1)
FILL_LIKE = ImageInputRule(
    pipeline_name="FluxFillPipeline", min_images=1, max_images=1, inpainting=True, default_strength=1.0,
    mask_required=True,
)  # fmt: skip


def params(**kwargs) -> SamplingParams:
    return SamplingParams(prompt="p", num_inference_steps=4, **kwargs)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_alpha_mask_transparent_pixels_are_the_edit_area() -> None:
    mask = Image.new("RGBA", (8, 4), (255, 255, 255, 255))  # white but opaque: keep
    mask.putpixel((1, 2), (0, 0, 0, 0))  # transparent: edit, whatever its colour
    mask.putpixel((3, 1), (0, 0, 0, 128))  # half transparent: keep (only alpha 0 is edited)
    out = np.asarray(edit_mask(mask))
    assert out.dtype == np.uint8 and out.shape == (4, 8)
    assert out[2, 1] == 255 and out.sum() == 255


def test_black_and_white_mask_white_is_the_edit_area() -> None:
    mask = Image.new("RGB", (8, 4), (0, 0, 0))
    mask.putpixel((5, 0), (255, 255, 255))
    assert edit_mask(mask).mode == "L" and np.asarray(edit_mask(mask))[0, 5] == 255
    # An RGBA mask with no transparent pixel is read by its luminance, as Diffusers reads it.
    opaque = mask.convert("RGBA")
    assert np.array_equal(np.asarray(edit_mask(opaque)), np.asarray(edit_mask(mask)))


def test_decoding_keeps_a_masks_alpha_only_when_asked() -> None:
    mask = Image.new("RGBA", (8, 4), (0, 0, 0, 255))
    mask.putpixel((0, 0), (0, 0, 0, 0))
    data = png_bytes(mask)
    assert load_image(data).mode == "RGB"
    kept = load_image(data, param="mask", keep_alpha=True)
    assert kept.mode == "RGBA" and np.asarray(edit_mask(kept))[0, 0] == 255
    assert load_images(mask, keep_alpha=True)[0].mode == "RGBA"
    assert load_image(png_bytes(Image.new("L", (4, 4))), keep_alpha=True).mode == "RGB"


@pytest.mark.parametrize(("height", "width"), [(16, 32), (48, 80)])
def test_mask_pixels_match_diffusers_mask_processor(height, width) -> None:
    rng = np.random.default_rng(0)
    mask = Image.fromarray(rng.integers(0, 256, (30, 50), dtype=np.uint8), mode="L")
    processor = VaeImageProcessor(
        vae_scale_factor=16,
        vae_latent_channels=16,
        do_normalize=False,
        do_binarize=True,
        do_convert_grayscale=True,
    )
    expected = processor.preprocess(mask, height=height, width=width)
    assert torch.equal(mask_pixels(mask, height, width), expected)


def _masks_in_every_mode() -> dict[str, Image.Image]:
    """One random blob mask (white = edit) as users save it: bilevel, palette, grey, RGB and opaque RGBA."""
    rng = np.random.default_rng(1)
    grey = Image.fromarray((rng.random((13, 21)) > 0.5).astype(np.uint8) * 255, mode="L")
    return {
        "1": grey.convert("1"),
        "P": grey.convert("P"),
        "L": grey,
        "RGB": grey.convert("RGB"),
        "RGBA-opaque": grey.convert("RGBA"),
    }


@pytest.mark.parametrize("mode", ["1", "P", "L", "RGB", "RGBA-opaque"])
@pytest.mark.parametrize(("height", "width"), [(64, 96), (16, 32)])
def test_a_mask_saved_in_any_mode_is_read_as_diffusers_reads_it(mode, height, width) -> None:
    """Diffusers resizes a mask in its own mode (PIL resizes "1" and "P" nearest-neighbour whatever the
    filter) and makes it grey after: a mask decoded, checked and prepared as diffserve does it marks the
    same pixels, through the loaders (bytes, PIL) and the validation's `pipeline_mask`."""
    mask = _masks_in_every_mode()[mode]
    processor = VaeImageProcessor(
        vae_scale_factor=16, vae_latent_channels=16, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    )  # fmt: skip
    expected = processor.preprocess(mask, height=height, width=width)
    for loaded in (load_image(png_bytes(mask), as_mask=True), load_images(mask, as_mask=True)[0]):
        assert loaded.mode == ("RGBA" if mode == "RGBA-opaque" else mode)
        assert torch.equal(mask_pixels(pipeline_mask(loaded), height, width), expected), mode
    if mode in ("1", "P"):  # converted to grey before resizing, as before, the edited area differs
        assert not torch.equal(mask_pixels(mask.convert("L"), height, width), expected)


def test_a_transparent_mask_is_read_by_its_alpha_whatever_its_mode() -> None:
    rgba = Image.new("RGBA", (8, 4), (255, 255, 255, 255))
    rgba.putpixel((2, 1), (255, 255, 255, 0))
    loaded = load_image(png_bytes(rgba), as_mask=True)
    assert loaded.mode == "RGBA"
    assert pipeline_mask(loaded).mode == "L" and np.asarray(pipeline_mask(loaded)).sum() == 255


@pytest.mark.parametrize(
    ("steps", "strength", "first"),
    [(3, 0.3, 2), (3, 0.8, 0), (4, 0.5, 2), (28, 0.6, 11), (10, 1.0, 0), (4, 0.9, 0)],
)
def test_schedule_truncation_is_diffusers_get_timesteps(steps, strength, first) -> None:
    init_timestep = min(steps * strength, steps)
    assert first_kept_step(steps, strength) == int(max(steps - init_timestep, 0)) == first
    assert kept_steps(steps, strength) == steps - first


def test_strength_default_and_output_size_follow_the_input_image() -> None:
    p = params(input_images=[IMAGE])
    FLUX_LIKE.check(p)
    assert p.strength == 0.6
    text_only = params()
    FLUX_LIKE.check(text_only)
    assert text_only.strength is None  # text-to-image requests are untouched
    assert input_image_size(params(input_images=[IMAGE]), 16, (64, 64)) == (16, 32)
    assert input_image_size(params(), 16, (64, 64)) == (64, 64)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), float("inf"), True, "0.5"])
def test_strength_outside_0_1_is_a_400(value) -> None:
    with pytest.raises(InvalidRequestError, match="strength must be a number in \\[0, 1\\]") as info:
        params(strength=value).check_values()
    assert info.value.param == "strength"


@pytest.mark.parametrize(
    ("rule", "request_params", "param", "message"),
    [
        (FLUX_LIKE, dict(strength=0.5), "strength", "send an input image with it"),
        (EDIT_ONLY, dict(strength=0.5, input_images=[IMAGE]), "strength", "strength is not a parameter of"),
        (FLUX_LIKE, dict(strength=0.0, input_images=[IMAGE]), "strength", "leaves no denoising step"),
        (T2I_ONLY, dict(mask_image=IMAGE), "mask", "mask is not supported by WanPipeline"),
        (EDIT_ONLY, dict(mask_image=IMAGE, input_images=[IMAGE]), "mask", "mask is not supported"),
        (FLUX_LIKE, dict(mask_image=IMAGE), "mask", "a mask needs the input image"),
        (FLUX_LIKE, dict(mask_image=Image.new("L", (24, 40)), input_images=[IMAGE]), "mask", "mask is 24x40"),
        (
            FLUX_LIKE,
            dict(mask_image=b"png", input_images=[IMAGE]),
            "mask",
            "mask must be a decoded PIL image",
        ),
        (FILL_LIKE, dict(input_images=[IMAGE]), "mask", "FluxFillPipeline needs a mask"),
    ],
)
def test_requests_a_family_cannot_run_are_400s_naming_the_field(rule, request_params, param, message) -> None:
    request = params(**request_params)
    with pytest.raises(InvalidRequestError, match=message) as info:
        rule.check_requested_strength(request)  # what validation runs before the family defaults
        rule.check(request)
    assert info.value.param == param


def test_a_folder_default_strength_leaves_text_to_image_requests_alone() -> None:
    resolved = params(strength=0.8)  # as if the folder's diffserve.json set it
    FLUX_LIKE.check(resolved)
    assert resolved.strength is None
    with_image = params(strength=0.8, input_images=[IMAGE])
    FLUX_LIKE.check(with_image)
    assert with_image.strength == 0.8


def test_a_valid_mask_is_put_in_canonical_form() -> None:
    mask = Image.new("RGBA", IMAGE.size, (0, 0, 0, 255))
    mask.putpixel((3, 3), (0, 0, 0, 0))
    p = params(input_images=[IMAGE], mask_image=mask)
    FILL_LIKE.check(p)
    assert p.mask_image.mode == "L" and np.asarray(p.mask_image).sum() == 255 and p.strength == 1.0
