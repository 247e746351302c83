"""Whole Mochi generations: diffserve against Diffusers' `MochiPipeline`, same tiny folder and seed, fp32.

Each case compares the final latents (before decoding) in dB and the decoded frames as uint8 PSNR: CFG on
(with and without a negative prompt) and off, several sizes, frame counts and step counts, a shorter text
length, and the folder's `force_zeros_for_empty_prompt`; the text encoding (states and padding mask) alone;
requests of different CFG and step counts sharing steps; bfloat16 latents.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import MochiPipeline as DiffusersMochi
from video_case_checks import VideoBars

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.families.mochi.stages import linear_quadratic_sigmas
from diffserve.families.mochi.tiny import TinyMochiSpec, build_tiny_mochi
from diffserve.request import Req
from diffserve.testing.parity import assert_batched_as_alone, assert_images_match, assert_parity
from diffserve.testing.video_parity import (
    diffusers_latents_and_frames,
    folder_pairs,
)

LATENT_MIN_DB = 70.0
PSNR_BAR_DB = 40.0
BARS = VideoBars(LATENT_MIN_DB, PSNR_BAR_DB)
PROMPT = "A red Fox running in the snow"
OTHER_PROMPT = "a blue bird on a branch"

FOLDERS = {
    "default": TinyMochiSpec(),
    "zeros": TinyMochiSpec(force_zeros_for_empty_prompt=True, seed=1),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return folder_pairs(
        lambda name: tmp_path_factory.mktemp(f"mochi-{name}"),
        lambda name, root: build_tiny_mochi(root, FOLDERS[name]),
        DiffGenerator,
        DiffusersMochi,
    )


CASES = [
    # (folder, height, width, frames, steps, options)
    ("default", 32, 48, 7, 3, {"guidance_scale": 4.5}),
    ("default", 48, 32, 13, 4, {"guidance_scale": 6.0, "negative_prompt": "blurry"}),
    ("default", 32, 32, 1, 2, {"guidance_scale": 1.0}),
    ("default", 64, 48, 19, 5, {"guidance_scale": 1.0, "max_sequence_length": 24}),
    ("zeros", 32, 48, 7, 3, {"guidance_scale": 4.5}),
]


@pytest.mark.parametrize(("folder", "height", "width", "frames", "steps", "options"), CASES)
def test_mochi_matches_diffusers(folders, folder, height, width, frames, steps, options) -> None:
    ours, reference = folders(folder)
    common = dict(height=height, width=width, num_inference_steps=steps, num_frames=frames, **options)
    label = f"Mochi {folder} {frames}x{height}x{width} {steps} steps {options}"
    db, pixels = BARS.assert_video_matches(ours, reference, label, PROMPT, OTHER_PROMPT, 3, **common)
    print(f"{label}: latents {db} , frames {pixels:.1f} dB PSNR against Diffusers")


def test_two_outputs_per_prompt_match(folders) -> None:
    """num_outputs_per_prompt = 2 draws one noise tensor for both videos and decodes them together, as
    Diffusers' num_videos_per_prompt does."""
    ours, reference = folders("default")
    common = dict(height=48, width=48, num_inference_steps=3, num_frames=7, guidance_scale=3.0)
    BARS.assert_two_outputs_match(ours, reference, "Mochi", PROMPT, "ugly", 2, **common)


def test_schedule_is_diffusers(folders) -> None:
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    for steps in (2, 3, 7, 64):
        assert linear_quadratic_sigmas(steps, 0.025) == linear_quadratic_schedule(steps, 0.025)


def test_text_encoding_matches_diffusers(folders) -> None:
    for folder in ("default", "zeros"):
        ours, reference = folders(folder)
        stage = ours.pipeline.stages[1]
        for prompt, msl in (("A Red fox", 256), ("A Red fox", 7), ("", 16)):
            want, want_mask, _, _ = reference.encode_prompt(
                prompt, do_classifier_free_guidance=False, max_sequence_length=msl
            )
            got, mask = stage.encode([prompt], msl)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert torch.equal(mask, want_mask)


def test_requests_share_steps_and_match_each_alone(folders) -> None:
    ours, _ = folders("default")
    common = dict(height=32, width=48, num_frames=7)
    params = [
        SamplingParams(prompt="a cat", seed=5, num_inference_steps=3, guidance_scale=5.0, **common),
        SamplingParams(
            prompt="a boat on a lake", seed=6, num_inference_steps=2, guidance_scale=1.0, **common
        ),
    ]
    step_sizes = assert_batched_as_alone(ours, params, "Mochi", video=True)
    assert step_sizes[0] == 2


def test_frame_count_and_steps_are_checked(folders) -> None:
    ours, _ = folders("default")
    with pytest.raises(InvalidRequestError, match="num_frames"):
        ours.generate(prompt=PROMPT, num_frames=8, height=32, width=32)
    with pytest.raises(InvalidRequestError, match="at least 2"):
        ours.generate(prompt=PROMPT, num_frames=7, height=32, width=32, num_inference_steps=1)


def test_bfloat16_matches_diffusers(tmp_path) -> None:
    """In bfloat16 too (DiT roundings as Diffusers', latents kept in bfloat16, the Euler step in float32):
    the final latents and the decoded frames."""
    root = build_tiny_mochi(tmp_path, TinyMochiSpec())
    reference = DiffusersMochi.from_pretrained(root, torch_dtype=torch.bfloat16)
    reference.set_progress_bar_config(disable=True)
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, dtype="bfloat16")
    common = dict(height=32, width=48, num_inference_steps=4, guidance_scale=4.5, num_frames=13)
    pipeline = ours.pipeline
    req = pipeline.run_pre_denoise(
        pipeline.validate(Req(params=SamplingParams(prompt=PROMPT, seed=3, **common)))
    )
    while not req.is_denoised:
        pipeline.denoise_step([req])
    assert req.latents.dtype == torch.bfloat16
    want_latents, want = diffusers_latents_and_frames(reference, 3, prompt=PROMPT, **common)
    assert_parity(req.latents.float(), want_latents.float(), "Mochi bfloat16 latents", min_db=LATENT_MIN_DB)
    got = np.stack(pipeline.run_post_denoise(req).outputs.frames)
    assert_images_match(got, want, "Mochi bfloat16 frames", min_db=PSNR_BAR_DB)


@pytest.mark.parametrize(
    ("updates", "match"),
    [
        ({"temporal_expansions": (1, 2, 2)}, "temporal_expansions .1, 2, 2. compress 4x"),
        ({"spatial_expansions": (2, 2, 1)}, "spatial_expansions .2, 2, 1. compress 4x"),
        (
            {"latent_channels": 8, "latents_mean": (0.0,) * 8, "latents_std": (1.0,) * 8},
            "latent_channels has 8",
        ),
    ],
)
def test_vae_layouts_diffusers_assumes_otherwise_are_refused(updates, match) -> None:
    """Diffusers' MochiPipeline sizes the latents for 8x / 6x compression whatever the VAE's expansions, and
    un-normalises exactly 12 channels: a VAE built otherwise is refused at load (Diffusers would make videos
    of another size, or fail). Without latents_mean / latents_std any channel count is Diffusers' too."""
    from diffserve.errors import ModelLoadError
    from diffserve.families.mochi.folder_checks import check_vae_layout
    from diffserve.families.mochi.tiny import _vae_config
    from diffserve.models.vaes.autoencoder_kl_mochi import AutoencoderKLMochi

    config = _vae_config(TinyMochiSpec())
    with torch.device("meta"):
        vae = AutoencoderKLMochi(**{**config, **updates})
        unnormalised = AutoencoderKLMochi(**{**config, **updates, "latents_mean": None, "latents_std": None})
    with pytest.raises(ModelLoadError, match=match):
        check_vae_layout(vae)
    if "latent_channels" in updates:
        check_vae_layout(unnormalised)


def test_dynamic_shifting_is_refused() -> None:
    """Diffusers' MochiPipeline passes its scheduler no mu: dynamic shifting fails there, refused at load here."""
    from types import SimpleNamespace

    from diffserve.errors import ModelLoadError
    from diffserve.loader.folder_fit import refuse_dynamic_shifting_without_mu

    with pytest.raises(ModelLoadError, match="use_dynamic_shifting"):
        refuse_dynamic_shifting_without_mu(
            SimpleNamespace(config={"use_dynamic_shifting": True}), "MochiPipeline"
        )
