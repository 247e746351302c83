"""Whole Chroma generations: diffserve against Diffusers' ChromaPipeline (ChromaImg2ImgPipeline with an
input image, ChromaInpaintPipeline with a mask too), same folder and seed; and step batching (requests with other prompt lengths, CFG on and
off, sharing DiT forwards) against each alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import ChromaImg2ImgPipeline, ChromaInpaintPipeline, ChromaPipeline
from PIL import Image

from diffserve import SamplingParams
from diffserve.api import DiffGenerator, check_sequence_parallel
from diffserve.errors import InvalidRequestError
from diffserve.families.chroma.tiny import build_tiny_chroma
from diffserve.loader.model_index import read_model_index
from diffserve.registry import family_by_name
from diffserve.request import Req
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_generation_matches,
    assert_images_match,
    diffusers_uint8,
    generator_and_reference,
    max_pixel_diff,
    smooth_random_image,
    stack_uint8,
)
from diffserve.testing.tiny_lora import write_random_lora

PSNR_BAR_DB = 40.0
PROMPT = "a red fox in the snow"
#: T5 padded to 32 tokens (Diffusers pads to max_sequence_length too): the prompts leave masked padding.
MAX_LEN = 32


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = build_tiny_chroma(tmp_path_factory.mktemp("chroma"))
    return generator_and_reference(DiffGenerator, root, ChromaPipeline)


@pytest.mark.parametrize(
    ("height", "width", "steps", "extra"),
    [
        (48, 80, 3, {"guidance_scale": 4.0, "negative_prompt": "blurry"}),  # CFG, non-square
        (64, 32, 2, {"guidance_scale": 1.0}),  # CFG off (guidance_scale <= 1), non-square
        (32, 32, 2, {"guidance_scale": 3.0, "num_outputs_per_prompt": 2}),  # CFG with the default "" negative
    ],
)
def test_chroma_pixels_match_diffusers(engines, height, width, steps, extra) -> None:
    ours, reference = engines
    kwargs = dict(height=height, width=width, num_inference_steps=steps, max_sequence_length=MAX_LEN, **extra)
    assert_generation_matches(
        ours,
        reference,
        f"Chroma {height}x{width} {extra}",
        min_db=PSNR_BAR_DB,
        prompt=PROMPT,
        seed=3,
        **kwargs,
    )


def test_the_bar_sees_the_prompt_and_the_negative_prompt(engines) -> None:
    """Another prompt, or another negative prompt, scores far below the bar against Diffusers' image."""
    ours, reference = engines
    kwargs = dict(height=48, width=48, num_inference_steps=2, max_sequence_length=MAX_LEN, guidance_scale=4.0)
    ref = diffusers_uint8(reference, seed=5, prompt=PROMPT, negative_prompt="blurry", **kwargs)
    other_prompt = stack_uint8(
        ours.generate(prompt="a blue bird", negative_prompt="blurry", seed=5, **kwargs).images
    )
    other_negative = stack_uint8(
        ours.generate(prompt=PROMPT, negative_prompt="dark", seed=5, **kwargs).images
    )
    same = stack_uint8(ours.generate(prompt=PROMPT, negative_prompt="blurry", seed=5, **kwargs).images)
    assert_images_match(
        same, ref, "Chroma, another prompt as control", min_db=PSNR_BAR_DB, control=other_prompt
    )
    assert_images_match(
        same, ref, "Chroma, another negative as control", min_db=PSNR_BAR_DB, control=other_negative
    )


def test_text_encoding_and_mask_match_diffusers(engines) -> None:
    """T5 states (T5 sees the tokenizer's mask) and the DiT's mask (one padding token kept) per prompt."""
    ours, reference = engines
    stage = next(s for s in ours.pipeline.stages if s.name == "ChromaTextEncodingStage")
    prompts = ["a red fox", "a blue bird on a branch"]
    states, mask = stage.encode(prompts, max_sequence_length=MAX_LEN)
    ref_states, _, ref_mask, *_ = reference.encode_prompt(
        prompt=prompts,
        device=torch.device("cpu"),
        do_classifier_free_guidance=False,
        max_sequence_length=MAX_LEN,
    )
    torch.testing.assert_close(states, ref_states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mask, ref_mask)
    assert 0 < int(mask[0].sum()) < int(mask[1].sum()) < MAX_LEN


def test_requests_batched_equal_each_alone(engines) -> None:
    """Requests with other prompt lengths (other text masks), CFG on and off, other step counts, image-to-
    image and inpainting share DiT forwards; each image is within one uint8 level of its image alone."""
    ours, _ = engines
    base = dict(height=32, width=48, max_sequence_length=MAX_LEN)
    image = smooth_random_image(48, 32, seed=4)
    mask = Image.new("L", (48, 32), 0)
    mask.paste(255, (8, 8, 40, 24))
    params = [
        SamplingParams(prompt="a fox", seed=1, num_inference_steps=3, guidance_scale=4.0, **base),
        SamplingParams(
            prompt="a blue bird on a branch", seed=2, num_inference_steps=2, guidance_scale=1.0, **base
        ),
        SamplingParams(
            prompt="a tree",
            seed=3,
            num_inference_steps=3,
            guidance_scale=2.5,
            negative_prompt="a dark and blurry picture",
            num_outputs_per_prompt=2,
            **base,
        ),
        SamplingParams(
            prompt="a house", seed=4, num_inference_steps=6, strength=0.5, input_images=[image], **base
        ),
        SamplingParams(
            prompt="a boat",
            seed=5,
            num_inference_steps=4,
            strength=0.75,
            guidance_scale=3.0,
            input_images=[image],
            mask_image=mask,
            **base,
        ),
    ]
    step_sizes = assert_batched_as_alone(ours, params, "Chroma")
    assert step_sizes == [5, 5, 4]  # the CFG-less request runs 2 steps, the others 3


def test_chroma_refuses_what_it_does_not_take(engines) -> None:
    ours, _ = engines
    kwargs = dict(prompt=PROMPT, height=32, width=32, num_inference_steps=1)
    with pytest.raises(InvalidRequestError, match="true_cfg_scale.*guidance_scale") as info:
        ours.generate(true_cfg_scale=4.0, **kwargs)
    assert info.value.param == "true_cfg_scale"
    image = smooth_random_image(32, 32, seed=1)
    with pytest.raises(InvalidRequestError, match="ChromaPipeline"):
        ours.generate(input_images=[image, image], **kwargs)


@pytest.mark.parametrize(
    ("strength", "extra"),
    [
        (0.5, {"guidance_scale": 4.0, "negative_prompt": "blurry"}),
        (None, {"guidance_scale": 1.0, "num_outputs_per_prompt": 2}),  # Diffusers' default strength, 0.9
    ],
)
def test_chroma_img2img_matches_diffusers(engines, strength, extra) -> None:
    ours, reference = engines
    img2img = ChromaImg2ImgPipeline(**reference.components)
    img2img.set_progress_bar_config(disable=True)
    image = smooth_random_image(80, 48, seed=2)
    kwargs = dict(height=48, width=80, num_inference_steps=4, max_sequence_length=MAX_LEN, **extra)
    strengths = {} if strength is None else {"strength": strength}
    n = extra.get("num_outputs_per_prompt", 1)
    shared = {k: v for k, v in kwargs.items() if k != "num_outputs_per_prompt"}
    ours_u8 = stack_uint8(ours.generate(prompt=PROMPT, image=image, seed=7, **strengths, **kwargs).images)
    ref = diffusers_uint8(
        img2img, seed=7, prompt=PROMPT, image=image, num_images_per_prompt=n, **strengths, **shared
    )
    text_only = stack_uint8(ours.generate(prompt=PROMPT, seed=7, **kwargs).images)
    assert_images_match(
        ours_u8, ref, f"Chroma img2img strength {strength}", min_db=PSNR_BAR_DB, control=text_only
    )


@pytest.mark.parametrize(
    ("strength", "extra"),
    [
        (0.8, {"guidance_scale": 4.0, "negative_prompt": "blurry"}),
        (None, {"guidance_scale": 1.0}),  # Diffusers' default inpainting strength, 0.6
    ],
)
def test_chroma_inpainting_matches_diffusers(engines, strength, extra) -> None:
    ours, reference = engines
    inpaint = ChromaInpaintPipeline(**reference.components)
    inpaint.set_progress_bar_config(disable=True)
    # Diffusers 0.42.1's ChromaInpaintPipeline reads `transformer.config.guidance_embeds`, a key Chroma's
    # transformer does not have, and then never uses what it computes from it: give it the key.
    inpaint.transformer.register_to_config(guidance_embeds=False)
    image = smooth_random_image(80, 48, seed=3)
    mask = Image.new("L", (80, 48), 0)
    mask.paste(255, (16, 8, 56, 40))  # white: repaint
    # ChromaInpaintPipeline's own step, guidance and text-length defaults differ: both sides get them.
    kwargs = dict(height=48, width=80, num_inference_steps=4, max_sequence_length=MAX_LEN, **extra)
    strengths = {} if strength is None else {"strength": strength}
    ours_u8 = stack_uint8(
        ours.generate(prompt=PROMPT, image=image, mask=mask, seed=9, **strengths, **kwargs).images
    )
    ref = diffusers_uint8(inpaint, seed=9, prompt=PROMPT, image=image, mask_image=mask, **strengths, **kwargs)
    unmasked = stack_uint8(ours.generate(prompt=PROMPT, image=image, seed=9, **strengths, **kwargs).images)
    assert_images_match(
        ours_u8, ref, f"Chroma inpainting strength {strength}", min_db=PSNR_BAR_DB, control=unmasked
    )


def test_whole_span_cache_methods_run_and_batch_with_exact_requests(engines) -> None:
    """The DiT runs the whole-span cache methods (they reuse steps); a batch mixing them with an exact
    request gives each request its own output; the block-range DBCache is refused by name."""
    ours, _ = engines
    pipeline = ours.pipeline
    params = dict(height=32, width=32, num_inference_steps=8, max_sequence_length=MAX_LEN, guidance_scale=3.0)
    teacache = {"method": "teacache", "rel_l1_thresh": 2.0, "coefficients": [1.0, 0.0]}
    caches = [None, teacache, {"method": "easycache"}]
    reqs = [
        pipeline.run_pre_denoise(
            pipeline.validate(Req(SamplingParams(prompt=PROMPT, seed=i, cache=c, **params)))
        )
        for i, c in enumerate(caches)
    ]
    while not all(r.is_denoised for r in reqs):
        pipeline.denoise_step(reqs)
    for i, (cache, req) in enumerate(zip(caches, reqs, strict=True)):
        batched = stack_uint8(pipeline.run_post_denoise(req).outputs.images)
        alone = ours.generate(prompt=PROMPT, seed=i, cache=cache, **params)
        assert max_pixel_diff(batched, stack_uint8(alone.images)) <= 1, cache
        if cache is not None:
            assert alone.cache["steps_reused"] > 0, cache
    with pytest.raises(InvalidRequestError, match="dbcache.*ChromaPipeline"):
        ours.generate(prompt=PROMPT, seed=0, cache={"method": "dbcache"}, **params)


def test_lora_adapters_match_diffusers(tmp_path) -> None:
    """Two Diffusers/PEFT-format LoRAs (one with alpha != rank) at their own scales, against Diffusers'
    `load_lora_weights` + `set_adapters`; a request without LoRA still gives the base pixels. (A folder of
    its own: Diffusers' pipeline keeps the adapters.)"""
    root = build_tiny_chroma(tmp_path / "chroma")
    ours, reference = generator_and_reference(DiffGenerator, root, ChromaPipeline)
    kwargs = dict(
        height=48,
        width=80,
        num_inference_steps=3,
        guidance_scale=4.0,
        negative_prompt="blurry",
        max_sequence_length=MAX_LEN,
    )
    base = stack_uint8(ours.generate(prompt=PROMPT, seed=3, **kwargs).images)
    files = {
        "a": write_random_lora(root, tmp_path / "a.safetensors", rank=4, alpha=8.0, seed=1, std=0.2),
        "b": write_random_lora(root, tmp_path / "b.safetensors", rank=2, seed=2, std=0.3),
    }
    for name, path in files.items():
        ours.load_lora(name, path)
        reference.load_lora_weights(str(path), adapter_name=name)
    reference.set_adapters(["a", "b"], adapter_weights=[0.8, 0.5])
    loras = [{"name": "a", "scale": 0.8}, {"name": "b", "scale": 0.5}]
    got = stack_uint8(ours.generate(prompt=PROMPT, seed=3, loras=loras, **kwargs).images)
    want = diffusers_uint8(reference, seed=3, prompt=PROMPT, **kwargs)
    assert_images_match(got, want, "Chroma with two LoRAs", min_db=PSNR_BAR_DB, control=base)
    assert np.array_equal(stack_uint8(ours.generate(prompt=PROMPT, seed=3, **kwargs).images), base)


def test_sequence_parallelism_is_accepted(engines) -> None:
    """Its padding bias rides in extra head channels when split (tests/distributed/
    test_dit_sequence_parallel_images_wave3.py), so --ulysses-degree / --ring-degree pass the load check."""
    ours, _ = engines
    index = read_model_index(ours.engine_args.model_path)
    family = family_by_name("chroma")
    check_sequence_parallel(index, family, 1)
    check_sequence_parallel(index, family, 2)
