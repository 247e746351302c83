"""Approximate quality tiers (step cache, `models/step_cache.py`) for Z-Image and Wan 2.1 (T2V and I2V).

On the tiny random-weight checkpoints, at the size the pipelines' thresholds were measured at (20 steps,
64x64, CFG on): "high" is the exact path bit for bit, every tier keeps its PSNR bar against it while
low and draft skip steps, and an exact request sharing DiT batches with a low one gets what it gets
alone. The DiT-level tests check the row slicing directly: a batch whose rows partly reuse and
partly run gives the running rows what they get alone, including Z-Image rows of different image and
caption sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.quality import PSNR_BARS
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.models.step_cache import BatchStepCache, CacheRows, StepCachePolicy, StepCacheState
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8 as psnr

STEPS = 20
PROMPT = "a red fox in the snow"
OTHER_PROMPT = "a lighthouse on a rocky coast at dusk, oil painting"
SEED = 7


def _input_image() -> Image.Image:
    y, x = np.mgrid[0:64, 0:64]
    rgb = np.stack([x / 64, y / 64, 0.5 + 0.5 * np.sin(x / 5.0)], axis=-1) * 255
    return Image.fromarray(rgb.astype(np.uint8))


#: name -> (builder of the model folder, generation kwargs; all run with the family's default CFG on)
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any]]] = {
    "z-image": (build_tiny_zimage, {"height": 64, "width": 64}),
    "wan-t2v": (build_tiny_wan, {"height": 64, "width": 64, "num_frames": 9}),
    "wan-i2v": (
        lambda root: build_tiny_wan(root, TinyWanSpec(image_to_video=True)),
        {"height": 64, "width": 64, "num_frames": 9, "input_images": [_input_image()]},
    ),
}


@dataclass
class Family:
    name: str
    gen: DiffGenerator
    kwargs: dict[str, Any]
    #: The exact output (quality unset) for PROMPT / SEED.
    reference: np.ndarray

    def params(self, prompt: str = PROMPT, seed: int = SEED, **extra: Any) -> SamplingParams:
        return SamplingParams(prompt=prompt, seed=seed, num_inference_steps=STEPS, **self.kwargs, **extra)


def _pixels(images: list[Image.Image] | None, frames: list[np.ndarray] | None) -> np.ndarray:
    """uint8 pixels of an image family's images or a video family's frames."""
    return np.stack(frames) if frames else np.stack([np.asarray(im) for im in images or []])


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory) -> Family:
    builder, kwargs = CASES[request.param]
    gen = DiffGenerator.from_pretrained(
        builder(tmp_path_factory.mktemp(request.param)), device="cpu", show_progress=False
    )
    fam = Family(request.param, gen, kwargs, np.empty(0))
    out = gen.generate_from_params(fam.params())
    fam.reference = _pixels(out.images, out.frames)
    assert fam.reference.std() > 5, "the reference output is flat; PSNR against it would prove nothing"
    return fam


def test_high_is_the_exact_path(family: Family) -> None:
    out = family.gen.generate_from_params(family.params(quality="high"))
    assert out.steps_computed_in_full == STEPS
    np.testing.assert_array_equal(_pixels(out.images, out.frames), family.reference)


def test_each_tier_keeps_its_psnr_bar_and_low_and_draft_skip_steps(family: Family) -> None:
    for tier, bar in PSNR_BARS.items():
        out = family.gen.generate_from_params(family.params(quality=tier))
        value = psnr(_pixels(out.images, out.frames), family.reference)
        print(
            f"{family.name} {tier}: {out.steps_computed_in_full}/{STEPS} steps in full, PSNR {value:.1f} dB"
        )
        assert value >= bar, f"{tier}: {value:.1f} dB is under its {bar} dB bar"
        assert out.steps_computed_in_full <= STEPS
        if tier != "medium":
            assert out.steps_computed_in_full < STEPS, f"{tier} reused no step"


def test_an_exact_request_batched_with_a_low_one_gets_its_own_output(family: Family) -> None:
    pipeline = family.gen.pipeline
    exact = pipeline.run_pre_denoise(pipeline.validate(Req(params=family.params(quality="high"))))
    cached = pipeline.run_pre_denoise(
        pipeline.validate(Req(params=family.params(prompt=OTHER_PROMPT, seed=SEED + 1, quality="low")))
    )
    assert exact.step_cache is None and cached.step_cache is not None
    assert exact.do_cfg and cached.do_cfg  # two rows per request: the groups must follow cfg_batch's order
    assert pipeline.batch_key(exact) == pipeline.batch_key(cached)
    while not exact.is_denoised:
        pipeline.denoise_step([exact, cached])
    exact, cached = pipeline.run_post_denoise(exact), pipeline.run_post_denoise(cached)

    got = _pixels(exact.outputs.images, exact.outputs.frames)
    diff = int(np.abs(got.astype(int) - family.reference.astype(int)).max())
    print(
        f"{family.name}: high next to low, max diff {diff}, low computed "
        f"{cached.step_cache.steps_computed}/{STEPS} steps ({cached.step_cache.history})"
    )
    # Batched and alone differ by at most the batch-invariance rounding (tests/e2e/test_step_batching.py).
    assert diff <= 1 and psnr(got, family.reference) >= 45.0
    assert cached.step_cache.steps_computed < STEPS
    assert cached.step_cache.steps_computed + cached.step_cache.steps_reused == STEPS


# --- DiT level: one forward with a reused row and a computed row -----------------------------------


def test_dit_rows_reuse_and_run_independently(family: Family) -> None:
    """Row 0 cached, row 1 not: step 0 runs both (the exact path, bit for bit), step 5 reuses row 0's
    residual and runs row 1 alone, which must give row 1 what it gets in a batch of its own."""
    dit = family.gen.pipeline.denoising_stage.denoise_step.transformer
    torch.manual_seed(0)
    if family.name == "z-image":
        _check_z_image_dit(dit)
    else:
        _check_wan_dit(dit)


def _check_z_image_dit(dit) -> None:
    # Row 0 (reused) has the larger image and the longer caption, so row 1 runs with a narrower layout
    # than the batch's and its result is padded back.
    xs = [torch.randn(16, 1, 12, 8), torch.randn(16, 1, 8, 8)]
    caps = [torch.randn(45, dit.config.cap_feat_dim), torch.randn(7, dit.config.cap_feat_dim)]
    t = torch.tensor([0.3, 0.6])

    def forward(cache: BatchStepCache | None) -> list[torch.Tensor]:
        with torch.inference_mode():
            return dit(xs, t, caps, step_cache=cache)

    exact = forward(None)
    state = StepCacheState(StepCachePolicy(threshold=10.0))
    first = forward(BatchStepCache([CacheRows(state, 1, 0, STEPS), CacheRows(None, 1, 0, STEPS)]))
    assert all(torch.equal(a, b) for a, b in zip(first, exact, strict=True))
    second = forward(BatchStepCache([CacheRows(state, 1, 5, STEPS), CacheRows(None, 1, 5, STEPS)]))
    assert state.history == [True, False]
    # Same inputs: the reused residual rebuilds row 0's blocks output; row 1 is what it is alone.
    torch.testing.assert_close(second[0], exact[0], rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        alone = dit(xs[1:], t[1:], caps[1:])[0]
    torch.testing.assert_close(second[1], alone, rtol=1e-5, atol=1e-5)


def _check_wan_dit(dit) -> None:
    config = dit.config
    latents = torch.randn(2, config.in_channels, 3, 8, 8)
    text = torch.randn(2, 16, config.text_dim)
    image = torch.randn(2, 5, config.image_dim) if config.image_dim else None
    t = torch.tensor([300.0, 700.0])

    def forward(cache: BatchStepCache | None, rows: slice = slice(None)) -> torch.Tensor:
        with torch.inference_mode():
            return dit(
                latents[rows], t[rows], text[rows], None if image is None else image[rows], step_cache=cache
            )

    exact = forward(None)
    state = StepCacheState(StepCachePolicy(threshold=10.0))
    first = forward(BatchStepCache([CacheRows(state, 1, 0, STEPS), CacheRows(None, 1, 0, STEPS)]))
    assert torch.equal(first, exact), "a step that runs every row must be the exact path"
    second = forward(BatchStepCache([CacheRows(state, 1, 5, STEPS), CacheRows(None, 1, 5, STEPS)]))
    assert state.history == [True, False]
    torch.testing.assert_close(second[0], exact[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[1:], forward(None, slice(1, 2)), rtol=1e-5, atol=1e-5)
