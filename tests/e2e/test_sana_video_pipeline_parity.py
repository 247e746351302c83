"""Whole SANA-Video generations: diffserve against Diffusers' SanaVideoPipeline, same tiny folder and seed.

fp32, 2 or 3 steps of the flow DPM-Solver++ the released folders ship (3 reaches its second-order update),
prompts through the video instruction (Diffusers' default), non-square sizes, 5 and 9 frames, CFG on and
off, two videos per prompt, and a folder with LTX-2's video VAE (the 720p models'). Resolution binning is turned off in these runs (Diffusers'
`use_resolution_binning=False`): the tiny DiT's bins are the released 480p ones, too large for a quick test;
the bin choice and the resize back are compared with Diffusers' own functions instead.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from diffusers import SanaVideoPipeline
from diffusers.video_processor import VideoProcessor
from sana_text_checks import prompt_and_negative_encodings

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.families.sana_video.config import BINS_BY_SAMPLE_SIZE
from diffserve.families.sana_video.stages import nearest_bin, resize_and_crop_video
from diffserve.families.sana_video.tiny import TinySanaVideoSpec, build_tiny_sana_video
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.parity import (
    assert_images_match,
    denoise_together,
    diffusers_uint8,
    generator_and_reference,
    max_pixel_diff,
)

PSNR_BAR_DB = 40.0
PROMPT = "A red Fox running in the snow"
NO_BINNING = {"use_resolution_binning": False}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = build_tiny_sana_video(tmp_path_factory.mktemp("sana-video"))
    return generator_and_reference(DiffGenerator, root, SanaVideoPipeline)


@pytest.fixture(scope="module")
def ltx2_vae_engines(tmp_path_factory):
    """A folder with LTX-2's video VAE (32x, 8x: frames 8k+1), as the 720p models ship, and a 1x1x1 patch."""
    spec = TinySanaVideoSpec(vae="ltx2-video", patch_size=(1, 1, 1))
    root = build_tiny_sana_video(tmp_path_factory.mktemp("sana-video-ltx2-vae"), spec)
    return generator_and_reference(DiffGenerator, root, SanaVideoPipeline)


def _ours(gen: DiffGenerator, prompt: str, **kwargs) -> np.ndarray:
    return np.stack(gen.generate(prompt=prompt, extra=NO_BINNING, max_sequence_length=64, **kwargs).frames)


@pytest.mark.parametrize(
    ("height", "width", "frames", "steps", "n", "extra"),
    [
        # CFG with a negative prompt, two videos per prompt, 5 frames (the smallest above one latent frame).
        (32, 64, 5, 2, 2, {"guidance_scale": 6.0, "negative_prompt": "Blurry, jittery"}),
        # No CFG, 9 frames, 3 steps: DPM-Solver++'s second-order update.
        (64, 32, 9, 3, 1, {"guidance_scale": 1.0}),
    ],
)
def test_sana_video_frames_match_diffusers(engines, height, width, frames, steps, n, extra) -> None:
    ours, reference = engines
    kwargs = dict(height=height, width=width, num_inference_steps=steps, seed=3, **extra)
    got = _ours(ours, PROMPT, num_frames=frames, num_outputs_per_prompt=n, **kwargs)
    want = diffusers_uint8(
        reference,
        video=True,
        prompt=PROMPT,
        frames=frames,
        num_videos_per_prompt=n,
        max_sequence_length=64,
        use_resolution_binning=False,
        **kwargs,
    )
    control = _ours(ours, "a blue bird on a branch", num_frames=frames, num_outputs_per_prompt=n, **kwargs)
    label = f"SANA-Video {frames}x{height}x{width} n={n} {extra}"
    db = assert_images_match(
        got, want, label, min_db=PSNR_BAR_DB, shape=(n, frames, height, width, 3), control=control
    )
    print(f"{label}: {db:.1f} dB against Diffusers; another prompt {psnr_uint8(control, want):.1f} dB")


def test_sana_video_with_ltx2_vae_matches_diffusers(ltx2_vae_engines) -> None:
    ours, reference = ltx2_vae_engines
    kwargs = dict(
        height=64, width=96, num_inference_steps=2, seed=4, guidance_scale=5.0, negative_prompt="ugly"
    )
    got = _ours(ours, PROMPT, num_frames=9, **kwargs)
    want = diffusers_uint8(
        reference,
        video=True,
        prompt=PROMPT,
        frames=9,
        max_sequence_length=64,
        use_resolution_binning=False,
        **kwargs,
    )
    control = _ours(ours, "a blue bird on a branch", num_frames=9, **kwargs)
    db = assert_images_match(
        got, want, "SANA-Video, LTX-2 VAE", min_db=PSNR_BAR_DB, shape=(1, 9, 64, 96, 3), control=control
    )
    print(f"SANA-Video with LTX-2's VAE: {db:.1f} dB against Diffusers")
    with pytest.raises(InvalidRequestError, match=r"num_frames must be 8k\+1"):
        ours.generate(prompt=PROMPT, num_frames=5, extra=NO_BINNING, **kwargs)
    with pytest.raises(InvalidRequestError, match="at least 64.*reflection"):
        ours.generate(prompt=PROMPT, num_frames=9, extra=NO_BINNING, **{**kwargs, "height": 32})


@pytest.mark.parametrize(("height", "width"), [(64, 96), (50, 100)])  # 50x100: binned, no multiple of 32
def test_resolution_binning_matches_diffusers(engines, monkeypatch, height, width) -> None:
    """The binned path whole (generate at the nearest bin, resize and crop back), on small stand-in bins
    given to both sides: the released 480p bins would make this test minutes long. With binning Diffusers
    takes any size (the bin is what must be a multiple of 32)."""
    import diffusers.pipelines.sana_video.pipeline_sana_video as reference_module

    ours, reference = engines
    small = (("0.5", 32, 64), ("1.0", 64, 64), ("2.0", 64, 32))
    monkeypatch.setattr(ours.pipeline.input_validation.bins, "bins", small)  # shared with latent preparation
    monkeypatch.setattr(reference_module, "ASPECT_RATIO_480_BIN", {k: [h, w] for k, h, w in small})
    kwargs = dict(
        height=height, width=width, num_inference_steps=2, seed=5, guidance_scale=4.0
    )  # the 32x64 bin
    got = np.stack(ours.generate(prompt=PROMPT, num_frames=5, max_sequence_length=64, **kwargs).frames)
    want = diffusers_uint8(reference, video=True, prompt=PROMPT, frames=5, max_sequence_length=64, **kwargs)
    other = ours.generate(prompt="a blue bird on a branch", num_frames=5, max_sequence_length=64, **kwargs)
    control = np.stack(other.frames)  # another prompt, binned the same way
    assert_images_match(
        got, want, f"SANA-Video binned {height}x{width} (at 32x64)", min_db=PSNR_BAR_DB,
        shape=(1, 5, height, width, 3), control=control,
    )  # fmt: skip


def test_step_batched_requests_match_each_alone(engines) -> None:
    """A CFG request and a no-CFG one with prompts of different lengths and different step counts share
    their DiT steps (text padded and masked); each video is within 1 level of the one it gets alone."""
    ours, _ = engines
    common = dict(height=32, width=32, num_frames=5, max_sequence_length=64, extra=NO_BINNING)
    params = [
        SamplingParams(prompt="a cat", seed=5, num_inference_steps=3, guidance_scale=5.0, **common),
        SamplingParams(
            prompt="a much longer prompt about a small boat on a calm lake at dawn",
            seed=6,
            num_inference_steps=2,
            guidance_scale=1.0,
            **common,
        ),
    ]
    alone = [np.stack(ours.generate_from_params(p).frames) for p in params]
    pipeline = ours.pipeline
    running = [pipeline.run_pre_denoise(pipeline.validate(Req(params=p))) for p in params]
    assert len({pipeline.batch_key(r) for r in running}) == 1
    done, step_sizes = denoise_together(pipeline, running)
    assert step_sizes[0] == 2
    for p, want in zip(params, alone, strict=True):
        got = np.stack(done[p.prompt].outputs.frames)
        diff = max_pixel_diff(got, want)
        print(
            f"SANA-Video batched vs alone {p.prompt!r}: max diff {diff}, PSNR {psnr_uint8(got, want):.1f} dB"
        )
        assert diff <= 1


def test_text_encoding_matches_diffusers(engines) -> None:
    """The prompt after the video instruction and the bare negative prompt: Diffusers' real tokens."""
    ours, reference = engines
    stage = ours.pipeline.stages[1]
    # The instruction SanaVideoPipeline.__call__ passes by default (encode_prompt's own default is none).
    instruction = (
        inspect.signature(SanaVideoPipeline.__call__).parameters["complex_human_instruction"].default
    )
    assert tuple(instruction) == ours.pipeline.config.complex_human_instruction
    for msl in (300, 6):  # 6: the prompt and the negative prompt are both truncated
        for got, want, mask in prompt_and_negative_encodings(stage, reference, instruction, msl):
            real = int(mask.sum())
            assert got.shape == (1, real, want.shape[-1])
            torch.testing.assert_close(got, want[:, :real], rtol=0, atol=0)


def test_resolution_binning_matches_diffusers_functions() -> None:
    """The bin each size snaps to, and the resize and centre crop back, as Diffusers' VideoProcessor."""
    for sample_size, bins in BINS_BY_SAMPLE_SIZE.items():
        table = {key: [float(h), float(w)] for key, h, w in bins}
        for height, width in ((480, 832), (720, 1280), (64, 64), (96, 32), (1000, 900), (32, 96)):
            want = VideoProcessor.classify_height_width_bin(height, width, ratios=table)
            assert nearest_bin(height, width, bins) == want, (sample_size, height, width)
    video = torch.randn(2, 3, 4, 48, 96, generator=torch.Generator().manual_seed(0))
    for height, width in ((40, 100), (64, 64), (48, 96), (30, 50)):
        want = VideoProcessor.resize_and_crop_tensor(video, width, height)
        torch.testing.assert_close(resize_and_crop_video(video, height, width), want, rtol=0, atol=0)


def test_requests_diffusers_refuses_are_refused_by_name(engines) -> None:
    ours, _ = engines
    base = dict(prompt=PROMPT, height=32, width=32, num_inference_steps=1)
    with pytest.raises(InvalidRequestError, match=r"num_frames must be 4k\+1.*try 5 or 9") as info:
        ours.generate(num_frames=6, extra=NO_BINNING, **base)
    assert info.value.param == "num_frames"
    # Square sizes bin to 624x624, which Diffusers' check (multiples of 32) refuses.
    with pytest.raises(InvalidRequestError, match=r"use_resolution_binning.*624x624.*multiple of 32"):
        ours.generate(num_frames=5, **base)
    with pytest.raises(InvalidRequestError, match="unknown setting.*'frames'.*use_resolution_binning"):
        ours.generate(num_frames=5, extra={"frames": 5}, **base)
    with pytest.raises(InvalidRequestError, match=r"use_resolution_binning'\] must be true or false"):
        ours.generate(num_frames=5, extra={"use_resolution_binning": "no"}, **base)
    with pytest.raises(InvalidRequestError, match="multiple of 32"):
        ours.generate(num_frames=5, extra=NO_BINNING, **{**base, "height": 48})
    with pytest.raises(InvalidRequestError, match="true_cfg_scale"):
        ours.generate(num_frames=5, true_cfg_scale=3.0, extra=NO_BINNING, **base)
