"""Cache methods by name on FLUX (issue 33), end to end through `DiffGenerator.generate(cache=...)`.

A tiny random FLUX with 2 double-stream and 4 single-stream blocks (6 blocks, so DBCache's Fn/Bn have room),
28 steps as cache-dit's benchmarks use, 48x64. Without a cache (absent, None or "none") the output is the
exact path's, bit for bit, and no cache code runs; DBCache that never reuses, running its blocks in three
ranges, gives the same pixels; each method reuses work (its counts are in the output) and stays within the
PSNR it measured here against the exact output (a tiny random model's PSNRs: stated as measured on CPU,
floors 5 dB below); requests with different methods share DiT batches and each gets its output alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError, UserError
from diffserve.models.cache_methods.batch import BatchStepCache
from diffserve.request import Req
from diffserve.testing.cache_parity import first_output_pixels as pixels
from diffserve.testing.image_metrics import psnr_uint8 as psnr

STEPS = 28
PROMPTS = ["a red fox in the snow", "a blue house on a hill"]
SIZE = {"height": 48, "width": 64}
BLOCKS = 6

#: (cache, mean PSNR floor in dB against the exact output). Measured on CPU (2 prompts, seed 4): dbcache
#: 52.0/58.8 (17/12 of 28 steps reused), dbcache+taylorseer(2) Fn2 Bn1 35.6/56.1 (19/10), dbcache static
#: "fast" mask 54.2/54.7 (17), teacache 55.6/55.4 (20), magcache with FLUX.1's ratios 55.8/55.6 (14),
#: taylorseer 55.3/55.8 (17), scm "medium" 56.4/56.7 (13), easycache (its defaults) 54.6/54.1 (17).
METHODS = {
    "dbcache": (
        {"method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "residual_diff_threshold": 0.3,
         "max_warmup_steps": 4},
        50.0,
    ),
    "dbcache+taylorseer": (
        {"method": "dbcache", "Fn_compute_blocks": 2, "Bn_compute_blocks": 1, "residual_diff_threshold": 0.3,
         "max_warmup_steps": 4, "enable_taylorseer": True, "taylorseer_order": 2},
        40.0,
    ),
    "dbcache+mask": (
        "dbcache:Fn_compute_blocks=1,max_warmup_steps=4,steps_computation_mask=fast,steps_computation_policy=static",
        49.0,
    ),
    "teacache": ({"method": "teacache", "rel_l1_thresh": 0.6}, 50.0),
    "magcache": ({"method": "magcache"}, 50.0),
    "taylorseer": ({"method": "taylorseer", "cache_interval": 3}, 50.0),
    "scm": ({"method": "scm", "steps_computation_mask": "medium"}, 51.0),
    "easycache": ({"method": "easycache"}, 49.0),
}  # fmt: skip


@pytest.fixture(scope="module")
def exact(cache_flux):
    return {p: pixels(cache_flux.generate(p, num_inference_steps=STEPS, seed=4, **SIZE)) for p in PROMPTS}


def test_no_cache_is_the_exact_path_and_runs_no_cache_code(cache_flux, exact, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the exact path must not build or run a step cache")

    monkeypatch.setattr(BatchStepCache, "run", refuse)
    for cache in (None, "none", {"method": "none"}):
        out = cache_flux.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, cache=cache, **SIZE)
        np.testing.assert_array_equal(pixels(out), exact[PROMPTS[0]])
        assert out.cache is None and out.steps_computed_in_full == STEPS


def test_dbcache_that_never_reuses_gives_the_exact_pixels_through_block_ranges(cache_flux, exact) -> None:
    cache = {
        "method": "dbcache",
        "Fn_compute_blocks": 2,
        "Bn_compute_blocks": 1,
        "residual_diff_threshold": 0,
    }
    out = cache_flux.generate(PROMPTS[1], num_inference_steps=STEPS, seed=4, cache=cache, **SIZE)
    np.testing.assert_array_equal(pixels(out), exact[PROMPTS[1]])
    assert out.cache["steps_reused"] == 0 and out.cache["blocks_computed"] == STEPS * BLOCKS


@pytest.mark.parametrize("name", list(METHODS))
def test_each_method_reuses_work_within_its_measured_psnr(cache_flux, exact, name) -> None:
    cache, floor = METHODS[name]
    scores = []
    for prompt in PROMPTS:
        out = cache_flux.generate(prompt, num_inference_steps=STEPS, seed=4, cache=cache, **SIZE)
        report = out.cache
        assert report["method"] == name.split("+")[0]
        assert report["steps_computed"] + report["steps_reused"] == STEPS and report["steps_reused"] > 0
        assert report["blocks_computed"] + report["blocks_reused"] == STEPS * BLOCKS
        assert out.steps_computed_in_full == report["steps_computed"]
        scores.append(psnr(pixels(out), exact[prompt]))
        print(f"{name} {prompt!r}: {scores[-1]:.1f} dB, reused {report['steps_reused']} of {STEPS} steps")
    assert np.mean(scores) >= floor, (name, scores)


def test_the_response_reports_the_settings_that_ran(cache_flux) -> None:
    out = cache_flux.generate(PROMPTS[0], num_inference_steps=4, seed=4, cache="teacache", **SIZE)
    settings = out.cache["settings"]
    assert settings["coefficients"][0] == pytest.approx(498.651651)  # FLUX.1's TeaCache polynomial, filled in
    assert out.params.cache.method == "teacache" and out.params.quality == "high"
    calibrated = cache_flux.generate(
        PROMPTS[0],
        num_inference_steps=6,
        seed=4,
        cache={"method": "magcache", "magcache_calibrate": True},
        **SIZE,
    )
    ratios = calibrated.cache["measured_mag_ratios"]
    assert len(ratios) == 6 and ratios[0] == 1.0 and calibrated.cache["steps_reused"] == 0


def test_requests_with_different_methods_share_a_batch_and_get_their_own_output(cache_flux) -> None:
    pipeline = cache_flux.pipeline
    caches = [
        None,
        METHODS["dbcache"][0],
        METHODS["teacache"][0],
        METHODS["dbcache+taylorseer"][0],
        "magcache",
        "easycache",
        "seacache",
    ]

    def request(i: int, cache) -> Req:
        params = SamplingParams(prompt=PROMPTS[i % 2], num_inference_steps=12, seed=i, cache=cache, **SIZE)
        return pipeline.run_pre_denoise(pipeline.validate(Req(params)))

    reqs = [request(i, cache) for i, cache in enumerate(caches)]
    assert len({pipeline.batch_key(r) for r in reqs}) == 1
    while not all(r.is_denoised for r in reqs):
        pipeline.denoise_step(reqs)  # one DiT batch for every request, every step
    together = [pipeline.run_post_denoise(r) for r in reqs]
    for i, (cache, batched) in enumerate(zip(caches, together, strict=True)):
        alone = cache_flux.generate(PROMPTS[i % 2], num_inference_steps=12, seed=i, cache=cache, **SIZE)
        got = np.asarray(batched.outputs.images[0].convert("RGB")).astype(int)
        assert np.abs(got - pixels(alone).astype(int)).max() <= 1, cache  # CPU GEMM rounding over other rows
        assert batched.cache_report == alone.cache, cache


def test_bad_or_unsupported_settings_are_refused_before_any_work(cache_flux, cache_flux_dir) -> None:
    with pytest.raises(
        InvalidRequestError, match=r"Fn_compute_blocks \(8\) \+ Bn_compute_blocks \(0\) exceed"
    ):
        cache_flux.generate(PROMPTS[0], num_inference_steps=2, cache="dbcache", **SIZE)
    with pytest.raises(InvalidRequestError, match="pass either cache or quality='low'"):
        cache_flux.generate(PROMPTS[0], num_inference_steps=2, cache="scm", quality="low", **SIZE)
    with pytest.raises(InvalidRequestError, match="set method to one of none, dbcache"):
        cache_flux.generate(PROMPTS[0], num_inference_steps=2, cache={"method": "fastcache"}, **SIZE)
    with pytest.raises(UserError, match="--cache-default: cache: dbcache's Fn_compute_blocks"):
        DiffGenerator.from_pretrained(
            cache_flux_dir, device="cpu", show_progress=False, cache_default="dbcache"
        )


def test_the_engine_default_applies_unless_the_request_chooses(cache_flux_dir) -> None:
    generator = DiffGenerator.from_pretrained(
        cache_flux_dir,
        device="cpu",
        show_progress=False,
        cache_default='{"method": "scm", "steps_computation_mask": "fast"}',
    )
    assert generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, **SIZE).cache["method"] == "scm"
    assert generator.generate(PROMPTS[0], num_inference_steps=2, seed=4, cache="none", **SIZE).cache is None
    assert generator.generate(PROMPTS[0], num_inference_steps=2, seed=4, quality="high", **SIZE).cache is None
    assert (
        generator.generate(PROMPTS[0], num_inference_steps=2, seed=4, cache="teacache", **SIZE).cache[
            "method"
        ]
        == "teacache"
    )
    with pytest.raises(UserError, match="--cache-default and --default-quality medium"):
        DiffGenerator.from_pretrained(
            cache_flux_dir, device="cpu", show_progress=False, cache_default="scm", default_quality="medium"
        )
