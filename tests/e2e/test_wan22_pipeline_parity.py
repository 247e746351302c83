"""Whole Wan 2.2 generations: diffserve against Diffusers' WanPipeline / WanImageToVideoPipeline on tiny
Wan 2.2 folders (fp32, same folder and seed, 5 frames, frames compared as uint8, PSNR >= 40 dB).

- A14B (two experts, `boundary_ratio` 0.875): with 3 flow-match steps the timesteps are about 1000, 750
  and 3, so the high-noise expert runs the first step and the low-noise one the other two; both are
  checked to run. CFG on (with its own `guidance_scale_2`) and off, non-square; a step batch holding
  requests on both sides of the boundary gives each what it gives alone.
- TI2V-5B (`expand_timesteps`, Wan 2.2's z_dim-48 VAE): text-to-video, and image-to-video from the same
  WanPipeline folder with a non-square input image (Diffusers: WanImageToVideoPipeline on its components).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import (
    assert_images_match,
    denoise_together,
    diffusers_uint8,
    gradient_image,
    max_pixel_diff,
)

PSNR_BAR_DB = 40.0
PROMPT = "a red fox running through snow"


def _check(label: str, ours: np.ndarray, ref: np.ndarray, shape: tuple[int, ...]) -> None:
    assert_images_match(ours, ref, label, min_db=PSNR_BAR_DB, shape=shape)


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    root = build_tiny_wan(tmp_path_factory.mktemp("wan22-a14b"), TinyWanSpec(variant="2.2-a14b"))
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    calls = [0, 0]
    for i, dit in enumerate(ours.pipeline.denoiser.transformers):
        dit.register_forward_hook(lambda *_args, i=i: calls.__setitem__(i, calls[i] + 1))
    return ours, WanPipeline.from_pretrained(root, torch_dtype=torch.float32), calls


@pytest.mark.parametrize(
    ("height", "width", "extra"),
    [
        (48, 32, {"guidance_scale": 5.0, "guidance_scale_2": 2.5, "negative_prompt": "blurry"}),
        (32, 64, {"guidance_scale": 4.0, "negative_prompt": "blurry"}),  # guidance_scale_2 unset
        (32, 48, {"guidance_scale": 1.0}),  # no CFG
    ],
)
def test_a14b_t2v_frames_match_diffusers(a14b, height, width, extra) -> None:
    ours, reference, calls = a14b
    kwargs = dict(height=height, width=width, num_frames=5, num_inference_steps=3, **extra)
    calls[:] = [0, 0]
    out = ours.generate(prompt=PROMPT, seed=3, max_sequence_length=64, **kwargs)
    assert calls == [1, 2], f"expected 1 high-noise and 2 low-noise expert steps, ran {calls}"
    ref = diffusers_uint8(reference, seed=3, video=True, prompt=PROMPT, max_sequence_length=64, **kwargs)
    _check(f"A14B T2V {height}x{width} {extra}", np.stack(out.frames), ref, (1, 5, height, width, 3))


def test_a14b_unipc_matches_diffusers(tmp_path) -> None:
    """The released A14B folders' UniPC scheduler: its multistep history carries across the switch."""
    root = build_tiny_wan(tmp_path / "wan22-a14b-unipc", TinyWanSpec(variant="2.2-a14b", scheduler="unipc"))
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = WanPipeline.from_pretrained(root, torch_dtype=torch.float32)
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=4, guidance_scale=5.0,
                  guidance_scale_2=3.0, negative_prompt="blurry", max_sequence_length=64)  # fmt: skip
    high_noise_steps = ours.pipeline.denoiser.switch.experts(4, 4, 6).count(0)
    assert 0 < high_noise_steps < 4, "the boundary must fall inside the schedule"
    out = ours.generate(prompt=PROMPT, seed=2, **kwargs)
    ref = diffusers_uint8(reference, seed=2, video=True, prompt=PROMPT, **kwargs)
    _check("A14B T2V UniPC 32x48", np.stack(out.frames), ref, (1, 5, 32, 48, 3))


def test_a14b_guidance_scale_2_changes_the_video(a14b) -> None:
    ours, _, _ = a14b
    kwargs = dict(height=32, width=32, num_frames=5, num_inference_steps=3, seed=1, negative_prompt="ugly")
    same = ours.generate(prompt=PROMPT, guidance_scale=5.0, **kwargs)
    other = ours.generate(prompt=PROMPT, guidance_scale=5.0, guidance_scale_2=1.5, **kwargs)
    assert psnr(np.stack(same.frames), np.stack(other.frames)) < 35


def test_a14b_batch_across_the_boundary_matches_alone(a14b) -> None:
    """One request on the low-noise expert and one on the high-noise expert share engine iterations:
    their batch keys differ, and a step over both runs each on its own expert."""
    ours, _, calls = a14b
    pipeline = ours.pipeline
    params = [
        SamplingParams(prompt=PROMPT, negative_prompt="dark", guidance_scale=5.0, guidance_scale_2=3.0,
                       height=32, width=48, num_frames=5, num_inference_steps=3, seed=5),
        SamplingParams(prompt="a boat at sea", guidance_scale=1.0, height=32, width=48, num_frames=5,
                       num_inference_steps=3, seed=6),
    ]  # fmt: skip
    alone = [np.stack(ours.generate_from_params(p).frames) for p in params]
    first = pipeline.run_pre_denoise(pipeline.validate(Req(params=params[0])))
    pipeline.denoise_step([first])  # now on the low-noise expert
    second = pipeline.run_pre_denoise(pipeline.validate(Req(params=params[1])))
    assert pipeline.denoiser.expert_of(first) == 1 and pipeline.denoiser.expert_of(second) == 0
    assert pipeline.batch_key(first) != pipeline.batch_key(second)
    calls[:] = [0, 0]
    pipeline.denoise_step([first, second])  # a mixed list: one DiT batch per expert
    assert calls == [1, 1]
    done, _ = denoise_together(pipeline, [first, second])
    for p, want in zip(params, alone, strict=True):
        got = np.stack(done[p.prompt].outputs.frames)
        diff = max_pixel_diff(got, want)
        print(f"A14B batched vs alone {p.prompt!r}: max diff {diff}, PSNR {psnr(got, want):.1f} dB")
        assert diff <= 1


@pytest.fixture(scope="module")
def a14b_i2v(tmp_path_factory):
    spec = TinyWanSpec(variant="2.2-a14b", image_to_video=True, boundary_ratio=0.9)
    root = build_tiny_wan(tmp_path_factory.mktemp("wan22-a14b-i2v"), spec)
    return (
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False),
        WanImageToVideoPipeline.from_pretrained(root, torch_dtype=torch.float32),
    )


def test_a14b_i2v_without_image_encoder_matches_diffusers(a14b_i2v) -> None:
    ours, reference = a14b_i2v
    assert reference.image_encoder is None
    image = gradient_image(width=60, height=40)
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=3, guidance_scale=4.0,
                  guidance_scale_2=2.0, negative_prompt="static")  # fmt: skip
    out = ours.generate(prompt=PROMPT, image=image, seed=4, **kwargs)
    ref = diffusers_uint8(reference, seed=4, video=True, image=image, prompt=PROMPT, **kwargs)
    _check("A14B I2V 32x48", np.stack(out.frames), ref, (1, 5, 32, 48, 3))


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    root = build_tiny_wan(tmp_path_factory.mktemp("wan22-ti2v"), TinyWanSpec(variant="2.2-ti2v"))
    t2v = WanPipeline.from_pretrained(root, torch_dtype=torch.float32)
    i2v = WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae, scheduler=t2v.scheduler,
        transformer=t2v.transformer, expand_timesteps=True,
    )  # fmt: skip
    return DiffGenerator.from_pretrained(root, device="cpu", show_progress=False), t2v, i2v


@pytest.mark.parametrize(
    "extra", [{"guidance_scale": 5.0, "negative_prompt": "blurry"}, {"guidance_scale": 1.0}]
)
def test_ti2v_t2v_frames_match_diffusers(ti2v, extra) -> None:
    ours, reference, _ = ti2v
    kwargs = dict(height=32, width=64, num_frames=5, num_inference_steps=3, **extra)
    out = ours.generate(prompt=PROMPT, seed=7, max_sequence_length=64, **kwargs)
    ref = diffusers_uint8(reference, seed=7, video=True, prompt=PROMPT, max_sequence_length=64, **kwargs)
    _check(f"TI2V T2V 32x64 {extra}", np.stack(out.frames), ref, (1, 5, 32, 64, 3))


def test_ti2v_i2v_frames_match_diffusers(ti2v) -> None:
    ours, _, reference = ti2v
    image = gradient_image(width=30, height=50)
    kwargs = dict(height=64, width=32, num_frames=5, num_inference_steps=3, guidance_scale=5.0,
                  negative_prompt="static")  # fmt: skip
    out = ours.generate(prompt=PROMPT, image=image, seed=8, max_sequence_length=64, **kwargs)
    ref = diffusers_uint8(
        reference, seed=8, video=True, image=image, prompt=PROMPT, max_sequence_length=64, **kwargs
    )
    _check("TI2V I2V 64x32", np.stack(out.frames), ref, (1, 5, 64, 32, 3))
    plain = ours.generate(prompt=PROMPT, seed=8, max_sequence_length=64, **kwargs)
    assert psnr(np.stack(out.frames), np.stack(plain.frames)) < 35, "the input image changed nothing"


def test_guidance_scale_2_needs_two_experts(ti2v) -> None:
    ours, _, _ = ti2v
    with pytest.raises(InvalidRequestError, match="guidance_scale_2"):
        ours.generate(
            prompt=PROMPT, guidance_scale_2=2.0, height=32, width=32, num_frames=5, num_inference_steps=1
        )


def test_a14b_i2v_last_frame_matches_diffusers(a14b_i2v) -> None:
    """Without CLIP (Wan 2.2 A14B), a second input image is Diffusers' optional `last_image`: the last frame
    of the conditioning video and of its mask."""
    ours, reference = a14b_i2v
    first, last = gradient_image(width=60, height=40), gradient_image(width=40, height=60)
    # Two steps at boundary 0.9 (timesteps 1000 and 500): one on each expert.
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=1.0)
    out = ours.generate(prompt=PROMPT, image=[first, last], seed=4, **kwargs)
    ref = diffusers_uint8(
        reference, seed=4, video=True, image=first, last_image=last, prompt=PROMPT, **kwargs
    )
    _check("A14B I2V first and last frames", np.stack(out.frames), ref, (1, 5, 32, 48, 3))


def test_any_boundary_ratio_runs_as_in_diffusers(a14b) -> None:
    """Diffusers compares each timestep with boundary_ratio * num_train_timesteps whatever the ratio: at 0
    every step is the high-noise expert's, above 1 every step the low-noise one's."""
    from types import SimpleNamespace

    from diffserve.families.wan.pipeline import WanPipeline

    scheduler = a14b[0].pipeline.denoiser.scheduler
    for ratio, expert in ((0.0, 0), (1.5, 1)):
        context = SimpleNamespace(
            pipeline_options={"boundary_ratio": ratio},
            get_optional=lambda _name: object(),
            get=lambda _name: scheduler,
        )
        switch = WanPipeline.expert_switch(context, 2)
        assert switch.experts(3, 4, 6) == (expert,) * 3
