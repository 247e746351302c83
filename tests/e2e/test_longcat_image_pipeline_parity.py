"""Whole LongCat-Image generations and edits: diffserve against Diffusers' LongCatImagePipeline (called with
`enable_prompt_rewrite=False`, which diffserve refuses to turn on) and LongCatImageEditPipeline, same folder
and seed."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from diffusers import LongCatImageEditPipeline, LongCatImagePipeline
from diffusers.pipelines.longcat_image import pipeline_longcat_image_edit
from diffusers.pipelines.longcat_image.pipeline_longcat_image import split_quotation
from PIL import Image

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.configs.quality import PSNR_BARS
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.longcat_image.config import edit_default_size, edit_output_size
from diffserve.families.longcat_image.folder_checks import check_longcat_image_folder
from diffserve.families.longcat_image.stages import quoted_spans
from diffserve.families.longcat_image.tiny import TinyLongCatImageSpec, build_tiny_longcat_image
from diffserve.models.dits.longcat_image import LongCatImageTransformer2DModel
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    diffusers_uint8,
    smooth_random_image,
    stack_uint8,
)
from diffserve.testing.qwen_processors import load_qwen_vl_processor

PSNR_BAR_DB = 40.0
PROMPT = 'a shop sign that says "OPEN", it\'s raining'
#: Diffusers' default rewrites the prompt with the text encoder; diffserve equals it without.
NO_REWRITE = {"enable_prompt_rewrite": False}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = build_tiny_longcat_image(tmp_path_factory.mktemp("longcat"))
    reference = LongCatImagePipeline.from_pretrained(
        root, torch_dtype=torch.float32, text_processor=load_qwen_vl_processor(root / "text_processor")
    )
    reference.set_progress_bar_config(disable=True)
    return DiffGenerator.from_pretrained(root, device="cpu", show_progress=False), reference


#: On the CPU in float32 both sides compute the same sums: the images agree far above the bar. The renorm
#: floor case needs it: without its floor, that image is still about 52 dB from Diffusers'.
FP32_DB = 60.0


@pytest.mark.parametrize(
    ("height", "width", "outputs", "params", "extra"),
    [
        # Diffusers' defaults: CFG 4.5 against "", renormalised (floor 0), non-square
        (32, 48, 1, {"guidance_scale": 4.5}, {}),
        # no CFG (guidance_scale 1), non-square the other way
        (48, 32, 1, {"guidance_scale": 1.0}, {}),
        # strong CFG whose renormalisation hits its floor, two images per prompt
        (32, 32, 2, {"guidance_scale": 12.0, "negative_prompt": "a red car"}, {"cfg_renorm_min": 0.9}),
        # CFG against a negative prompt without renormalisation
        (32, 32, 1, {"guidance_scale": 3.0, "negative_prompt": "blurry"}, {"enable_cfg_renorm": False}),
    ],
)
def test_longcat_image_pixels_match_diffusers(engines, height, width, outputs, params, extra) -> None:
    ours, reference = engines
    kwargs = dict(height=height, width=width, num_inference_steps=2, **params)
    got = stack_uint8(
        ours.generate(prompt=PROMPT, seed=3, num_outputs_per_prompt=outputs, extra=extra, **kwargs).images
    )
    want = diffusers_uint8(
        reference, seed=3, prompt=PROMPT, num_images_per_prompt=outputs, **kwargs, **extra, **NO_REWRITE
    )
    control = None
    if not extra and params["guidance_scale"] > 1:  # another prompt, same seed: far below the bar
        control = stack_uint8(ours.generate(prompt="a green tree", seed=3, **kwargs).images)
    label = f"LongCat-Image {height}x{width} x{outputs} {params} {extra}"
    value = assert_images_match(
        got, want, label, min_db=PSNR_BAR_DB, shape=(outputs, height, width, 3), control=control
    )
    assert value >= FP32_DB, f"{label}: {value:.2f} dB < {FP32_DB} dB"


def test_step_batched_requests_equal_each_alone(engines) -> None:
    ours, _ = engines
    params = [
        SamplingParams(prompt="a red fox", height=32, width=32, num_inference_steps=2, seed=5),
        SamplingParams(
            prompt="a blue bird", height=32, width=32, num_inference_steps=3, seed=6, guidance_scale=1.0
        ),
    ]
    assert_batched_as_alone(ours, params, "LongCat-Image")


def test_quoted_spans_and_text_encoding_match_diffusers(engines) -> None:
    ours, reference = engines
    prompts = [
        PROMPT,
        "write 'HELLO' and \u201cWORLD\u201d on a \u2018board\u2019",
        "'twas a night, isn't it",  # an unquoted span that a restored apostrophe closes: quoted
        "",
    ]
    for prompt in prompts:
        assert quoted_spans(prompt) == split_quotation(prompt), prompt
    # Two words with apostrophes: Diffusers' placeholders nest ("x" and "xx"), so which word comes back
    # depends on set order (the process's hash seed); diffserve keeps the prompt as written.
    assert quoted_spans("the dog's ball and the cat's toy") == [("the dog's ball and the cat's toy", False)]
    stage = next(s for s in ours.pipeline.stages if s.name == "LongCatTextEncodingStage")
    with torch.no_grad():
        expected = reference._encode_prompt(prompts)
    actual = torch.stack(stage.encode(prompts))
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"extra": {"enable_prompt_rewrite": True}}, "enable_prompt_rewrite.*LongCat-Image"),
        ({"extra": {"cfg_renorm_min": 2.0}}, "cfg_renorm_min"),
        ({"extra": {"guidance_rescale": 0.7}}, "unknown setting.*guidance_rescale"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale.*guidance_scale"),
        ({"max_sequence_length": 128}, "max_sequence_length.*512"),
    ],
)
def test_longcat_image_refuses_what_it_does_not_run(engines, params, match) -> None:
    ours, _ = engines
    with pytest.raises(InvalidRequestError, match=match):
        ours.generate(prompt=PROMPT, height=32, width=32, num_inference_steps=1, **params)


@pytest.mark.parametrize(
    ("dit_change", "vae_latents", "message"),
    [
        ({"patch_size": 2}, 16, "transformer patch_size=2"),
        ({"in_channels": 32}, 16, "in_channels=32: the pipeline's tokens are 16-channel latents"),
        ({}, 8, "vae latent_channels=8"),
        (
            {"joint_attention_dim": 16},
            16,
            "joint_attention_dim=16 differs from the text encoder's hidden_size",
        ),
    ],
)
def test_folders_whose_components_do_not_fit_are_refused(engines, dit_change, vae_latents, message) -> None:
    """Configs that make Diffusers' pipeline fail mid-generation with a shape error are refused at load,
    naming the keys (the tiny folder itself fits: text width 32)."""
    ours, _ = engines
    dit = ours.pipeline.context.get("transformer")
    check_longcat_image_folder(dit, {"latent_channels": 16}, 16, 32)
    with torch.device("meta"):
        changed = LongCatImageTransformer2DModel(dataclasses.replace(dit.config, **dit_change))
    with pytest.raises(ModelLoadError, match=message):
        check_longcat_image_folder(changed, {"latent_channels": vae_latents}, 16, 32)


def test_quality_tiers_keep_their_bars_and_skip_steps(engines) -> None:
    """The tiers (FLUX.1's presets) on the tiny model, 20 steps at 64x64 with CFG: each keeps its PSNR bar
    against the exact output (measured: medium 52.6 dB, low 39.3, draft 35.2), low and draft skip steps."""
    ours, _ = engines
    kwargs = dict(prompt="a red fox in the snow", seed=7, height=64, width=64, num_inference_steps=20)
    exact = stack_uint8(ours.generate(**kwargs).images)
    for tier, bar in PSNR_BARS.items():
        out = ours.generate(quality=tier, **kwargs)
        value = psnr(stack_uint8(out.images), exact)
        print(f"LongCat-Image {tier}: {out.steps_computed_in_full}/20 steps in full, PSNR {value:.1f} dB")
        assert value >= bar, f"{tier}: {value:.1f} dB is under its {bar} dB bar"
        if tier != "medium":
            assert out.steps_computed_in_full < 20, f"{tier} reused no step"


# ------------------------------------------------------------------------------------ LongCat-Image-Edit

EDIT_PROMPT = 'write "RED" on the wall'


@pytest.fixture(scope="module")
def edit_engines(tmp_path_factory):
    root = build_tiny_longcat_image(
        tmp_path_factory.mktemp("longcat-edit"), TinyLongCatImageSpec(variant="edit")
    )
    reference = LongCatImageEditPipeline.from_pretrained(
        root, torch_dtype=torch.float32, text_processor=load_qwen_vl_processor(root / "text_processor")
    )
    reference.set_progress_bar_config(disable=True)
    return DiffGenerator.from_pretrained(root, device="cpu", show_progress=False), reference


def test_edit_output_size_is_diffusers_rule() -> None:
    for width, height in [(640, 480), (1000, 333), (512, 512), (300, 900), (1920, 1080), (777, 1023)]:
        expected_width, expected_height = pipeline_longcat_image_edit.calculate_dimensions(
            1024 * 1024, width / height
        )
        assert edit_output_size(width, height, 1024 * 1024, 16) == (expected_height, expected_width)


def test_edit_default_size_that_the_vae_cannot_make_is_refused_by_name() -> None:
    """A deeper VAE than the released 8x one (pixel multiple 32): the default size of a 60x44 input image
    (1200x880, Diffusers' rule) is refused with the sizes to set, where it used to name a height the
    request never sent; explicit sizes and default sizes the VAE can make pass."""
    params = SamplingParams(prompt=EDIT_PROMPT, input_images=[smooth_random_image(60, 44, 1)])
    assert edit_default_size(params, 1024 * 1024, 16, 16) == (880, 1200)
    with pytest.raises(InvalidRequestError, match="default output size.*880x1200.*for example 864x1184"):
        edit_default_size(params, 1024 * 1024, 16, 32)
    params.height, params.width = 64, 96
    edit_default_size(params, 1024 * 1024, 16, 32)


@pytest.mark.parametrize(
    ("height", "width", "outputs", "params"),
    [
        (32, 48, 1, {"guidance_scale": 4.5}),  # CFG against "", a non-square output from a non-square input
        (48, 32, 2, {"guidance_scale": 1.0}),  # no CFG, two outputs
        (32, 32, 1, {"guidance_scale": 3.0, "negative_prompt": "blurry"}),
    ],
)
def test_longcat_image_edit_pixels_match_diffusers(edit_engines, height, width, outputs, params) -> None:
    """Diffusers sizes an edit's output from the input image at about one megapixel: its size rule is
    replaced by the request's size (too large for a CPU test otherwise; the rule is checked above)."""
    ours, reference = edit_engines
    image = smooth_random_image(60, 44, 1)
    kwargs = dict(num_inference_steps=2, **params)
    got = stack_uint8(
        ours.generate(
            prompt=EDIT_PROMPT, image=image, seed=3, height=height, width=width,
            num_outputs_per_prompt=outputs, **kwargs,
        ).images
    )  # fmt: skip
    with mock.patch.object(pipeline_longcat_image_edit, "calculate_dimensions", lambda *_: (width, height)):
        want = diffusers_uint8(
            reference, seed=3, image=image, prompt=EDIT_PROMPT, num_images_per_prompt=outputs, **kwargs
        )
    label = f"LongCat-Image-Edit {height}x{width} x{outputs} {params}"
    value = assert_images_match(got, want, label, min_db=PSNR_BAR_DB, shape=(outputs, height, width, 3))
    assert value >= FP32_DB, f"{label}: {value:.2f} dB < {FP32_DB} dB"
    if outputs == 1 and "negative_prompt" not in params:
        # Another input image (black): the tiny random DiT reads its input image's tokens only weakly
        # (about 42 dB from the match here), so the control is held to the float32 bar, not to 40 dB.
        other = Image.new("RGB", image.size)
        control = ours.generate(prompt=EDIT_PROMPT, image=other, seed=3, height=height, width=width, **kwargs)
        control_db = psnr(stack_uint8(control.images), want)
        print(f"{label}: another input image scores {control_db:.2f} dB")
        assert control_db < FP32_DB, f"{label}: the input image changed nothing ({control_db:.2f} dB)"


def test_edit_step_batched_requests_equal_each_alone(edit_engines) -> None:
    ours, _ = edit_engines
    base = dict(height=32, width=32, input_images=[smooth_random_image(40, 40, 3)])
    params = [
        SamplingParams(prompt="make it red", num_inference_steps=2, seed=5, **base),
        SamplingParams(prompt="make it blue", num_inference_steps=3, seed=6, guidance_scale=1.0, **base),
    ]
    assert_batched_as_alone(ours, params, "LongCat-Image-Edit")


def test_longcat_image_edit_refuses_what_it_does_not_run(edit_engines) -> None:
    ours, _ = edit_engines
    image = smooth_random_image(40, 40, 3)
    with pytest.raises(InvalidRequestError):
        ours.generate(prompt=EDIT_PROMPT, height=32, width=32, num_inference_steps=1)  # no input image
    with pytest.raises(InvalidRequestError, match="extra"):
        ours.generate(
            prompt=EDIT_PROMPT, image=image, height=32, width=32, num_inference_steps=1,
            extra={"enable_cfg_renorm": False},
        )  # fmt: skip
