"""`--batch-policy auto`'s warm-up measurement (runtime/step_curve_probe.py) on SkyReels-V2 diffusion forcing:
the probe's copies of its first request must step states of their own. A diffusion-forcing request keeps
its frame groups' UniPC states in its conditioning; copies sharing it made the first copy's first step
restart the first probe's states, and its next step failed ("UniPC steps must be consecutive"), so the
server logged "the warm-up measurement failed". In process, as the engine process calls it: the tiny
text-to-video and video-extension folders are measured at batches of 1 and 2 (two samples each); an
image-to-video request of one frame (the input image's: what its probe was before the family declared
`probe_frames`, tests/server/test_probe_frames.py) has no step to measure, which is logged."""

from __future__ import annotations

import logging

import pytest

from diffserve import DiffGenerator
from diffserve.families.wan.skyreels_v2_forcing_state import SkyReelsV2ForcingConditioning
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.request import Req
from diffserve.runtime.batch_policy import token_bucket
from diffserve.runtime.calibration import probe_params
from diffserve.runtime.step_curve_probe import STEPS_PER_BATCH, measure_step_curve, probe_copy

SPECS = {
    "t2v": TinySkyReelsV2Spec(diffusion_forcing=True),
    "v2v": TinySkyReelsV2Spec(diffusion_forcing=True, video_to_video=True),
    "i2v": TinySkyReelsV2Spec(diffusion_forcing=True, image_to_video=True),
}


def load(tmp_path_factory: pytest.TempPathFactory, kind: str) -> DiffGenerator:
    """The tiny folder's generator with room for two running requests (the server's `auto` policy)."""
    folder = build_tiny_skyreels_v2(tmp_path_factory.mktemp(f"skyreels-df-{kind}"), SPECS[kind])
    gen = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False, max_running_requests=2)
    assert gen.engine.scheduler.policy.name == "auto"
    return gen


@pytest.mark.parametrize("kind", ["t2v", "v2v"])
def test_the_warm_up_measures_batches_of_one_and_two(tmp_path_factory, kind: str) -> None:
    gen = load(tmp_path_factory, kind)
    params = probe_params(gen.pipeline.facts, "batch curve")
    measured = measure_step_curve(gen.engine, params, 2)
    assert measured == [1, 2]
    curve = gen.engine.scheduler.policy.curve.snapshot()
    print(kind, curve)
    (points,) = curve.values()  # the probe size's bucket: rows of one request (its CFG branches) and two
    rows = sorted(points, key=int)
    assert len(rows) == 2 and int(rows[1]) == 2 * int(rows[0])
    assert all(point["samples"] == STEPS_PER_BATCH and point["seconds"] > 0 for point in points.values())


def test_a_probe_copy_steps_its_own_frame_states(tmp_path_factory) -> None:
    gen = load(tmp_path_factory, "t2v")
    runner = gen.engine.runner
    params = probe_params(gen.pipeline.facts, "copy")
    params.num_inference_steps = 3
    first = runner.pre_denoise(runner.validate(Req(params=params)))
    copy = probe_copy(first)
    try:
        mine, theirs = SkyReelsV2ForcingConditioning.of(first), SkyReelsV2ForcingConditioning.of(copy)
        assert copy.request_id != first.request_id
        assert theirs is not mine and theirs.progress is not mine.progress
        assert theirs.plan is mine.plan  # inputs are shared
        assert copy.latents is not first.latents and bool((copy.latents == first.latents).all())
        bucket = token_bucket(gen.engine.cost(first).tokens)
        samples = gen.engine.scheduler.policy.curve.samples(bucket, 2)
        runner.denoise_step([first], samples)
        runner.denoise_step([first, copy], samples)  # the copy's first step, the first's second
        runner.denoise_step([first, copy], samples)
        assert (first.step_index, copy.step_index) == (3, 2)
    finally:
        runner.release(first)
        runner.release(copy)


def test_a_probe_without_steps_is_logged_not_measured(tmp_path_factory, caplog) -> None:
    gen = load(tmp_path_factory, "i2v")
    params = probe_params(gen.pipeline.facts, "batch curve")
    params.num_frames = 1  # the input image alone: nothing to denoise
    with caplog.at_level(logging.INFO, logger="diffserve.runtime"):
        assert measure_step_curve(gen.engine, params, 2) == []
    assert "has 0 denoising steps" in caplog.text and "measuring while serving" in caplog.text
