"""Whole SkyReels-V2 generations: diffserve against Diffusers' SkyReelsV2Pipeline /
SkyReelsV2ImageToVideoPipeline / SkyReelsV2DiffusionForcingPipeline (synchronous, one window) on one tiny
random-weight folder (`build_tiny_skyreels_v2`: UniPC with flow
sigmas, the released folders' scheduler), same seed; frames compared as uint8 (PSNR >= 40 dB), CFG on and off,
non-square sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import (
    SkyReelsV2DiffusionForcingPipeline,
    SkyReelsV2ImageToVideoPipeline,
    SkyReelsV2Pipeline,
)

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import (
    assert_images_match,
    diffusers_uint8,
    generator_and_reference,
    gradient_image,
)

PSNR_BAR_DB = 40.0
PROMPT = "a red fox running through snow"


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    root = build_tiny_skyreels_v2(tmp_path_factory.mktemp("skyreels-v2"))
    return generator_and_reference(DiffGenerator, root, SkyReelsV2Pipeline)


@pytest.mark.parametrize(
    ("height", "width", "frames", "steps", "extra"),
    [
        (48, 32, 9, 3, {"guidance_scale": 6.0, "negative_prompt": "blurry"}),  # CFG, non-square
        (32, 64, 5, 2, {"guidance_scale": 1.0}),  # no CFG
    ],
)
def test_skyreels_v2_t2v_frames_match_diffusers(t2v, height, width, frames, steps, extra) -> None:
    ours, reference = t2v
    kwargs = dict(height=height, width=width, num_frames=frames, num_inference_steps=steps, **extra)
    out = ours.generate(prompt=PROMPT, seed=3, max_sequence_length=64, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=3, video=True, prompt=PROMPT, max_sequence_length=64, **kwargs)
    label = f"SkyReels-V2 T2V {frames}x{height}x{width} {extra}"
    assert_images_match(
        np.stack(out.frames), ref_u8, label, min_db=PSNR_BAR_DB, shape=(1, frames, height, width, 3)
    )


def test_skyreels_v2_t2v_two_videos_per_prompt_match_diffusers(t2v) -> None:
    ours, reference = t2v
    kwargs = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=6.0)
    out = ours.generate(prompt=PROMPT, seed=5, num_outputs_per_prompt=2, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=5, video=True, prompt=PROMPT, num_videos_per_prompt=2, **kwargs)
    assert_images_match(
        np.stack(out.frames), ref_u8, "SkyReels-V2 T2V x2", min_db=PSNR_BAR_DB, shape=(2, 5, 32, 32, 3)
    )


def test_skyreels_v2_cfg_changes_the_video(t2v) -> None:
    ours, _ = t2v
    kwargs = dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=1)
    guided = ours.generate(prompt=PROMPT, guidance_scale=6.0, negative_prompt="ugly", **kwargs)
    plain = ours.generate(prompt=PROMPT, guidance_scale=1.0, **kwargs)
    assert psnr(np.stack(guided.frames), np.stack(plain.frames)) < 35


def test_skyreels_v2_defaults_are_diffusers(t2v) -> None:
    ours, _ = t2v
    params = ours.pipeline.resolve_params(SamplingParams(prompt=PROMPT))
    assert (params.height, params.width, params.num_frames) == (544, 960, 97)
    assert (params.guidance_scale, params.num_inference_steps, params.fps) == (6.0, 50, 24)


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    root = build_tiny_skyreels_v2(
        tmp_path_factory.mktemp("skyreels-v2-i2v"), TinySkyReelsV2Spec(image_to_video=True)
    )
    return generator_and_reference(DiffGenerator, root, SkyReelsV2ImageToVideoPipeline)


@pytest.mark.parametrize(
    "extra", [{"guidance_scale": 5.0, "negative_prompt": "static"}, {"guidance_scale": 1.0}]
)
def test_skyreels_v2_i2v_frames_match_diffusers(i2v, extra) -> None:
    ours, reference = i2v
    image = gradient_image(width=60, height=40)
    kwargs = dict(height=32, width=48, num_frames=9, num_inference_steps=2, **extra)
    # Diffusers' I2V attention finds the image tokens by assuming exactly 512 text tokens: keep the default.
    out = ours.generate(prompt=PROMPT, image=image, seed=4, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=4, video=True, image=image, prompt=PROMPT, **kwargs)
    assert_images_match(
        np.stack(out.frames), ref_u8, f"SkyReels-V2 I2V {extra}", min_db=PSNR_BAR_DB, shape=(1, 9, 32, 48, 3)
    )


def test_skyreels_v2_i2v_defaults_are_diffusers(i2v) -> None:
    """544x960 whatever the image's aspect ratio, CFG 5.0, as Diffusers' __call__."""
    ours, _ = i2v
    params = ours.pipeline.resolve_params(
        SamplingParams(prompt=PROMPT, input_images=[gradient_image(width=80, height=40)])
    )
    assert (params.height, params.width, params.num_frames, params.guidance_scale) == (544, 960, 97, 5.0)


@pytest.fixture(scope="module", params=[1, 2], ids=["frame-blocks-1", "frame-blocks-2"])
def df(request, tmp_path_factory):
    spec = TinySkyReelsV2Spec(diffusion_forcing=True, num_frame_per_block=request.param)
    root = build_tiny_skyreels_v2(tmp_path_factory.mktemp(f"skyreels-v2-df-{request.param}"), spec)
    return generator_and_reference(DiffGenerator, root, SkyReelsV2DiffusionForcingPipeline)


@pytest.mark.parametrize(
    ("height", "width", "frames", "steps", "extra"),
    [
        # CFG, non-square, 24 fps; 4 steps: UniPC's corrector after Diffusers' per-frame in-place writes
        (48, 32, 13, 4, {"guidance_scale": 6.0, "negative_prompt": "blurry"}),
        (32, 64, 5, 2, {"guidance_scale": 1.0, "fps": 16}),  # no CFG, the 16 fps index
    ],
)
def test_skyreels_v2_diffusion_forcing_frames_match_diffusers(
    df, height, width, frames, steps, extra
) -> None:
    """The synchronous one-window mode (ar_step 0): per-frame timesteps, fps injected, and with 2 frames a
    block the DiT's block-causal attention."""
    ours, reference = df
    kwargs = dict(height=height, width=width, num_frames=frames, num_inference_steps=steps, **extra)
    out = ours.generate(prompt=PROMPT, seed=3, max_sequence_length=64, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=3, video=True, prompt=PROMPT, max_sequence_length=64, **kwargs)
    blocks = reference.transformer.config.num_frame_per_block
    label = f"SkyReels-V2 DF ({blocks} frame(s) a block) {frames}x{height}x{width} {extra}"
    assert_images_match(
        np.stack(out.frames), ref_u8, label, min_db=PSNR_BAR_DB, shape=(1, frames, height, width, 3)
    )


def test_skyreels_v2_diffusion_forcing_refuses_unserved_modes(df) -> None:
    """What Diffusers fails on: a long video without overlap_history, an overlap as long as a window, a
    window of partial causal blocks. (The modes it serves: tests/e2e/test_skyreels_v2_forcing_parity.py.)"""
    ours, _ = df
    kwargs = dict(height=32, width=32, num_frames=5, num_inference_steps=1)
    with pytest.raises(InvalidRequestError, match="overlap_history"):
        ours.generate(prompt=PROMPT, **{**kwargs, "num_frames": 9}, extra={"base_num_frames": 5})
    with pytest.raises(InvalidRequestError, match="overlap_history"):
        ours.generate(
            prompt=PROMPT, **{**kwargs, "num_frames": 9}, extra={"base_num_frames": 5, "overlap_history": 5}
        )
    with pytest.raises(InvalidRequestError, match="causal block"):
        ours.generate(prompt=PROMPT, **{**kwargs, "num_frames": 9}, extra={"causal_block_size": 2})
    with pytest.raises(InvalidRequestError, match="unknown|not_a_setting"):
        ours.generate(prompt=PROMPT, extra={"not_a_setting": 1}, **kwargs)


def test_skyreels_v2_i2v_with_a_clip_processor_matches_diffusers(tmp_path) -> None:
    """The released I2V folders name a `CLIPProcessor` (image processor + CLIP tokenizer) as their
    image_processor; only its image part is used."""
    import json
    import shutil

    from transformers import CLIPImageProcessor, CLIPProcessor, CLIPTokenizer

    root = build_tiny_skyreels_v2(tmp_path / "i2v", TinySkyReelsV2Spec(image_to_video=True))
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"<|startoftext|>": 0, "<|endoftext|>": 1, "a</w>": 2, "a": 3}))
    merges.write_text("#version: 0.2\n")
    image_processor = CLIPImageProcessor.from_pretrained(root / "image_processor")
    shutil.rmtree(root / "image_processor")
    processor = CLIPProcessor(
        image_processor=image_processor, tokenizer=CLIPTokenizer(str(vocab), str(merges))
    )
    processor.save_pretrained(root / "image_processor")
    index = json.loads((root / "model_index.json").read_text())
    index["image_processor"] = ["transformers", "CLIPProcessor"]
    (root / "model_index.json").write_text(json.dumps(index))

    ours, reference = generator_and_reference(DiffGenerator, root, SkyReelsV2ImageToVideoPipeline)
    image = gradient_image(width=60, height=40)
    kwargs = dict(height=32, width=48, num_frames=9, num_inference_steps=2, guidance_scale=5.0)
    out = ours.generate(prompt=PROMPT, image=image, seed=4, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=4, video=True, image=image, prompt=PROMPT, **kwargs)
    assert_images_match(
        np.stack(out.frames),
        ref_u8,
        "SkyReels-V2 I2V, CLIPProcessor",
        min_db=PSNR_BAR_DB,
        shape=(1, 9, 32, 48, 3),
    )
