"""Whole SD3 generations: diffserve against Diffusers' StableDiffusion3Pipeline, same folder and seed."""

from __future__ import annotations

import inspect

import pytest
import torch
from diffusers import (
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusion3Pipeline,
)

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.request import Req
from diffserve.testing.parity import (
    assert_generation_matches,
    generator_and_reference,
    smooth_random_image,
)

PSNR_BAR_DB = 40.0


@pytest.fixture(scope="module", params=["sd3", "sd35"])
def engines(request, tmp_path_factory):
    spec = (
        TinySD3Spec()
        if request.param == "sd3"
        else TinySD3Spec(qk_norm="rms_norm", dual_attention_layers=(0,))
    )
    root = build_tiny_sd3(tmp_path_factory.mktemp(request.param), spec)
    return generator_and_reference(DiffGenerator, root, StableDiffusion3Pipeline)


@pytest.mark.parametrize(
    ("height", "width", "steps", "extra"),
    [
        (64, 64, 3, {"guidance_scale": 7.0}),  # classic CFG, default "" negative prompt
        (48, 80, 2, {"guidance_scale": 4.0, "negative_prompt": "blurry"}),  # non-square, negative prompt
        (64, 32, 2, {"guidance_scale": 1.0}),  # no CFG
    ],
)
def test_sd3_pixels_match_diffusers(engines, height, width, steps, extra) -> None:
    ours, reference = engines
    kwargs = dict(height=height, width=width, num_inference_steps=steps, max_sequence_length=24, **extra)
    label = f"SD3 {height}x{width} {extra}"
    prompt = "a red fox in the snow"
    assert_generation_matches(ours, reference, label, min_db=PSNR_BAR_DB, prompt=prompt, seed=3, **kwargs)


def test_sd3_text_encoding_matches_diffusers(engines) -> None:
    ours, reference = engines
    stage = ours.pipeline.stages[1]
    sequence, pooled = stage.encode(["a red fox", "a blue bird"], max_sequence_length=20)
    ref_seq, _, ref_pooled, _ = reference.encode_prompt(
        prompt=["a red fox", "a blue bird"],
        prompt_2=None,
        prompt_3=None,
        do_classifier_free_guidance=False,
        max_sequence_length=20,
    )
    torch.testing.assert_close(sequence, ref_seq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, ref_pooled, rtol=1e-5, atol=1e-5)


def test_sd3_initial_noise_matches_diffusers(engines) -> None:
    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.request import Req

    ours, reference = engines
    req = Req(params=SamplingParams(prompt="x", height=64, width=48, num_inference_steps=2, seed=5))
    # validation, text encoding, input-image encoding (a no-op without an image), latent preparation
    for stage in ours.pipeline.stages[:4]:
        req = stage(req, ours.platform)
    expected = reference.prepare_latents(
        1, 16, 64, 48, torch.float32, torch.device("cpu"), torch.Generator("cpu").manual_seed(5)
    )
    assert torch.equal(req.latents, expected)


def test_sd3_without_t5_matches_diffusers(tmp_path) -> None:
    """model_index.json may set text_encoder_3/tokenizer_3 to null: T5's tokens are then zeros."""
    import json
    import shutil

    root = build_tiny_sd3(tmp_path / "sd3", TinySD3Spec(seed=2))
    index = json.loads((root / "model_index.json").read_text())
    index["text_encoder_3"] = [None, None]
    index["tokenizer_3"] = [None, None]
    (root / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(root / "text_encoder_3")
    shutil.rmtree(root / "tokenizer_3")
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = StableDiffusion3Pipeline.from_pretrained(
        root, torch_dtype=torch.float32, text_encoder_3=None, tokenizer_3=None
    )
    kwargs = dict(height=64, width=48, num_inference_steps=2, guidance_scale=5.0, max_sequence_length=16)
    assert_generation_matches(
        ours, reference, "SD3 without T5", min_db=PSNR_BAR_DB, prompt="a fox", seed=9, **kwargs
    )


def test_sd3_size_beyond_the_position_table_is_refused_at_submission(engines) -> None:
    """Diffusers' patch embedding raises on a latent grid wider than `pos_embed_max_size` patches (16 here:
    256 pixels); diffserve refuses the request before any model work, naming the side and the bound."""
    ours, reference = engines
    kwargs = dict(height=64, width=272, num_inference_steps=1, max_sequence_length=8)
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        reference(prompt="a fox", output_type="latent", **kwargs)
    with pytest.raises(
        InvalidRequestError, match=r"width=272 is larger than this model's largest side, 256"
    ) as info:
        ours.generate(prompt="a fox", **kwargs)
    assert info.value.param == "width"
    assert ours.generate(prompt="a fox", **{**kwargs, "width": 256}).images[0].size == (256, 64)


def test_sd3_image_requests_default_to_the_img2img_pipelines_steps(engines) -> None:
    """Diffusers' SD3 img2img and inpaint pipelines default to 50 steps (text-to-image: 28); a request with
    an input image that leaves them unset runs as many."""
    ours, _ = engines
    defaults = [
        inspect.signature(cls.__call__).parameters["num_inference_steps"].default
        for cls in (
            StableDiffusion3Pipeline,
            StableDiffusion3Img2ImgPipeline,
            StableDiffusion3InpaintPipeline,
        )
    ]
    image = smooth_random_image(48, 32, seed=1)

    def steps(**params) -> int:
        return ours.pipeline.validate(
            Req(params=SamplingParams(prompt="x", **params))
        ).params.num_inference_steps

    assert [
        steps(),
        steps(input_images=[image]),
        steps(input_images=[image], mask_image=image.convert("L")),
    ] == defaults
    assert steps(input_images=[image], num_inference_steps=3) == 3
