"""Approximate quality tiers (step cache, `models/step_cache.py`) for SD3 and Qwen-Image.

On the tiny random-weight checkpoints, at the settings the pipelines' thresholds were measured at (20
steps, 64x64, one prompt without and one with a negative prompt): "high" is the exact path bit for
bit, also through the cache plumbing; every tier keeps its PSNR bar against it while low and draft skip
steps; an exact request sharing DiT batches with a low one keeps its exact output. The
DiT-level test checks Qwen-Image's row slicing where it is not trivial: per-sample RoPE tables, the
zero_cond_t timestep halves, padded text masks and conditioning-image tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.quality import PSNR_BARS
from diffserve.families.qwen_image.tiny import build_tiny_qwen_image
from diffserve.families.sd3.tiny import build_tiny_sd3
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel, QwenImageTransformerConfig
from diffserve.models.step_cache import BatchStepCache, CacheRows, StepCachePolicy, StepCacheState
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8 as psnr

STEPS = 20
SIZE = {"height": 64, "width": 64}
#: (prompt, seed, extra params): the second request runs CFG with a negative prompt of its own length.
PROMPTS = [("a red fox in the snow", 7, {}), ("a blue bird on a branch", 8, {"negative_prompt": "blurry"})]

#: name -> (builder of the model folder, params every request of the family gets)
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any]]] = {
    "sd3": (build_tiny_sd3, {}),  # classic CFG at the default guidance 7 ("" negative prompt when unset)
    "qwen-image": (build_tiny_qwen_image, {"true_cfg_scale": 4.0}),  # true CFG with a negative prompt
}


@dataclass
class Family:
    name: str
    gen: DiffGenerator
    common: dict[str, Any]
    #: The exact output (quality unset) per entry of PROMPTS.
    references: list[np.ndarray]

    def params(self, index: int, **extra: Any) -> SamplingParams:
        prompt, seed, own = PROMPTS[index]
        return SamplingParams(
            prompt=prompt, seed=seed, num_inference_steps=STEPS, **SIZE, **self.common, **own, **extra
        )


def _pixels(images: list) -> np.ndarray:
    return np.stack([np.asarray(im) for im in images])


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory) -> Family:
    builder, common = CASES[request.param]
    gen = DiffGenerator.from_pretrained(
        builder(tmp_path_factory.mktemp(request.param)), device="cpu", show_progress=False
    )
    fam = Family(request.param, gen, common, [])
    fam.references = [_pixels(gen.generate_from_params(fam.params(i)).images) for i in range(len(PROMPTS))]
    assert all(ref.std() > 5 for ref in fam.references), "a flat reference would make PSNR prove nothing"
    return fam


def _prepare(gen: DiffGenerator, reqs: list[Req]) -> list[Req]:
    """The engine's first phase: validation, encoders, latents and timesteps."""
    return [gen.pipeline.run_pre_denoise(gen.pipeline.validate(r)) for r in reqs]


def _denoise_and_decode(gen: DiffGenerator, reqs: list[Req]) -> list[Req]:
    """The engine's other two phases, every step one DiT batch of all the requests."""
    pipeline = gen.pipeline
    while not all(r.is_denoised for r in reqs):
        pipeline.denoise_step(reqs)
    return [pipeline.run_post_denoise(r) for r in reqs]


def test_high_is_the_exact_path_also_through_the_cache_plumbing(family: Family) -> None:
    out = family.gen.generate_from_params(family.params(1, quality="high"))
    assert out.params.quality == "high" and out.steps_computed_in_full == STEPS
    np.testing.assert_array_equal(_pixels(out.images), family.references[1])

    # A cache that never reuses (threshold 0) sends every step through `step_cache.run` and the DiT's
    # `_run_blocks` split: the pixels must still be the exact path's.
    (req,) = _prepare(family.gen, [Req(params=family.params(1))])
    req.step_cache = StepCacheState(StepCachePolicy(threshold=0.0))
    (req,) = _denoise_and_decode(family.gen, [req])
    assert req.step_cache.steps_computed == STEPS
    np.testing.assert_array_equal(_pixels(req.outputs.images), family.references[1])


def test_each_tier_keeps_its_psnr_bar_and_low_and_draft_skip_steps(family: Family) -> None:
    computed = {}
    for tier, bar in PSNR_BARS.items():
        scores, steps = [], []
        for i, reference in enumerate(family.references):
            out = family.gen.generate_from_params(family.params(i, quality=tier))
            assert out.params.quality == tier
            scores.append(psnr(_pixels(out.images), reference))
            steps.append(out.steps_computed_in_full)
        print(
            f"{family.name} {tier}: PSNR {[round(s, 1) for s in scores]} dB, steps in full {steps} of {STEPS}"
        )
        assert np.mean(scores) >= bar, (tier, scores)
        computed[tier] = max(steps)
    assert computed["draft"] <= computed["low"] <= computed["medium"] < STEPS
    assert computed["low"] <= 0.45 * STEPS


def test_an_exact_request_batched_with_a_low_one_keeps_its_exact_output(family: Family) -> None:
    exact, low = _prepare(
        family.gen, [Req(params=family.params(0)), Req(params=family.params(1, quality="low"))]
    )
    exact, low = _denoise_and_decode(family.gen, [exact, low])
    assert exact.step_cache is None and exact.steps_computed_in_full == STEPS
    assert low.steps_computed_in_full < STEPS
    # The exact request's own output, up to the GEMM rounding of a two-row batch (SD3 projects its
    # attention halves as contiguous copies, whose sums round differently at batch 2: a level at most).
    diff = np.abs(_pixels(exact.outputs.images).astype(np.int16) - family.references[0].astype(np.int16))
    assert int(diff.max()) <= 1 and float((diff > 0).mean()) < 0.001


def _tiny_qwen_dit() -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        QwenImageTransformerConfig(
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=24,
            axes_dims_rope=(4, 6, 6),
            zero_cond_t=True,
        )
    ).eval()


def test_qwen_dit_rows_that_run_while_others_reuse_get_their_exact_prediction() -> None:
    """Three rows: two edit samples whose image shapes differ (per-sample RoPE tables), with the
    zero_cond_t timestep halves and right-padded text. Whichever group reuses its residual, the rows
    that run the blocks get what the exact (uncached) forward gives them."""
    dit = _tiny_qwen_dit()
    shapes = [[(1, 4, 4), (1, 2, 4)], [(1, 4, 4), (1, 4, 2)], [(1, 4, 4), (1, 2, 4)]]
    inputs = {
        "hidden_states": torch.randn(3, 24, 16),
        "encoder_hidden_states": torch.randn(3, 7, 24),
        "encoder_hidden_states_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 5 + [0] * 2]).bool(),
        "timestep": torch.tensor([0.9, 0.5, 0.5]),
        "img_shapes": shapes,
    }
    with torch.no_grad():
        exact = dit(**inputs)
        # Groups: row 0 alone, rows 1-2 as one request with CFG. Step 0 runs everything and fills both
        # caches; at step 2, with the same inputs (no change), the cached group reuses its residual.
        for cached_group in (0, 1):
            states = [StepCacheState(StepCachePolicy(threshold=1.0)) for _ in range(2)]
            for step in (0, 2):
                groups = [
                    CacheRows(states[g] if step == 0 or g == cached_group else None, rows, step, STEPS)
                    for g, rows in enumerate((1, 2))
                ]
                out = dit(**inputs, step_cache=BatchStepCache(groups))
            assert states[cached_group].history == [True, False]
            torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)
