"""Cache methods by name (issue 33) on HiDream-I1, HunyuanImage 2.1 and Qwen-Image 2.1: DBCache runs their
blocks in ranges (HiDream and HunyuanImage: the double-stream blocks, then the single-stream ones, as
cache-dit counts them; Qwen-Image 2.1: its single-stream blocks over the prefix and the image), the
whole-span methods (TaylorSeer, TeaCache) reuse the residual of every block, and PAB reuses attention
outputs (every block runs).

Tiny random checkpoints with 4 blocks, 10 steps, each family's default guidance (Qwen-Image 2.1 with a
negative prompt and true CFG). DBCache that never reuses is the exact output pixel for pixel (the range
path computes what the DiT's own loop computes). The reusing settings are aggressive ones (threshold 1:
reuse after a 3-step warm-up, at most one step in a row), since these random models' first-block
residuals change by more than any real threshold between steps; their PSNRs against the exact output,
measured on CPU with seed 7, are stated per case and the floors sit 4 dB below. A tiny random model's
PSNRs say nothing about a trained one's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import cache_method_checks as checks
import numpy as np
import pytest

from diffserve import DiffGenerator
from diffserve.families.hidream.tiny import TinyHiDreamSpec, build_tiny_hidream
from diffserve.families.hunyuan_image.tiny import TinyHunyuanImageSpec, build_tiny_hunyuan_image
from diffserve.families.qwen_image21.tiny import TinyQwenImage21Spec, build_tiny_qwen_image21
from diffserve.testing.cache_parity import assert_mixed_caches_as_alone
from diffserve.testing.cache_parity import first_output_pixels as pixels

STEPS = 10
BLOCKS = 4
PROMPT = "a red fox in the snow"
TAYLORSEER = {"method": "taylorseer"}  # cache-dit's defaults: reuse after step 3, every 5th step computed
PAB = {"method": "pab"}  # diffusers' defaults (every 2nd step within timesteps (100, 800)): attention reuse
SETTINGS = {
    "dbcache": checks.DBCACHE,
    "dbcache+taylorseer": checks.DBCACHE_TAYLORSEER,
    "taylorseer": TAYLORSEER,
    "teacache": checks.TEACACHE,
    "pab": PAB,
}

#: name -> (builder, generation kwargs, {setting name: measured PSNR in dB}).
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any], dict[str, float]]] = {
    "hidream": (
        lambda root: build_tiny_hidream(root, TinyHiDreamSpec(num_layers=2, num_single_layers=2)),
        {"height": 32, "width": 32},  # HiDream's area rule makes it 128x128
        {"dbcache": 41.2, "dbcache+taylorseer": 39.0, "taylorseer": 23.8, "teacache": 30.1, "pab": 44.0},
    ),
    "hunyuan-image": (
        lambda root: build_tiny_hunyuan_image(root, TinyHunyuanImageSpec(num_layers=2, num_single_layers=2)),
        {"height": 64, "width": 64},
        {"dbcache": 20.9, "dbcache+taylorseer": 20.9, "taylorseer": 21.4, "teacache": 21.0, "pab": 15.2},
    ),
    "qwen-image-2.1": (
        lambda root: build_tiny_qwen_image21(root, TinyQwenImage21Spec(num_layers=4)),
        {"height": 32, "width": 32, "true_cfg_scale": 4.0, "negative_prompt": "ugly"},
        {"dbcache": 15.6, "dbcache+taylorseer": 18.3, "taylorseer": 13.7, "teacache": 15.1, "pab": 16.5},
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    return checks.build_case(request, tmp_path_factory, CASES, PROMPT, STEPS, pixels)


def test_dbcache_that_never_reuses_is_the_exact_output(family) -> None:
    checks.assert_never_reusing_is_exact(family, PROMPT, checks.NEVER, pixels, STEPS * BLOCKS)


def test_each_method_reuses_within_its_measured_psnr(family) -> None:
    for setting, db, _, score in checks.reusing_outputs(family, PROMPT, SETTINGS, STEPS, pixels):
        assert db - 4.0 <= score < float("inf"), (family[0], setting, score)


#: What turns each family's CFG off for FasterCache, besides dropping a negative prompt and true CFG
#: (classic CFG: guidance 1); measured PSNRs against the exact output without CFG, seed 7.
NO_CFG: dict[str, dict[str, Any]] = {"qwen-image-2.1": {"true_cfg_scale": 1.0}}
FASTERCACHE_DB: dict[str, float] = {"hidream": 53.7, "hunyuan-image": 25.8, "qwen-image-2.1": 23.9}


def test_fastercache_without_cfg_reuses_within_its_measured_psnr(family) -> None:
    checks.assert_fastercache_without_cfg_case(family, PROMPT, NO_CFG, FASTERCACHE_DB)


#: FasterCache's PSNR against the exact output with each family's CFG as its case runs it, seed 7.
FASTERCACHE_CFG_DB: dict[str, float] = {"hidream": 26.6, "hunyuan-image": 17.6, "qwen-image-2.1": 15.7}


def test_fastercache_with_cfg_approximates_the_negative_branch(family) -> None:
    checks.assert_fastercache_with_cfg_case(family, PROMPT, FASTERCACHE_CFG_DB)


def test_a_mixed_batch_gives_each_request_its_own_output(family) -> None:
    name, generator, kwargs, _, _ = family
    caches = [checks.DBCACHE, checks.TEACACHE, PAB, {"method": "fastercache"}]
    params = checks.without_seed(kwargs)
    assert_mixed_caches_as_alone(name, generator, params, caches, [PROMPT] * len(caches))


def test_hidream_dbcache_on_a_padded_grid(tmp_path) -> None:
    """A non-square HiDream grid is padded to `max_seq` tokens whose keys are masked: the block ranges
    carry that mask (each row's), so DBCache that never reuses is still the exact output."""
    generator = DiffGenerator.from_pretrained(
        CASES["hidream"][0](tmp_path), device="cpu", show_progress=False
    )
    kwargs = {"height": 32, "width": 56, "num_inference_steps": STEPS, "seed": 7}  # 96x168 (area rule)
    exact = pixels(generator.generate(PROMPT, **kwargs))
    assert exact.shape == (96, 168, 3)
    np.testing.assert_array_equal(pixels(generator.generate(PROMPT, cache=checks.NEVER, **kwargs)), exact)
    assert generator.generate(PROMPT, cache=checks.DBCACHE, **kwargs).cache["steps_reused"] > 0
