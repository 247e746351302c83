"""FLUX quality tiers end to end: lossless is the exact path, each approximate tier stays within its
PSNR bar against lossless and reports how many steps it computed, tiers mix in one DiT batch, and the
engine default and the model folder's calibration file take effect."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.quality import PSNR_BARS, write_calibration
from diffserve.errors import UserError
from diffserve.models.step_cache import StepCachePolicy
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.tiny_flux import build_tiny_flux

STEPS = 20
PROMPTS = ["a red fox in the snow", "a blue house on a hill"]
SIZE = {"height": 48, "width": 64}


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return build_tiny_flux(tmp_path_factory.mktemp("flux-tiers"))


@pytest.fixture(scope="module")
def generator(flux_dir):
    return DiffGenerator.from_pretrained(flux_dir, device="cpu", show_progress=False)


def pixels(out) -> np.ndarray:
    return np.asarray(out.images[0].convert("RGB"))


@pytest.fixture(scope="module")
def lossless(generator):
    return {p: generator.generate(p, num_inference_steps=STEPS, seed=4, **SIZE) for p in PROMPTS}


def test_lossless_and_hd_are_the_exact_path(generator, lossless) -> None:
    prompt = PROMPTS[0]
    for quality in ("lossless", "hd", "auto"):
        out = generator.generate(prompt, num_inference_steps=STEPS, seed=4, quality=quality, **SIZE)
        np.testing.assert_array_equal(pixels(out), pixels(lossless[prompt]))
        assert out.steps_computed_in_full == STEPS and out.params.quality == "lossless"


def test_each_tier_keeps_its_psnr_bar_and_computes_fewer_steps(generator, lossless) -> None:
    computed = {}
    for tier, bar in PSNR_BARS.items():
        scores, steps = [], []
        for prompt in PROMPTS:
            out = generator.generate(prompt, num_inference_steps=STEPS, seed=4, quality=tier, **SIZE)
            assert out.params.quality == tier
            scores.append(psnr(pixels(out), pixels(lossless[prompt])))
            steps.append(out.steps_computed_in_full)
        print(f"{tier}: PSNR {[round(s, 1) for s in scores]} dB, steps computed {steps} of {STEPS}")
        assert np.mean(scores) >= bar, (tier, scores)
        computed[tier] = sum(steps)
    assert computed["low"] <= computed["medium"] <= computed["high"] < STEPS * len(PROMPTS)
    assert computed["medium"] <= 0.5 * STEPS * len(PROMPTS)


def test_a_lossless_request_batched_with_a_medium_one_keeps_its_exact_output(generator, lossless) -> None:
    pipeline = generator.pipeline
    exact = Req(SamplingParams(prompt=PROMPTS[0], num_inference_steps=STEPS, seed=4, **SIZE))
    medium = Req(
        SamplingParams(prompt=PROMPTS[1], num_inference_steps=STEPS, seed=4, quality="medium", **SIZE)
    )
    reqs = [pipeline.run_pre_denoise(pipeline.validate(r)) for r in (exact, medium)]
    while not all(r.is_denoised for r in reqs):
        pipeline.denoise_step(reqs)
    exact, medium = (pipeline.run_post_denoise(r) for r in reqs)
    got = np.asarray(exact.images[0].convert("RGB"))
    assert (
        np.abs(got.astype(int) - pixels(lossless[PROMPTS[0]]).astype(int)).max() <= 1
    )  # CPU GEMM batch rows
    assert exact.step_cache is None and exact.steps_computed_in_full == STEPS
    assert medium.steps_computed_in_full < STEPS


def test_default_quality_applies_to_auto_and_unset(flux_dir) -> None:
    generator = DiffGenerator.from_pretrained(
        flux_dir, device="cpu", show_progress=False, default_quality="low"
    )
    out = generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, **SIZE)
    assert out.params.quality == "low" and out.steps_computed_in_full < STEPS
    exact = generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, quality="lossless", **SIZE)
    assert exact.steps_computed_in_full == STEPS
    with pytest.raises(UserError, match="default quality must be one of lossless, high, medium, low"):
        DiffGenerator.from_pretrained(flux_dir, device="cpu", show_progress=False, default_quality="ultra")


def test_the_folders_calibration_overrides_the_family_thresholds(flux_dir, tmp_path) -> None:
    import shutil

    folder = shutil.copytree(flux_dir, tmp_path / "calibrated")
    write_calibration(folder, "flux", {"medium": StepCachePolicy(threshold=0.0)}, {})
    generator = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False)
    out = generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, quality="medium", **SIZE)
    assert out.steps_computed_in_full == STEPS  # threshold 0: never reuses
    assert (
        generator.generate(
            PROMPTS[0], num_inference_steps=STEPS, seed=4, quality="low", **SIZE
        ).steps_computed_in_full
        < STEPS
    )  # other tiers keep the family's values
