"""FLUX quality tiers end to end: `high` (also asked for as `hd` or `lossless`, and reported as `high`) is
the exact path, each approximate tier (medium, low, draft) stays within its PSNR bar against it and reports
how many steps it computed and the preset (cache method and settings) it ran, tiers mix in one DiT batch,
and the engine default and the model folder's calibration file (presets, or a format-2 file's thresholds)
take effect."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.quality import PSNR_BARS, preset_to_dict, write_calibration
from diffserve.errors import UserError
from diffserve.families.flux.tiny import build_tiny_flux
from diffserve.models.step_cache import StepCachePolicy
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8 as psnr

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
def exact(generator):
    return {p: generator.generate(p, num_inference_steps=STEPS, seed=4, **SIZE) for p in PROMPTS}


def test_high_hd_lossless_and_auto_are_the_exact_path_and_report_high(generator, exact) -> None:
    prompt = PROMPTS[0]
    for quality in ("high", "hd", "lossless", "auto", None):
        out = generator.generate(prompt, num_inference_steps=STEPS, seed=4, quality=quality, **SIZE)
        np.testing.assert_array_equal(pixels(out), pixels(exact[prompt]))
        assert out.steps_computed_in_full == STEPS and out.params.quality == "high"


def test_each_tier_keeps_its_psnr_bar_and_computes_fewer_steps(generator, exact) -> None:
    computed = {}
    for tier, bar in PSNR_BARS.items():
        scores, steps = [], []
        for prompt in PROMPTS:
            out = generator.generate(prompt, num_inference_steps=STEPS, seed=4, quality=tier, **SIZE)
            assert out.params.quality == tier
            scores.append(psnr(pixels(out), pixels(exact[prompt])))
            steps.append(out.steps_computed_in_full)
        print(f"{tier}: PSNR {[round(s, 1) for s in scores]} dB, steps computed {steps} of {STEPS}")
        assert np.mean(scores) >= bar, (tier, scores)
        computed[tier] = sum(steps)
    assert computed["draft"] <= computed["low"] <= computed["medium"] < STEPS * len(PROMPTS)
    assert computed["low"] <= 0.5 * STEPS * len(PROMPTS)


def test_an_exact_request_batched_with_a_low_one_keeps_its_exact_output(generator, exact) -> None:
    pipeline = generator.pipeline
    high = Req(SamplingParams(prompt=PROMPTS[0], num_inference_steps=STEPS, seed=4, **SIZE))
    low = Req(SamplingParams(prompt=PROMPTS[1], num_inference_steps=STEPS, seed=4, quality="low", **SIZE))
    reqs = [pipeline.run_pre_denoise(pipeline.validate(r)) for r in (high, low)]
    while not all(r.is_denoised for r in reqs):
        pipeline.denoise_step(reqs)
    high, low = (pipeline.run_post_denoise(r) for r in reqs)
    got = np.asarray(high.outputs.images[0].convert("RGB"))
    assert np.abs(got.astype(int) - pixels(exact[PROMPTS[0]]).astype(int)).max() <= 1  # CPU GEMM batch rows
    assert high.step_cache is None and high.steps_computed_in_full == STEPS
    assert low.steps_computed_in_full < STEPS


def test_default_quality_applies_to_auto_and_unset(flux_dir) -> None:
    generator = DiffGenerator.from_pretrained(
        flux_dir, device="cpu", show_progress=False, default_quality="draft"
    )
    out = generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, **SIZE)
    assert out.params.quality == "draft" and out.steps_computed_in_full < STEPS
    exact = generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, quality="lossless", **SIZE)
    assert exact.steps_computed_in_full == STEPS and exact.params.quality == "high"
    with pytest.raises(
        UserError, match="default_quality must be one of high, medium, low, draft, hd, lossless"
    ):
        DiffGenerator.from_pretrained(flux_dir, device="cpu", show_progress=False, default_quality="ultra")


def test_the_old_name_of_the_exact_tier_as_default_reports_high(flux_dir) -> None:
    generator = DiffGenerator.from_pretrained(
        flux_dir, device="cpu", show_progress=False, default_quality="lossless"
    )
    out = generator.generate(PROMPTS[0], num_inference_steps=2, seed=4, **SIZE)
    assert out.params.quality == "high" and generator.pipeline.quality_rule.default_tier == "high"


def test_the_folders_calibration_overrides_the_family_thresholds(flux_dir, tmp_path) -> None:
    import shutil

    folder = shutil.copytree(flux_dir, tmp_path / "calibrated")
    write_calibration(folder, "flux", {"low": StepCachePolicy(threshold=0.0)}, {})
    generator = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False)
    out = generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, quality="low", **SIZE)
    assert out.steps_computed_in_full == STEPS  # threshold 0: never reuses
    assert (
        generator.generate(
            PROMPTS[0], num_inference_steps=STEPS, seed=4, quality="draft", **SIZE
        ).steps_computed_in_full
        < STEPS
    )  # other tiers keep the family's values


def test_a_tier_request_reports_the_preset_it_ran(generator) -> None:
    """The response's cache report names the tier, the method and the settings (defaults filled in)."""
    pipeline = generator.pipeline
    for tier in PSNR_BARS:
        out = generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, quality=tier, **SIZE)
        preset = pipeline.quality_rule.policies[tier]
        assert out.cache["quality"] == tier and out.cache["method"] == preset.method
        assert out.cache["settings"] == preset_to_dict(preset)
        assert out.cache["steps_computed"] == out.steps_computed_in_full
        assert out.cache["blocks_computed"] + out.cache["blocks_reused"] == STEPS * 3  # tiny FLUX: 3 blocks


def test_a_calibrated_preset_runs_its_method_and_an_old_threshold_still_runs(flux_dir, tmp_path) -> None:
    import json
    import shutil

    from diffserve.configs.cache_settings import DBCacheSettings
    from diffserve.configs.quality import CALIBRATION_FILE

    folder = shutil.copytree(flux_dir, tmp_path / "presets")
    dbcache = DBCacheSettings(Fn_compute_blocks=1, residual_diff_threshold=1.0, max_warmup_steps=2)
    write_calibration(folder, "flux", {"medium": dbcache}, {})
    generator = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False)
    out = generator.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, quality="medium", **SIZE)
    assert out.cache["method"] == "dbcache" and out.cache["quality"] == "medium"
    assert out.cache["steps_reused"] > 0 and out.cache["blocks_computed"] > out.cache["steps_computed"] * 3
    # A format-2 file (a threshold per tier, what calibrate-cache wrote before presets) still runs.
    (folder / CALIBRATION_FILE).write_text(
        json.dumps({"format": 2, "family": "flux", "tiers": {"low": {"threshold": 0.0}}, "measurements": {}})
    )
    old = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False)
    out = old.generate(PROMPTS[0], num_inference_steps=STEPS, seed=4, quality="low", **SIZE)
    assert out.cache["method"] == "stepcache" and out.steps_computed_in_full == STEPS  # threshold 0
    # A preset the DiT cannot run fails at load, naming the tier.
    (folder / CALIBRATION_FILE).write_text(
        json.dumps(
            {"format": 3, "family": "flux", "tiers": {"low": {"method": "dbcache", "Fn_compute_blocks": 4}}}
        )
    )
    with pytest.raises(UserError, match=r"quality 'low' runs dbcache\(Fn_compute_blocks=4\).*exceed"):
        DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False)
