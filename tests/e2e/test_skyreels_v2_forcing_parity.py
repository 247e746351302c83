"""SkyReels-V2 diffusion forcing beyond the synchronous one-window mode: diffserve against Diffusers'
SkyReelsV2DiffusionForcingPipeline on one tiny random-weight folder, same seed, frames as uint8 (PSNR >= 40 dB):
the asynchronous mode (`ar_step` > 0, causal blocks of 1 and 2 frames), long videos in several windows
(`overlap_history`, `addnoise_condition`), and such requests batched with a synchronous one.

Diffusers draws `addnoise_condition`'s noise from the global RNG (`torch.randn_like`); diffserve from a
generator of the request's own (`addnoise_seed`), which the reference is given here in its place. Every
reference call passes `causal_block_size`: Diffusers writes it into its DiT's config, where the next call
would find it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (
    SkyReelsV2DiffusionForcingImageToVideoPipeline,
    SkyReelsV2DiffusionForcingPipeline,
)

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.wan.skyreels_v2_forcing_plan import WindowShape, window_plan, window_shapes
from diffserve.families.wan.skyreels_v2_forcing_state import addnoise_seed
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    diffusers_uint8,
    generator_and_reference,
    gradient_image,
    smooth_random_image,
)
from diffserve.testing.video_parity import randn_like_from

PSNR_BAR_DB = 40.0
PROMPT = "a red fox running through snow"
OTHER_PROMPT = "a lighthouse at dusk"
SIZE = dict(height=32, width=32)


@pytest.fixture(scope="module")
def df(tmp_path_factory):
    spec = TinySkyReelsV2Spec(diffusion_forcing=True)
    root = build_tiny_skyreels_v2(tmp_path_factory.mktemp("skyreels-v2-df-forcing"), spec)
    return generator_and_reference(DiffGenerator, root, SkyReelsV2DiffusionForcingPipeline)


def addnoise_from(seed: int):
    """Diffusers' `torch.randn_like` drawing from diffserve's addnoise generator for a request seeded `seed`."""
    return randn_like_from(addnoise_seed(seed))


def generate_both(
    df, seed: int, forcing: dict, prompt: str = PROMPT, **kwargs
) -> tuple[np.ndarray, np.ndarray]:
    """diffserve's frames (the forcing settings in `extra`) and Diffusers' (as keywords), uint8."""
    ours, reference = df
    out = ours.generate(prompt=prompt, seed=seed, max_sequence_length=32, extra=forcing, **kwargs)
    with addnoise_from(seed):
        ref = diffusers_uint8(
            reference, seed=seed, video=True, prompt=prompt, max_sequence_length=32, **forcing, **kwargs
        )
    return np.stack(out.frames), ref


@pytest.mark.parametrize(
    ("frames", "steps", "forcing", "guidance"),
    [
        (9, 3, {"ar_step": 1, "causal_block_size": 1}, {"guidance_scale": 6.0, "negative_prompt": "blurry"}),
        (9, 3, {"ar_step": 1, "causal_block_size": 1}, {"guidance_scale": 1.0}),
        # Blocks of 2 frames on a DiT of 1: the block-causal attention and the block's shared schedule.
        (13, 3, {"ar_step": 2, "causal_block_size": 2}, {"guidance_scale": 6.0, "fps": 16}),
    ],
    ids=["ar1-block1-cfg", "ar1-block1-no-cfg", "ar2-block2-cfg"],
)
def test_asynchronous_forcing_matches_diffusers(df, frames, steps, forcing, guidance) -> None:
    kwargs = dict(**SIZE, num_frames=frames, num_inference_steps=steps, **guidance)
    ours, ref = generate_both(df, 3, forcing, **kwargs)
    control = np.stack(
        df[0].generate(prompt=OTHER_PROMPT, seed=3, max_sequence_length=32, extra=forcing, **kwargs).frames
    )
    assert_images_match(
        ours,
        ref,
        f"SkyReels-V2 DF async {forcing} {guidance}",
        min_db=PSNR_BAR_DB,
        shape=(1, frames, 32, 32, 3),
        control=control,
    )


@pytest.mark.parametrize(
    "forcing",
    [
        {"overlap_history": 5, "addnoise_condition": 20.0, "causal_block_size": 1},
        {"overlap_history": 5, "ar_step": 1, "causal_block_size": 1},
    ],
    ids=["sync-addnoise", "async"],
)
def test_long_video_matches_diffusers(df, forcing) -> None:
    """17 frames (5 latent) in windows of 9 (3 latent) starting 5 frames (2 latent) back: three windows."""
    forcing = {"base_num_frames": 9, **forcing}
    kwargs = dict(**SIZE, num_frames=17, num_inference_steps=2, guidance_scale=5.0)
    ours, ref = generate_both(df, 7, forcing, **kwargs)
    control = np.stack(
        df[0].generate(prompt=OTHER_PROMPT, seed=7, max_sequence_length=32, extra=forcing, **kwargs).frames
    )
    matched = assert_images_match(
        ours,
        ref,
        f"SkyReels-V2 DF long video {forcing}",
        min_db=PSNR_BAR_DB,
        shape=(1, 17, 32, 32, 3),
        control=control,
    )
    if forcing.get("addnoise_condition"):
        # The conditioning noise is too faint to move the tiny model's frames below the bar: show instead that
        # the match needs it (the same request without it is far further from Diffusers).
        plain = {**forcing, "addnoise_condition": 0.0}
        without = np.stack(
            df[0].generate(prompt=PROMPT, seed=7, max_sequence_length=32, extra=plain, **kwargs).frames
        )
        assert psnr_uint8(without, ref) < matched - 20


def test_sync_async_and_long_requests_batched_match_each_alone(df) -> None:
    """A synchronous, an asynchronous and a long-video request share steps (one latent shape) while each runs
    its own rows; each gives what it gives alone, and runs as many steps as Diffusers' step matrices have rows."""
    ours, _ = df
    common = dict(**SIZE, num_inference_steps=2, guidance_scale=6.0, seed=11, max_sequence_length=32)
    params = [
        SamplingParams(prompt="sync", num_frames=9, extra={"ar_step": 0}, **common),
        SamplingParams(prompt="async", num_frames=9, extra={"ar_step": 1}, **common),
        SamplingParams(
            prompt="long", num_frames=17, extra={"base_num_frames": 9, "overlap_history": 5}, **common
        ),
    ]

    def rows_as_diffusers(requests) -> None:
        timesteps = requests[0].conditioning.frame_schedule.timesteps.long()
        expected = [
            len(SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(None, 3, timesteps, 3, 0)[0]),
            len(SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(None, 3, timesteps, 3, 1)[0]),
            len(SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(None, 3, timesteps, 3, 0)[0])
            + 2
            * len(
                SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(None, 3, timesteps, 3, 0, 2)[0]
            ),
        ]
        assert [r.num_steps for r in requests] == expected

    step_sizes = assert_batched_as_alone(ours, params, "SkyReels-V2 DF", rows_as_diffusers, video=True)
    assert step_sizes[0] == 3


@pytest.mark.parametrize(
    ("frames", "ar_step", "block", "ready"),
    [(6, 0, 1, 0), (6, 1, 1, 0), (6, 3, 2, 0), (8, 2, 2, 2), (9, 1, 3, 3), (5, 4, 1, 2)],
)
def test_step_matrix_is_diffusers(frames, ar_step, block, ready) -> None:
    """Each row's per-frame timesteps, progress and update mask, as `generate_timestep_matrix` gives them."""
    timesteps = torch.tensor([999, 960, 875, 700, 400], dtype=torch.int64)
    matrix, progress, update, _ = SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(
        None, frames, timesteps, frames, ar_step, ready, block
    )
    plan = window_plan(
        WindowShape(frames, ready, ready), timesteps.float(), ar_step, block, 0, torch.device("cpu")
    )
    assert torch.equal(plan.timesteps, matrix.float())
    assert torch.equal(torch.tensor(plan.progress), progress)
    assert torch.equal(torch.tensor(plan.updated), update)


def test_long_video_windows_are_diffusers() -> None:
    """Diffusers' windows of 97-frame (25 latent) base and 17-frame (5 latent) overlap, over 257 frames (65)."""
    windows = window_shapes(65, 5, 25, 5)
    assert [w.frames for w in windows] == [25, 25, 25]
    assert [w.prefix for w in windows] == [0, 5, 5]
    assert 25 + sum(w.frames - w.overlap for w in windows[1:]) == 65
    # An overlap of 7 latent frames keeps 6 in blocks of 2 (Diffusers truncates the prefix).
    assert window_shapes(40, 2, 20, 7)[1] == WindowShape(20, 6, 7)


def test_refuses_what_diffusers_cannot_run(df) -> None:
    ours, _ = df
    kwargs = dict(**SIZE, num_inference_steps=1)
    # 25 frames (7 latent) in windows of 13 (4), 5 back (2): the last window has 3 frames, not blocks of 2.
    with pytest.raises(InvalidRequestError, match="window 2 has 3 latent frames"):
        ours.generate(
            prompt=PROMPT,
            num_frames=25,
            extra={"base_num_frames": 13, "overlap_history": 5, "causal_block_size": 2},
            **kwargs,
        )
    with pytest.raises(InvalidRequestError, match="overlap_history"):
        ours.generate(prompt=PROMPT, num_frames=17, extra={"base_num_frames": 9}, **kwargs)


@pytest.fixture(scope="module")
def df_i2v(tmp_path_factory):
    spec = TinySkyReelsV2Spec(diffusion_forcing=True, image_to_video=True)
    root = build_tiny_skyreels_v2(tmp_path_factory.mktemp("skyreels-v2-df-i2v"), spec)
    return generator_and_reference(DiffGenerator, root, SkyReelsV2DiffusionForcingImageToVideoPipeline)


@pytest.mark.parametrize(
    ("frames", "forcing"),
    [
        (9, {"ar_step": 1, "causal_block_size": 1}),
        # Two windows, each continuing from the one before; the image noised anew at every step.
        (
            13,
            {"base_num_frames": 9, "overlap_history": 5, "addnoise_condition": 20.0, "causal_block_size": 1},
        ),
        # Blocks of 2: the image's frame is no whole block, so Diffusers steps it with the frame after it.
        (13, {"ar_step": 1, "causal_block_size": 2}),
    ],
    ids=["async", "long-addnoise", "async-block2"],
)
def test_image_to_video_forcing_matches_diffusers(df_i2v, frames, forcing) -> None:
    """The input image's latents are the first latent frame, given like a long video's prefix."""
    ours, reference = df_i2v
    kwargs = dict(
        **SIZE, num_frames=frames, num_inference_steps=2, guidance_scale=5.0, max_sequence_length=32
    )
    image = gradient_image(width=48, height=40)
    out = np.stack(ours.generate(prompt=PROMPT, image=image, seed=5, extra=forcing, **kwargs).frames)
    with addnoise_from(5):
        ref = diffusers_uint8(reference, seed=5, video=True, image=image, prompt=PROMPT, **forcing, **kwargs)
    control = np.stack(
        ours.generate(prompt=OTHER_PROMPT, image=image, seed=5, extra=forcing, **kwargs).frames
    )
    assert_images_match(
        out,
        ref,
        f"SkyReels-V2 DF I2V {forcing}",
        min_db=PSNR_BAR_DB,
        shape=(1, frames, 32, 32, 3),
        control=control,
    )
    if forcing["causal_block_size"] == 1:  # the image's frame is kept: another image moves the video
        other = smooth_random_image(width=48, height=40, seed=1)
        moved = np.stack(ours.generate(prompt=PROMPT, image=other, seed=5, extra=forcing, **kwargs).frames)
        assert psnr_uint8(moved, ref) < PSNR_BAR_DB


def test_image_to_video_forcing_defaults_are_diffusers(df_i2v) -> None:
    """544x960 whatever the image's aspect ratio, 97 frames, CFG 5.0, 50 steps, as Diffusers' __call__."""
    ours, _ = df_i2v
    params = ours.pipeline.resolve_params(
        SamplingParams(prompt=PROMPT, input_images=[gradient_image(width=80, height=40)])
    )
    assert (params.height, params.width, params.num_frames) == (544, 960, 97)
    assert (params.guidance_scale, params.num_inference_steps) == (5.0, 50)
    with pytest.raises(InvalidRequestError):
        ours.generate(prompt=PROMPT, **SIZE, num_frames=5, num_inference_steps=1)  # no image
