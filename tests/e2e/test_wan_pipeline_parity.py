"""Whole Wan 2.1 generations: diffserve against Diffusers' WanPipeline / WanImageToVideoPipeline.

Same folder, same seed, non-square size, 9 frames; frames compared as uint8 (PSNR >= 40 dB). Both the
flow-match Euler scheduler and the released checkpoints' UniPC scheduler are covered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline

from diffserve import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import assert_images_match, diffusers_uint8, gradient_image

PSNR_BAR_DB = 40.0
PROMPT = "a red fox running through snow"


@pytest.fixture(scope="module", params=["flow-match-euler", "unipc"])
def t2v(request, tmp_path_factory):
    root = build_tiny_wan(
        tmp_path_factory.mktemp(f"wan-{request.param}"), TinyWanSpec(scheduler=request.param)
    )
    return (
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False),
        WanPipeline.from_pretrained(root, torch_dtype=torch.float32),
    )


@pytest.mark.parametrize(
    ("height", "width", "frames", "steps", "extra"),
    [
        (48, 32, 9, 3, {"guidance_scale": 5.0, "negative_prompt": "blurry"}),  # CFG, non-square
        (32, 64, 5, 2, {"guidance_scale": 1.0}),  # no CFG
    ],
)
def test_wan_t2v_frames_match_diffusers(t2v, height, width, frames, steps, extra) -> None:
    ours, reference = t2v
    kwargs = dict(height=height, width=width, num_frames=frames, num_inference_steps=steps, **extra)
    out = ours.generate(prompt=PROMPT, seed=3, max_sequence_length=64, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=3, video=True, prompt=PROMPT, max_sequence_length=64, **kwargs)
    label = f"Wan T2V {frames}x{height}x{width} {extra}"
    shape = (1, frames, height, width, 3)
    assert_images_match(np.stack(out.frames), ref_u8, label, min_db=PSNR_BAR_DB, shape=shape)


def test_wan_cfg_changes_the_video(t2v) -> None:
    ours, _ = t2v
    kwargs = dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=1)
    guided = ours.generate(prompt=PROMPT, guidance_scale=6.0, negative_prompt="ugly", **kwargs)
    plain = ours.generate(prompt=PROMPT, guidance_scale=1.0, **kwargs)
    assert psnr(np.stack(guided.frames), np.stack(plain.frames)) < 35


def test_wan_rejects_bad_frame_counts_and_image_params(t2v) -> None:
    ours, _ = t2v
    with pytest.raises(InvalidRequestError, match=r"num_frames must be 4k\+1.*try 9 or 13") as info:
        ours.generate(prompt=PROMPT, num_frames=10, height=32, width=32, num_inference_steps=1)
    assert info.value.param == "num_frames"
    with pytest.raises(InvalidRequestError, match="true_cfg_scale"):
        ours.generate(
            prompt=PROMPT, true_cfg_scale=3.0, height=32, width=32, num_frames=5, num_inference_steps=1
        )


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    root = build_tiny_wan(tmp_path_factory.mktemp("wan-i2v"), TinyWanSpec(image_to_video=True))
    return (
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False),
        WanImageToVideoPipeline.from_pretrained(root, torch_dtype=torch.float32),
    )


@pytest.mark.parametrize(
    "extra", [{"guidance_scale": 5.0, "negative_prompt": "static"}, {"guidance_scale": 1.0}]
)
def test_wan_i2v_frames_match_diffusers(i2v, extra) -> None:
    ours, reference = i2v
    image = gradient_image(width=60, height=40)
    kwargs = dict(height=32, width=48, num_frames=9, num_inference_steps=2, **extra)
    # Diffusers' I2V attention finds the image tokens by assuming exactly 512 text tokens: keep the default.
    out = ours.generate(prompt=PROMPT, image=image, seed=4, **kwargs)
    ref_u8 = diffusers_uint8(reference, seed=4, video=True, image=image, prompt=PROMPT, **kwargs)
    shape = (1, 9, 32, 48, 3)
    assert_images_match(np.stack(out.frames), ref_u8, f"Wan I2V {extra}", min_db=PSNR_BAR_DB, shape=shape)


def test_wan_i2v_defaults_to_the_input_aspect_ratio(i2v) -> None:
    ours, _ = i2v
    params = ours.pipeline.resolve_params(
        __import__("diffserve").SamplingParams(
            prompt=PROMPT, input_images=[gradient_image(width=80, height=40)]
        )
    )
    assert params.width / params.height == pytest.approx(2.0, rel=0.1)
    assert params.height % 16 == 0 and params.width % 16 == 0


def test_half_a14b_folders_are_refused(tmp_path) -> None:
    """A second expert (`transformer_2`) without `boundary_ratio` would be silently ignored, and a
    `boundary_ratio` without it cannot run (Wan 2.2 itself: tests/e2e/test_wan22_pipeline_parity.py)."""
    import json
    import shutil

    from diffserve.errors import ModelLoadError

    root = build_tiny_wan(tmp_path / "wan")
    index_path = root / "model_index.json"
    index = json.loads(index_path.read_text())
    shutil.copytree(root / "transformer", root / "transformer_2")
    index_path.write_text(json.dumps({**index, "transformer_2": ["diffusers", "WanTransformer3DModel"]}))
    with pytest.raises(ModelLoadError, match="transformer_2"):
        DiffGenerator.from_pretrained(root, device="cpu")
    index_path.write_text(json.dumps({**index, "transformer_2": [None, None], "boundary_ratio": 0.9}))
    with pytest.raises(ModelLoadError, match="boundary_ratio"):
        DiffGenerator.from_pretrained(root, device="cpu")


@pytest.fixture(scope="module")
def flf2v(tmp_path_factory):
    spec = TinyWanSpec(image_to_video=True, first_last_frame=True)
    root = build_tiny_wan(tmp_path_factory.mktemp("wan-flf2v"), spec)
    return (
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False),
        WanImageToVideoPipeline.from_pretrained(root, torch_dtype=torch.float32),
    )


def test_wan_flf2v_first_and_last_frames_match_diffusers(flf2v) -> None:
    """FLF2V (the DiT's `pos_embed_seq_len`): the second input image is Diffusers' `last_image` (its CLIP
    states after the first's, the last conditioning frame); one image alone is refused (Diffusers fails)."""
    ours, reference = flf2v
    first, last = gradient_image(width=60, height=40), gradient_image(width=40, height=60)
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=1.0)
    out = ours.generate(prompt=PROMPT, image=[first, last], seed=4, **kwargs)
    ref_u8 = diffusers_uint8(
        reference, seed=4, video=True, image=first, last_image=last, prompt=PROMPT, **kwargs
    )
    assert_images_match(
        np.stack(out.frames), ref_u8, "Wan FLF2V", min_db=PSNR_BAR_DB, shape=(1, 5, 32, 48, 3)
    )
    with pytest.raises(InvalidRequestError, match="two input images"):
        ours.generate(prompt=PROMPT, image=first, seed=4, **kwargs)
    with pytest.raises(InvalidRequestError, match="num_frames must be at least 2"):
        ours.generate(prompt=PROMPT, image=[first, last], seed=4, **{**kwargs, "num_frames": 1})


def test_folders_diffusers_runs_otherwise_are_refused(tmp_path) -> None:
    """Configs Diffusers' Wan pipelines size or schedule differently from their network, or fail on, are
    refused at load naming the key: a VAE `scale_factor_spatial` other than its network's compression
    (Diffusers sizes the latents by it), `use_dynamic_shifting` (Diffusers passes no mu), and a VAE without
    temporal compression (Diffusers adds a frame to every request)."""
    import json
    from types import SimpleNamespace

    from diffserve.errors import ModelLoadError
    from diffserve.families.wan.folder_checks import refuse_no_temporal_compression
    from diffserve.loader.folder_fit import refuse_dynamic_shifting_without_mu
    from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan

    root = build_tiny_wan(tmp_path / "wan")
    path = root / "vae" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "scale_factor_spatial": 16}))
    with pytest.raises(ModelLoadError, match="scale_factor_spatial is 16"):
        DiffGenerator.from_pretrained(root, device="cpu")
    with pytest.raises(ModelLoadError, match="use_dynamic_shifting"):
        refuse_dynamic_shifting_without_mu(
            SimpleNamespace(config={"use_dynamic_shifting": True}), "WanPipeline"
        )
    with torch.device("meta"):
        vae = AutoencoderKLWan(base_dim=8, temperal_downsample=(False, False, False))
    with pytest.raises(ModelLoadError, match="no temporal compression"):
        refuse_no_temporal_compression(vae)
