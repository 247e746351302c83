"""Cache methods by name on HunyuanVideo 1.0, CogVideoX and Mochi 1 (issue 33): DBCache through their blocks
in ranges (HunyuanVideo 1.0: the double-stream blocks, then the single-stream ones, as cache-dit's adapter
counts them), the whole-span methods (TaylorSeer, TeaCache, SeaCache) over every block, and PAB, which
reuses attention outputs (every block runs).

Tiny random checkpoints with 4 (DBCache-counted) blocks, 10 steps, 32x32 (5 frames; Mochi 7), CFG as each
family runs it (HunyuanVideo 1.0: true CFG with a negative prompt, so each request has two branches).
DBCache that never reuses is the exact output pixel for pixel (the range path computes what the DiT's own
loop computes). The reusing settings are aggressive ones (`test_cache_methods_families.py`'s: threshold 1,
reuse after the warm-up, at most one step in a row); their PSNRs against the exact output, measured on
CPU with seed 7, are stated per case and the floors sit 4 dB below. A tiny random model's PSNRs say
nothing about a trained one's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import cache_method_checks as checks
import numpy as np
import pytest
from PIL import Image

from diffserve import DiffGenerator
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.families.hunyuan_video.image_to_video_tiny import (
    TinyHunyuanVideoI2VSpec,
    build_tiny_hunyuan_video_i2v,
)
from diffserve.families.hunyuan_video.tiny import TinyHunyuanVideoSpec, build_tiny_hunyuan_video
from diffserve.families.mochi.tiny import TinyMochiSpec, build_tiny_mochi
from diffserve.testing.cache_parity import assert_mixed_caches_as_alone
from diffserve.testing.image_metrics import psnr_uint8 as psnr

STEPS = 10
PROMPT = "a red fox in the snow"
CLIP = {"height": 32, "width": 32, "num_frames": 5}
SETTINGS = {
    "dbcache": checks.DBCACHE,
    "dbcache+taylorseer": checks.DBCACHE_TAYLORSEER,
    "taylorseer": {"method": "taylorseer"},  # cache-dit's defaults: reuse from step 3, every 5th computed
    "teacache": checks.TEACACHE,
    "seacache": {"method": "seacache"},  # diffusers' defaults: its probe is the latent video
    "pab": {"method": "pab"},  # diffusers' defaults: attention reuse, every block runs
}

#: name -> (builder, generation kwargs, {setting name: measured PSNR in dB}); measured with seed 7. SeaCache
#: with its defaults reuses none of the 10 steps of HunyuanVideo 1.0 (with true CFG) or CogVideoX, so it is
#: listed for Mochi only.
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any], dict[str, float]]] = {
    "hunyuan-video": (
        lambda root: build_tiny_hunyuan_video(root, TinyHunyuanVideoSpec(num_layers=2, num_single_layers=2)),
        {**CLIP, "true_cfg_scale": 4.0, "negative_prompt": "blurry"},
        {"dbcache": 19.6, "dbcache+taylorseer": 17.9, "taylorseer": 19.6, "teacache": 26.0, "pab": 21.1},
    ),
    "cogvideox": (
        lambda root: build_tiny_cogvideox(root, TinyCogVideoXSpec(variant="1.0-rope", num_layers=4)),
        {**CLIP, "guidance_scale": 6.0, "max_sequence_length": 40},
        {"dbcache": 18.5, "dbcache+taylorseer": 17.1, "taylorseer": 9.3, "teacache": 13.6, "pab": 21.3},
    ),
    "mochi": (
        lambda root: build_tiny_mochi(root, TinyMochiSpec(num_layers=4)),
        {**CLIP, "num_frames": 7, "guidance_scale": 4.5},
        {
            "dbcache": 33.9,
            "dbcache+taylorseer": 31.6,
            "taylorseer": 18.6,
            "teacache": 26.9,
            "seacache": 34.7,
            "pab": 35.9,
        },
    ),
}


def frames(out) -> np.ndarray:
    return np.asarray(out.frames[0])


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    return checks.build_case(request, tmp_path_factory, CASES, PROMPT, STEPS, frames)


def test_dbcache_that_never_reuses_is_the_exact_output(family) -> None:
    checks.assert_never_reusing_is_exact(family, PROMPT, checks.NEVER, frames, STEPS * 4)


def test_each_method_reuses_within_its_measured_psnr(family) -> None:
    name, _, _, _, exact = family
    for setting, db, got, score in checks.reusing_outputs(family, PROMPT, SETTINGS, STEPS, frames):
        assert not np.array_equal(got, exact), (name, setting)
        assert score >= db - 4.0, (name, setting, score)


#: What turns each family's CFG off for FasterCache, besides dropping a negative prompt and true CFG
#: (classic CFG: guidance 1); measured PSNRs against the exact output without CFG, seed 7.
NO_CFG: dict[str, dict[str, Any]] = {"hunyuan-video": {}}
FASTERCACHE_DB: dict[str, float] = {"hunyuan-video": 25.4, "cogvideox": 24.2, "mochi": 35.6}


def test_fastercache_without_cfg_reuses_within_its_measured_psnr(family) -> None:
    checks.assert_fastercache_without_cfg_case(family, PROMPT, NO_CFG, FASTERCACHE_DB)


#: FasterCache's PSNR against the exact output with each family's CFG as its case runs it, seed 7.
FASTERCACHE_CFG_DB: dict[str, float] = {"hunyuan-video": 20.3, "cogvideox": 12.4, "mochi": 18.8}


def test_fastercache_with_cfg_approximates_the_negative_branch(family) -> None:
    checks.assert_fastercache_with_cfg_case(family, PROMPT, FASTERCACHE_CFG_DB)


def test_a_mixed_batch_gives_each_request_its_own_output(family) -> None:
    name, generator, kwargs, _, _ = family
    caches = [None, checks.DBCACHE, SETTINGS["teacache"], SETTINGS["pab"], {"method": "fastercache"}]
    params = checks.without_seed(kwargs)
    prompts = [
        PROMPT,
        "a cat",
        "a blue car on a long empty road at night",
        "a cat",
        "a dog running on the beach",
    ]  # text masks of their own
    assert_mixed_caches_as_alone(name, generator, params, caches, prompts)


def test_hunyuan_video_token_replace_i2v_runs_dbcache(tmp_path) -> None:
    """HunyuanVideo-I2V's token_replace DiT modulates the first frame's tokens with their own temb, taken
    per row in the ranges too: DBCache that never reuses is its exact output, an aggressive one reuses
    (measured 19.8 dB, 4 of 10 steps)."""
    root = build_tiny_hunyuan_video_i2v(
        tmp_path,
        TinyHunyuanVideoI2VSpec(image_condition_type="token_replace", num_layers=2, num_single_layers=2),
    )
    generator = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    image = Image.fromarray(np.tile(np.linspace(0, 255, 48, dtype=np.uint8)[None, :, None], (32, 1, 3)))
    kwargs = {
        "height": 32, "width": 48, "num_frames": 5, "num_inference_steps": STEPS, "seed": 7,
        "true_cfg_scale": 2.0, "negative_prompt": "blurry", "input_images": [image],
    }  # fmt: skip
    exact = frames(generator.generate(PROMPT, **kwargs))
    np.testing.assert_array_equal(frames(generator.generate(PROMPT, cache=checks.NEVER, **kwargs)), exact)
    out = generator.generate(PROMPT, cache=checks.DBCACHE, **kwargs)
    assert out.cache["steps_reused"] > 0
    assert psnr(frames(out), exact) >= 19.8 - 4.0
