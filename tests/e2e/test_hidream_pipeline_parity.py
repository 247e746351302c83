"""Whole HiDream-I1 generations: diffserve against Diffusers' `HiDreamImagePipeline`, same tiny folder and seed,
fp32 CPU: CFG on (with and without a negative prompt) and off, square and non-square requests (Diffusers'
area rule sets the output size; a non-square grid pads the DiT's tokens), the default and shorter text
lengths, two outputs per prompt, the flow-matching Euler (Dev/Fast) and UniPC (Full) schedulers, the text
encodings alone, and requests of different CFG and step counts sharing steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import HiDreamImagePipeline as DiffusersHiDream

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.hidream.stages import check_unipc_shift
from diffserve.families.hidream.tiny import TinyHiDreamSpec, build_tiny_hidream
from diffserve.models.schedulers.unipc_flow import UniPCFlowScheduler
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    diffusers_uint8,
    generator_and_reference,
    stack_uint8,
)

PSNR_BAR_DB = 40.0
PROMPT = "A red Fox running in the snow"
OTHER_PROMPT = "a blue bird on a branch"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache: dict[str, tuple[DiffGenerator, object]] = {}

    def get(scheduler: str):
        if scheduler not in cache:
            root = build_tiny_hidream(
                tmp_path_factory.mktemp(f"hidream-{scheduler}"), TinyHiDreamSpec(scheduler=scheduler)
            )
            cache[scheduler] = generator_and_reference(DiffGenerator, root, DiffusersHiDream)
        return cache[scheduler]

    return get


CASES = [
    # (scheduler, requested height, width, output shape, options)
    ("euler", 32, 32, (128, 128), {"guidance_scale": 5.0, "max_sequence_length": 24}),
    (
        "euler",
        32,
        56,
        (96, 168),
        {"guidance_scale": 4.0, "negative_prompt": "blurry", "max_sequence_length": 16},
    ),
    ("euler", 64, 16, (256, 64), {"guidance_scale": 1.0}),
    (
        "unipc",
        56,
        72,
        (112, 144),
        {"guidance_scale": 3.0, "max_sequence_length": 16, "num_inference_steps": 3},
    ),
]


@pytest.mark.parametrize(("scheduler", "height", "width", "shape", "options"), CASES)
def test_hidream_matches_diffusers(folders, scheduler, height, width, shape, options) -> None:
    ours, reference = folders(scheduler)
    common = {"height": height, "width": width, "num_inference_steps": 2, **options}
    params = SamplingParams(prompt=PROMPT, seed=3, **common)
    got = stack_uint8(ours.generate_from_params(params).images)
    want = diffusers_uint8(reference, seed=3, prompt=PROMPT, **common)
    control = stack_uint8(
        ours.generate_from_params(SamplingParams(**{**params.__dict__, "prompt": OTHER_PROMPT})).images
    )
    label = f"HiDream {scheduler} {height}x{width} {options}"
    assert_images_match(got, want, label, min_db=PSNR_BAR_DB, shape=(1, *shape, 3), control=control)


def test_two_outputs_per_prompt_match(folders) -> None:
    ours, reference = folders("euler")
    common = {
        "height": 48,
        "width": 48,
        "num_inference_steps": 2,
        "guidance_scale": 3.0,
        "max_sequence_length": 16,
    }
    got = stack_uint8(
        ours.generate(
            prompt=PROMPT, negative_prompt="ugly", num_outputs_per_prompt=2, seed=2, **common
        ).images
    )
    want = diffusers_uint8(
        reference, seed=2, prompt=PROMPT, negative_prompt="ugly", num_images_per_prompt=2, **common
    )
    assert not np.array_equal(got[0], got[1])
    assert_images_match(got, want, "HiDream 2 per prompt", min_db=PSNR_BAR_DB, shape=(2, 128, 128, 3))


def test_text_encoding_matches_diffusers(folders) -> None:
    ours, reference = folders("euler")
    stage = ours.pipeline.stages[1]
    for prompt, msl in (("A Red fox", 128), ("a very long prompt " * 4, 9)):
        t5, _, llama, _, pooled, _ = reference.encode_prompt(
            prompt=prompt, do_classifier_free_guidance=False, max_sequence_length=msl
        )
        got = stage.encode([prompt], msl)
        assert got.llama.shape == llama.shape and got.t5.shape == t5.shape
        torch.testing.assert_close(got.t5, t5, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.llama, llama, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.pooled, pooled, rtol=1e-5, atol=1e-6)


def test_requests_share_steps_and_match_each_alone(folders) -> None:
    ours, _ = folders("euler")
    common = {"height": 32, "width": 56, "max_sequence_length": 16}
    params = [
        SamplingParams(prompt="a cat", seed=5, num_inference_steps=3, guidance_scale=5.0, **common),
        SamplingParams(
            prompt="a boat on a lake", seed=6, num_inference_steps=2, guidance_scale=1.0, **common
        ),
    ]
    step_sizes = assert_batched_as_alone(ours, params, "HiDream")
    assert step_sizes[0] == 2


def test_true_cfg_scale_is_refused(folders) -> None:
    ours, _ = folders("euler")
    with pytest.raises(InvalidRequestError, match="HiDream-I1 runs classic CFG"):
        ours.generate(prompt=PROMPT, true_cfg_scale=4.0, height=32, width=32)


def test_a_size_the_patches_cannot_tile_is_refused(folders) -> None:
    """The tiny DiT's 8-pixel patches cannot tile every rescaled size (the released 2x2 patches can)."""
    ours, _ = folders("euler")
    with pytest.raises(InvalidRequestError, match="Diffusers' area rule"):
        ours.generate(prompt=PROMPT, height=32, width=48)


def test_a_max_sequence_length_below_the_clip_special_tokens_is_refused(folders) -> None:
    """max_sequence_length=1 is refused with a clear error: the CLIP tokenizers cannot truncate below their
    two special tokens (Diffusers' CLIP then reads whole prompts of different lengths, and fails past
    CLIP's positions); 2 is the least accepted, as Diffusers runs it."""
    ours, reference = folders("euler")
    with pytest.raises(InvalidRequestError, match="max_sequence_length must be at least 2") as info:
        ours.generate(prompt=PROMPT, height=32, width=32, max_sequence_length=1, num_inference_steps=1)
    assert info.value.param == "max_sequence_length"
    common = {"height": 32, "width": 32, "num_inference_steps": 1, "max_sequence_length": 2}
    got = stack_uint8(ours.generate(prompt=PROMPT, seed=4, **common).images)
    want = diffusers_uint8(reference, seed=4, prompt=PROMPT, **common)
    assert_images_match(
        got, want, "HiDream max_sequence_length 2", min_db=PSNR_BAR_DB, shape=(1, 128, 128, 3)
    )


def test_a_non_square_grid_beyond_max_resolution_is_refused(folders, monkeypatch) -> None:
    """A non-square grid is padded to the DiT's `max_resolution` area in patches (Diffusers fails on one that
    has more): refused at validation, before any DiT batch; a square one is not padded and runs."""
    ours, _ = folders("euler")
    monkeypatch.setattr(ours.pipeline.input_validation, "max_patches", 64)  # max_resolution [64, 64]
    with pytest.raises(InvalidRequestError, match="252 DiT patches, more than the 64") as info:
        ours.generate(prompt=PROMPT, height=32, width=56, num_inference_steps=1)
    assert info.value.param == "height"
    ours.pipeline.input_validation.resolve(SamplingParams(prompt=PROMPT, height=32, width=32))


def test_a_unipc_scheduler_with_dynamic_shifting_is_refused() -> None:
    """Diffusers' pipeline gives UniPC no `mu`, so UniPC with use_dynamic_shifting fails every call there."""
    check_unipc_shift(UniPCFlowScheduler(flow_shift=3.0))
    with pytest.raises(ModelLoadError, match="use_dynamic_shifting=True"):
        check_unipc_shift(UniPCFlowScheduler(flow_shift=3.0, use_dynamic_shifting=True))
