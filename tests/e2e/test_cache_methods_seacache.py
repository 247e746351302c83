"""SeaCache by name (issue 33): diffserve's `cache={"method": "seacache", ...}` on a tiny FLUX, against the
exact output and against diffusers' own SeaCache hook (`diffusers.hooks.SeaCacheConfig`).

diffusers ships SeaCache's indicator for Cosmos 3 and Wan only; FluxPipeline gets the latents' grid and
the step, sigma and step count from `testing/sea_cache_reference.flux_sea_cache` (FLUX's packed latents
unpacked as diffserve's pipelines hand any family's latents to SeaCache). With the same indicator both sides take the
same decisions step for step, and their outputs are as close as the two exact outputs (the pipeline
parity bar: 40 dB); FluxPipeline's true CFG runs the negative branch as a second call in its own cache
context, which SeaCache decides alike (same latents, same sigma) and whose residual it keeps apart, as
diffserve keeps each row's.

Tiny random FLUX (2 double + 4 single blocks), 28 steps, 48x64, seed 4; PSNRs measured on CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.hooks import SeaCacheConfig

from diffserve import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.sea_cache_reference import flux_sea_cache

STEPS = 28
PROMPT = "a red fox in the snow"
SIZE = {"height": 48, "width": 64}
BLOCKS = 6
PARITY_DB = 40.0
#: (cache, PSNR floor in dB against the exact output): measured 56.2 dB (15 of 28 steps reused) at the
#: defaults, 56.0 (15) with residual order 0; floors 5 dB below.
SETTINGS = {
    "defaults": ({"method": "seacache"}, 51.0),
    "order 0": ({"method": "seacache", "residual_order": 0}, 51.0),
}


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def diffserve_run(cache_flux, cache: dict, **kwargs) -> tuple[np.ndarray, list[bool], dict]:
    """diffserve's image, its computed steps (True: the blocks ran) and its cache report."""
    pipeline = cache_flux.pipeline
    params = SamplingParams(prompt=PROMPT, num_inference_steps=STEPS, seed=4, cache=cache, **SIZE, **kwargs)
    req = pipeline.run_pre_denoise(pipeline.validate(Req(params)))
    while not req.is_denoised:
        pipeline.denoise_step([req])
    history = list(req.step_cache.history)
    report = req.cache_report
    return pixels(pipeline.run_post_denoise(req).outputs.images[0]), history, report


@pytest.fixture(scope="module")
def exact(cache_flux):
    return pixels(cache_flux.generate(PROMPT, num_inference_steps=STEPS, seed=4, **SIZE).images[0])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_seacache_reuses_work_within_its_measured_psnr(cache_flux, exact, name) -> None:
    cache, floor = SETTINGS[name]
    out = cache_flux.generate(PROMPT, num_inference_steps=STEPS, seed=4, cache=cache, **SIZE)
    report = out.cache
    assert report["method"] == "seacache" and report["settings"]["threshold"] == 0.25
    assert report["steps_computed"] + report["steps_reused"] == STEPS and report["steps_reused"] > 0
    assert report["blocks_computed"] + report["blocks_reused"] == STEPS * BLOCKS
    assert out.steps_computed_in_full == report["steps_computed"]
    score = psnr(pixels(out.images[0]), exact)
    print(f"seacache {name}: {score:.1f} dB, reused {report['steps_reused']} of {STEPS} steps")
    assert score >= floor, (name, score)


def test_seacache_keeps_its_limits(cache_flux) -> None:
    _, history, _ = diffserve_run(
        cache_flux, {"method": "seacache", "threshold": 100.0, "max_consecutive_cached": 2}
    )
    assert history[0] and history[-1], "the retention step and the last step compute"
    runs = "".join("c" if c else "r" for c in history).split("c")
    assert max(len(r) for r in runs) == 2, history  # never more than 2 reused in a row
    _, never, _ = diffserve_run(cache_flux, {"method": "seacache", "threshold": 0.0})
    assert all(never)
    with pytest.raises(InvalidRequestError, match="seacache.power_exp must be > 0"):
        cache_flux.generate(
            PROMPT, num_inference_steps=2, cache={"method": "seacache", "power_exp": 0}, **SIZE
        )


@pytest.mark.parametrize(
    ("label", "cache", "extra"),
    [
        ("defaults", {"method": "seacache"}, {}),
        ("order 0, threshold 0.5, 3 in a row", {"method": "seacache", "residual_order": 0, "threshold": 0.5,
                                               "max_consecutive_cached": 3}, {}),
        ("true CFG", {"method": "seacache"}, {"true_cfg_scale": 3.0, "negative_prompt": "blurry"}),
    ],
)  # fmt: skip
def test_seacache_decides_and_outputs_as_diffusers_hook(
    cache_flux, cache_flux_reference, label, cache, extra
) -> None:
    ours, history, _ = diffserve_run(cache_flux, cache, **extra)
    settings = {k: v for k, v in cache.items() if k != "method"}
    with flux_sea_cache(cache_flux_reference, SeaCacheConfig(**settings)) as ran:
        image = cache_flux_reference(
            PROMPT,
            num_inference_steps=STEPS,
            generator=torch.Generator("cpu").manual_seed(4),
            **SIZE,
            **extra,
        ).images[0]
    calls = 2 if extra else 1
    assert [step for step, _ in ran] == [s for s in range(STEPS) for _ in range(calls)]
    theirs_computed = [ran[calls * s][1] for s in range(STEPS)]
    if extra:  # the negative branch's context decides as the positive one's
        assert theirs_computed == [ran[calls * s + 1][1] for s in range(STEPS)]
    assert history == theirs_computed, (label, history, theirs_computed)
    assert 0 < sum(history) < STEPS, history
    score = psnr(ours, pixels(image))
    print(
        f"seacache {label}: {STEPS - sum(history)} of {STEPS} reused, {score:.1f} dB against diffusers' hook"
    )
    assert score >= PARITY_DB, (label, score)
