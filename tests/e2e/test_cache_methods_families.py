"""Cache methods by name on the other families (issue 33): FLUX.2, SD3, Qwen-Image, Z-Image, Wan, SANA,
HunyuanVideo 1.5 and LongCat-Image run DBCache through their blocks in ranges (Z-Image: its noise refiner always runs and Fn/Bn
count its main layers, as cache-dit counts them), and SeaCache, whose probe is each family's latents on
their grid (a latent image or video, 2x2-packed tokens unpacked), and PAB, which reuses attention
outputs (every block runs) at diffusers' defaults.

Tiny random checkpoints with 4 (DBCache-counted) blocks, 20 steps, 64x64 (Wan: 9 frames; HunyuanVideo 1.5:
48x48, 5), CFG as each family's tier test runs it. DBCache that never reuses is the exact output pixel for pixel (the range path computes what the
DiT's own loop computes). The reusing settings are aggressive ones (threshold 1: reuse after the warm-up,
at most one step in a row), since these random models' first-block residuals change by more than any
real threshold between steps; their PSNRs against the exact output, measured on CPU, are stated per case
and the floors sit 4 dB below. A tiny random model's PSNRs say nothing about a trained one's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import cache_method_checks as checks
import pytest

from diffserve import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.families.flux2.tiny import TinyFlux2Spec, build_tiny_flux2
from diffserve.families.hunyuan_video15.tiny import TinyHunyuanVideo15Spec, build_tiny_hunyuan_video15
from diffserve.families.longcat_image.tiny import TinyLongCatImageSpec, build_tiny_longcat_image
from diffserve.families.qwen_image.tiny import TinyQwenImageSpec, build_tiny_qwen_image
from diffserve.families.sana.tiny import TinySanaSpec, build_tiny_sana
from diffserve.families.sana_video.tiny import TinySanaVideoSpec, build_tiny_sana_video
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.families.z_image.tiny import TinyZImageSpec, build_tiny_zimage
from diffserve.testing.cache_parity import assert_mixed_caches_as_alone
from diffserve.testing.cache_parity import first_output_pixels as pixels

STEPS = 20
PROMPT = "a red fox in the snow"
SQUARE = {"height": 64, "width": 64}
SEACACHE = {"method": "seacache"}  # diffusers' defaults: its probe is the latents, in each family's layout
PAB = {"method": "pab"}  # diffusers' defaults (every 2nd step within timesteps (100, 800)): attention reuse

#: name -> (builder, generation kwargs, {setting name: measured PSNR in dB}); measured with seed 7.
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any], dict[str, float]]] = {
    "z-image": (
        lambda root: build_tiny_zimage(root, TinyZImageSpec(n_layers=4)),
        SQUARE,
        {"dbcache": 34.3, "dbcache+taylorseer": 35.9, "teacache": 20.8, "seacache": 31.6, "pab": 36.0},
    ),
    "flux2": (
        lambda root: build_tiny_flux2(root, TinyFlux2Spec(num_layers=2, num_single_layers=2)),
        SQUARE,
        {"dbcache": 19.9, "dbcache+taylorseer": 22.9, "teacache": 22.0, "seacache": 25.5, "pab": 20.5},
    ),
    "sd3": (
        lambda root: build_tiny_sd3(root, TinySD3Spec(num_layers=4)),
        SQUARE,
        {"dbcache": 54.8, "dbcache+taylorseer": 53.1, "teacache": 43.4, "seacache": 53.1, "pab": 60.4},
    ),
    "qwen-image": (
        lambda root: build_tiny_qwen_image(root, TinyQwenImageSpec(num_layers=4)),
        {**SQUARE, "true_cfg_scale": 4.0, "negative_prompt": "ugly"},
        {"dbcache": 34.1, "dbcache+taylorseer": 37.0, "teacache": 35.0, "seacache": 35.3, "pab": 38.2},
    ),
    "wan": (
        lambda root: build_tiny_wan(root, TinyWanSpec(num_layers=4)),
        {**SQUARE, "num_frames": 9},
        {"dbcache": 29.6, "dbcache+taylorseer": 27.2, "teacache": 24.1, "seacache": 25.3, "pab": 30.8},
    ),
    "sana": (
        lambda root: build_tiny_sana(root, TinySanaSpec(num_layers=4)),
        SQUARE,
        {"dbcache": 57.5, "dbcache+taylorseer": 59.6, "teacache": 45.3, "seacache": 54.0, "pab": 61.9},
    ),
    "sana-video": (
        lambda root: build_tiny_sana_video(root, TinySanaVideoSpec(num_layers=4)),
        {**SQUARE, "num_frames": 5, "extra": {"use_resolution_binning": False}},
        {"dbcache": 19.6, "dbcache+taylorseer": 17.7, "teacache": 19.0, "seacache": 28.7, "pab": 19.3},
    ),
    "hunyuan-video-1.5": (
        lambda root: build_tiny_hunyuan_video15(root, TinyHunyuanVideo15Spec(num_layers=4)),
        {"height": 48, "width": 48, "num_frames": 5},
        {"dbcache": 26.9, "dbcache+taylorseer": 28.3, "teacache": 29.2, "seacache": 34.8, "pab": 32.3},
    ),
    "longcat-image": (
        lambda root: build_tiny_longcat_image(root, TinyLongCatImageSpec(num_layers=2, num_single_layers=2)),
        {**SQUARE, "guidance_scale": 4.5},
        {"dbcache": 44.0, "dbcache+taylorseer": 42.6, "teacache": 32.3, "seacache": 36.5, "pab": 48.8},
    ),
}
#: Each family's request without classifier-free guidance, for FasterCache (besides dropping a negative
#: prompt): classic CFG is off at guidance 1, Z-Image's at 0, Qwen-Image's true CFG at 1; FLUX.2 dev embeds its guidance.
NO_CFG: dict[str, dict[str, Any]] = {
    "z-image": {"guidance_scale": 0.0},
    "flux2": {},
    "qwen-image": {"true_cfg_scale": 1.0},
}
#: FasterCache's PSNR against the exact output without CFG, measured with seed 7.
FASTERCACHE_DB = {
    "z-image": 45.1, "flux2": 20.2, "sd3": 63.9, "qwen-image": 43.7, "wan": 27.8, "sana": 58.7,
    "sana-video": 22.5, "hunyuan-video-1.5": 32.3, "longcat-image": 49.6,
}  # fmt: skip
#: FasterCache's PSNR against the exact output with each family's CFG as its case runs it, measured with
#: seed 7 (FLUX.2 dev's request runs none: it embeds its guidance).
FASTERCACHE_CFG_DB = {
    "z-image": 28.0, "sd3": 47.8, "qwen-image": 33.2, "wan": 25.8, "sana": 39.6, "sana-video": 15.9,
    "hunyuan-video-1.5": 32.8, "longcat-image": 41.6,
}  # fmt: skip
FASTERCACHE = {"method": "fastercache"}  # diffusers' defaults: with CFG, the negative branch approximated
SETTINGS = {
    "dbcache": checks.DBCACHE,
    "dbcache+taylorseer": checks.DBCACHE_TAYLORSEER,
    "teacache": checks.TEACACHE,
    "seacache": SEACACHE,
    "pab": PAB,
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    return checks.build_case(request, tmp_path_factory, CASES, PROMPT, STEPS, pixels)


def test_dbcache_that_never_reuses_is_the_exact_output(family) -> None:
    blocks = 5 if family[0] == "z-image" else 4  # Z-Image: its noise refiner block too, which always runs
    checks.assert_never_reusing_is_exact(family, PROMPT, checks.NEVER, pixels, STEPS * blocks)


def test_each_method_reuses_within_its_measured_psnr(family) -> None:
    for setting, db, _, score in checks.reusing_outputs(family, PROMPT, SETTINGS, STEPS, pixels):
        assert score >= db - 4.0, (family[0], setting, score)


def test_fastercache_without_cfg_reuses_within_its_measured_psnr(family) -> None:
    checks.assert_fastercache_without_cfg_case(family, PROMPT, NO_CFG, FASTERCACHE_DB)


def test_fastercache_with_cfg_approximates_the_negative_branch(family) -> None:
    checks.assert_fastercache_with_cfg_case(family, PROMPT, FASTERCACHE_CFG_DB)


def test_a_mixed_batch_gives_each_request_its_own_output(family) -> None:
    name, generator, kwargs, _, _ = family
    caches = [None, checks.DBCACHE, checks.TEACACHE, PAB, FASTERCACHE]
    params = checks.without_seed(kwargs)
    assert_mixed_caches_as_alone(name, generator, params, caches, [PROMPT] * len(caches))


def test_z_image_dbcache_counts_the_main_layers_and_always_runs_the_refiner(tmp_path) -> None:
    """Fn/Bn index Z-Image's main layers (its noise refiner always runs, counted as computed), and a
    request whose Fn and Bn leave no middle layer reuses nothing; more than its main layers is a 400."""
    generator = DiffGenerator.from_pretrained(
        build_tiny_zimage(tmp_path, TinyZImageSpec(n_layers=4)), device="cpu", show_progress=False
    )
    kwargs = {**SQUARE, "num_inference_steps": STEPS, "seed": 7}
    out = generator.generate(
        PROMPT, cache={**checks.DBCACHE, "Fn_compute_blocks": 2, "Bn_compute_blocks": 1}, **kwargs
    )
    reused = out.cache["steps_reused"]
    assert reused > 0 and out.cache["blocks_reused"] == reused  # one middle layer: main layer 2 of 4
    assert out.cache["blocks_computed"] == STEPS * 5 - reused
    full = generator.generate(
        PROMPT, cache={**checks.DBCACHE, "Fn_compute_blocks": 2, "Bn_compute_blocks": 2}, **kwargs
    )
    assert full.cache["blocks_reused"] == 0
    with pytest.raises(InvalidRequestError, match=r"exceed ZImagePipeline's 4 DiT blocks"):
        generator.generate(
            PROMPT, cache={**checks.DBCACHE, "Fn_compute_blocks": 4, "Bn_compute_blocks": 1}, **kwargs
        )
