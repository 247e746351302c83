"""SkyReels-V2 diffusion forcing's video extension: diffserve against Diffusers'
SkyReelsV2DiffusionForcingVideoToVideoPipeline on one tiny random-weight folder, same seed, frames as uint8
(PSNR >= 40 dB): synchronous and asynchronous (`ar_step`, `causal_block_size`), CFG on and off, a long
extension over several windows (`overlap_history`, `addnoise_condition`), requests of several modes batched,
and the request surface (`DiffGenerator.generate(video=...)`; other families refuse an input video).

The output is the input video's frames (resized) followed by the decoded latents, whose first frames are the
re-encoded overlap: the control (another input video) is measured on the generated frames only.

Diffusers draws `addnoise_condition`'s noise from the global RNG (`torch.randn_like`); diffserve from a
generator of the request's own (`addnoise_seed`), which the reference is given here in its place. Every
reference call passes `causal_block_size`: Diffusers writes it into its DiT's config, where the next call
would find it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import SkyReelsV2DiffusionForcingVideoToVideoPipeline
from PIL import Image

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.wan.skyreels_v2_forcing_state import addnoise_seed
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    generator_and_reference,
    gradient_image,
    smooth_random_image,
    to_uint8,
)
from diffserve.testing.video_parity import randn_like_from

PSNR_BAR_DB = 40.0
PROMPT = "a red fox running through snow"
SIZE = dict(height=32, width=32)


def input_video(frames: int, seed: int) -> list[Image.Image]:
    """A smooth moving clip of `frames` 48x40 frames (another size than the output's: they are resized)."""
    base = np.asarray(smooth_random_image(width=64, height=40, seed=seed))
    ramp = np.asarray(gradient_image(width=48, height=40))
    return [
        Image.fromarray(((base[:, 2 * i : 2 * i + 48].astype(np.int32) + ramp) // 2).astype(np.uint8))
        for i in range(frames)
    ]


@pytest.fixture(scope="module")
def v2v(tmp_path_factory):
    spec = TinySkyReelsV2Spec(diffusion_forcing=True, video_to_video=True)
    root = build_tiny_skyreels_v2(tmp_path_factory.mktemp("skyreels-v2-df-v2v"), spec)
    return generator_and_reference(DiffGenerator, root, SkyReelsV2DiffusionForcingVideoToVideoPipeline)


def addnoise_from(seed: int):
    """Diffusers' `torch.randn_like` drawing from diffserve's addnoise generator for a request seeded `seed`."""
    return randn_like_from(addnoise_seed(seed))


def ours(v2v, video, seed: int, forcing: dict, **kwargs) -> np.ndarray:
    out = v2v[0].generate(
        prompt=PROMPT, video=video, seed=seed, max_sequence_length=32, extra=forcing, **kwargs
    )
    return np.stack(out.frames)


def reference(v2v, video, seed: int, forcing: dict, **kwargs) -> np.ndarray:
    with addnoise_from(seed):
        out = v2v[1](
            video=video,
            prompt=PROMPT,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
            max_sequence_length=32,
            **forcing,
            **kwargs,
        )
    return to_uint8(out.frames)


CASES = [
    # (input frames, num_frames, steps, forcing, guidance)
    (
        6,
        13,
        3,
        {"overlap_history": 5, "causal_block_size": 1},
        {"guidance_scale": 6.0, "negative_prompt": "blurry"},
    ),
    (6, 13, 3, {"overlap_history": 5, "causal_block_size": 1}, {"guidance_scale": 1.0}),
    (6, 13, 3, {"overlap_history": 5, "ar_step": 1, "causal_block_size": 1}, {"guidance_scale": 6.0}),
    (
        6,
        13,
        3,
        {"overlap_history": 5, "ar_step": 1, "causal_block_size": 1},
        {"guidance_scale": 1.0, "fps": 16},
    ),
    # 9 frames back give 3 latent frames, cut to one block of 2 (Diffusers' truncation); blocks lag by 2 steps.
    (9, 21, 2, {"overlap_history": 9, "ar_step": 2, "causal_block_size": 2}, {"guidance_scale": 5.0}),
    # A clip shorter than overlap_history: all of it is encoded (its 4 frames: 1 latent frame).
    (4, 25, 2, {"overlap_history": 17, "causal_block_size": 1}, {"guidance_scale": 5.0}),
    # 17 frames (5 latent) in windows of 9 (3) continuing 5 frames (2) back: three windows.
    (
        6,
        17,
        2,
        {"overlap_history": 5, "base_num_frames": 9, "addnoise_condition": 20.0, "causal_block_size": 1},
        {"guidance_scale": 5.0},
    ),
    (
        6,
        17,
        2,
        {"overlap_history": 5, "base_num_frames": 9, "ar_step": 1, "causal_block_size": 1},
        {"guidance_scale": 1.0},
    ),
]
IDS = [
    "sync-cfg",
    "sync-no-cfg",
    "ar1-cfg",
    "ar1-no-cfg",
    "ar2-block2-truncated",
    "short-clip",
    "long-sync-addnoise",
    "long-ar1-no-cfg",
]


@pytest.mark.parametrize(("given", "frames", "steps", "forcing", "guidance"), CASES, ids=IDS)
def test_video_extension_matches_diffusers(v2v, given, frames, steps, forcing, guidance) -> None:
    kwargs = dict(**SIZE, num_frames=frames, num_inference_steps=steps, **guidance)
    video = input_video(given, seed=1)
    got, want = ours(v2v, video, 3, forcing, **kwargs), reference(v2v, video, 3, forcing, **kwargs)
    # The input's frames, then the decoded latents (re-encoded overlap included): num_frames of them.
    assert got.shape == (1, given + frames, 32, 32, 3)
    control = ours(v2v, input_video(given, seed=2), 3, forcing, **kwargs)
    assert_images_match(
        got[:, given:],
        want[:, given:],
        f"SkyReels-V2 DF V2V generated frames {forcing} {guidance}",
        min_db=PSNR_BAR_DB,
        control=control[:, given:],
    )
    matched = assert_images_match(got, want, f"SkyReels-V2 DF V2V {forcing} {guidance}", min_db=PSNR_BAR_DB)
    if forcing.get("addnoise_condition"):
        # The conditioning noise is faint: show that the match needs it (without it, far from Diffusers).
        without = ours(v2v, video, 3, {**forcing, "addnoise_condition": 0.0}, **kwargs)
        assert psnr_uint8(without, want) < matched - 20


def test_requests_of_several_modes_batched_match_each_alone(v2v) -> None:
    """Synchronous, asynchronous and long extensions of different videos share steps (one latent shape),
    each at its own rows; each gives what it gives alone. (One engine serves one folder, so a text-to-video
    diffusion-forcing request cannot join them: its folder is another family's.)"""
    common = dict(**SIZE, num_inference_steps=2, guidance_scale=6.0, seed=11, max_sequence_length=32)
    params = [
        SamplingParams(
            prompt="sync",
            num_frames=13,
            input_video=input_video(6, 1),
            extra={"overlap_history": 5},
            **common,
        ),
        SamplingParams(
            prompt="async",
            num_frames=13,
            input_video=input_video(7, 2),
            extra={"overlap_history": 5, "ar_step": 1},
            **common,
        ),
        SamplingParams(
            prompt="long",
            num_frames=21,
            input_video=input_video(5, 3),
            extra={"overlap_history": 5, "base_num_frames": 13},
            **common,
        ),
    ]

    def steps_as_diffusers(requests) -> None:
        timesteps = requests[0].conditioning.frame_schedule.timesteps.long()

        def rows(frames: int, ar_step: int, ready: int) -> int:
            matrix = SkyReelsV2DiffusionForcingVideoToVideoPipeline.generate_timestep_matrix(
                None, frames, timesteps, frames, ar_step, ready
            )[0]
            return len(matrix)

        # Long: 6 latent frames in windows of 4 continuing 2 back: two windows of 4, each with 2 ready.
        assert [r.num_steps for r in requests] == [rows(4, 0, 2), rows(4, 1, 2), 2 * rows(4, 0, 2)]

    step_sizes = assert_batched_as_alone(v2v[0], params, "SkyReels-V2 DF V2V", steps_as_diffusers, video=True)
    assert step_sizes[0] == 3


def test_video_as_arrays_is_the_video_as_images(v2v) -> None:
    video = input_video(6, 1)
    kwargs = dict(**SIZE, num_frames=9, num_inference_steps=1, guidance_scale=1.0)
    as_images = ours(v2v, video, 4, {"overlap_history": 5}, **kwargs)
    as_array = ours(v2v, np.stack([np.asarray(f) for f in video]), 4, {"overlap_history": 5}, **kwargs)
    assert np.array_equal(as_images, as_array)


def test_refusals(v2v, tmp_path) -> None:
    generator = v2v[0]
    kwargs = dict(**SIZE, num_frames=13, num_inference_steps=1, max_sequence_length=32)
    with pytest.raises(InvalidRequestError, match="video=") as missing:
        generator.generate(prompt=PROMPT, extra={"overlap_history": 5}, **kwargs)
    assert missing.value.param == "video"
    with pytest.raises(InvalidRequestError, match="needs overlap_history"):
        generator.generate(prompt=PROMPT, video=input_video(6, 1), **kwargs)
    with pytest.raises(InvalidRequestError, match="more latent frames than overlap_history"):
        generator.generate(prompt=PROMPT, video=input_video(6, 1), extra={"overlap_history": 13}, **kwargs)
    with pytest.raises(InvalidRequestError, match="shorter than a window"):
        generator.generate(
            prompt=PROMPT,
            video=input_video(6, 1),
            extra={"overlap_history": 9, "base_num_frames": 9},
            **kwargs,
        )
    with pytest.raises(InvalidRequestError, match="takes no input image"):
        generator.generate(
            prompt=PROMPT,
            image=input_video(1, 1)[0],
            video=input_video(6, 1),
            extra={"overlap_history": 5},
            **kwargs,
        )
    # Another family refuses an input video, naming the field.
    root = build_tiny_skyreels_v2(tmp_path / "df", TinySkyReelsV2Spec(diffusion_forcing=True))
    t2v = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    with pytest.raises(InvalidRequestError, match="video is not a parameter") as refused:
        t2v.generate(prompt=PROMPT, video=input_video(6, 1), **kwargs)
    assert refused.value.param == "video"


def test_defaults_are_diffusers(v2v) -> None:
    """544x960, 120 frames rounded down to 4k+1 (Diffusers' own rounding), CFG 6.0, 50 steps."""
    params = v2v[0].pipeline.resolve_params(
        SamplingParams(prompt=PROMPT, input_video=input_video(2, 1), extra={"overlap_history": 17})
    )
    assert (params.height, params.width, params.num_frames) == (544, 960, 117)
    assert (params.guidance_scale, params.num_inference_steps, params.fps) == (6.0, 50, 24)
