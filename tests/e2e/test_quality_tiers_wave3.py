"""Approximate quality tiers (presets of the cache methods by name, issues 35/36) for HiDream-I1, HunyuanImage
2.1, Qwen-Image 2.1, HunyuanVideo 1.0 (T2V, I2V), CogVideoX (T2V, I2V), Mochi 1 and Chroma.

On each family's tiny random-weight checkpoint (what `diffserve make-tiny` writes), at the settings the
presets were chosen at (20 steps, each family's default guidance, the sizes below), on a prompt and seed the
choice did not use: every tier keeps its PSNR bar against the exact output (`high`), each tier computes
fewer steps in full than the tier above it (medium may compute all of them where nothing could be skipped
at its bar), and one DiT batch mixing the four tiers (the exact request on another prompt) gives each
request what it gets alone, with the same cache report. The figures each preset was chosen by are in the
comment above the family's `step_cache_policies`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.quality import APPROXIMATE_TIERS, EXACT, PSNR_BARS, TIERS
from diffserve.families.chroma.tiny import build_tiny_chroma
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.families.hidream.tiny import build_tiny_hidream
from diffserve.families.hunyuan_image.tiny import build_tiny_hunyuan_image
from diffserve.families.hunyuan_video.image_to_video_tiny import build_tiny_hunyuan_video_i2v
from diffserve.families.hunyuan_video.tiny import build_tiny_hunyuan_video
from diffserve.families.mochi.tiny import build_tiny_mochi
from diffserve.families.qwen_image21.tiny import build_tiny_qwen_image21
from diffserve.testing.cache_parity import assert_batched_as_alone, first_output_pixels
from diffserve.testing.image_metrics import psnr_uint8 as psnr

STEPS = 20
PROMPT, SEED = "a red fox in the snow", 7
OTHER_PROMPT, OTHER_SEED = "a lighthouse on a rocky coast at dusk, oil painting", 8
CLIP = {"height": 32, "width": 32, "num_frames": 5}


def _input_image() -> Image.Image:
    y, x = np.mgrid[0:32, 0:32]
    rgb = np.stack([x / 32, y / 32, 0.5 + 0.5 * np.sin(x / 5.0)], axis=-1) * 255
    return Image.fromarray(rgb.astype(np.uint8))


#: name -> (builder of the model folder, generation kwargs; each family at its default guidance).
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any]]] = {
    "hidream": (build_tiny_hidream, {"height": 32, "width": 32}),  # its area rule makes it 128x128
    "hunyuan-image-2.1": (build_tiny_hunyuan_image, {"height": 32, "width": 32}),
    "qwen-image-2.1": (build_tiny_qwen_image21, {"height": 64, "width": 64}),
    "hunyuan-video": (build_tiny_hunyuan_video, CLIP),
    "hunyuan-video-i2v": (build_tiny_hunyuan_video_i2v, {**CLIP, "input_images": [_input_image()]}),
    "cogvideox": (build_tiny_cogvideox, CLIP),
    "cogvideox-i2v": (  # its DiT's learned positions are for 64x80 only
        lambda root: build_tiny_cogvideox(root, TinyCogVideoXSpec(image_to_video=True)),
        {**CLIP, "height": 64, "width": 80, "input_images": [_input_image()]},
    ),
    "mochi": (build_tiny_mochi, {**CLIP, "num_frames": 7}),
    "chroma": (build_tiny_chroma, {"height": 64, "width": 64}),
}


@dataclass
class Family:
    name: str
    gen: DiffGenerator
    kwargs: dict[str, Any]
    #: Each tier's output for PROMPT / SEED, generated alone.
    outputs: dict[str, Any] = field(default_factory=dict)

    def params(self, quality: str, prompt: str = PROMPT, seed: int = SEED) -> SamplingParams:
        return SamplingParams(
            prompt=prompt, seed=seed, num_inference_steps=STEPS, quality=quality, **self.kwargs
        )


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory) -> Family:
    builder, kwargs = CASES[request.param]
    gen = DiffGenerator.from_pretrained(
        builder(tmp_path_factory.mktemp(request.param)), device="cpu", show_progress=False
    )
    fam = Family(request.param, gen, kwargs)
    fam.outputs = {tier: gen.generate_from_params(fam.params(tier)) for tier in TIERS}
    return fam


def test_each_tier_keeps_its_bar_and_computes_fewer_steps_than_the_one_above(family: Family) -> None:
    exact = family.outputs[EXACT]
    reference = first_output_pixels(exact)
    assert reference.std() > 5, "the exact output is flat; PSNR against it would prove nothing"
    assert exact.cache is None and exact.steps_computed_in_full == STEPS
    above = STEPS
    for tier, bar in PSNR_BARS.items():
        out = family.outputs[tier]
        score = psnr(first_output_pixels(out), reference)
        steps = out.steps_computed_in_full
        print(
            f"{family.name} {tier}: {score:.1f} dB, {steps} of {STEPS} steps in full ({out.cache['method']})"
        )
        assert out.params.quality == tier and out.cache["quality"] == tier
        assert score >= bar, f"{family.name} {tier}: {score:.1f} dB is under its {bar} dB bar"
        if tier == "medium":
            assert steps <= above, (family.name, tier, steps)
        else:
            assert steps < above, f"{family.name} {tier}: {steps} steps in full, the tier above {above}"
        above = steps


def test_a_batch_mixing_the_tiers_gives_each_request_its_alone_output(family: Family) -> None:
    requests = [
        family.params(EXACT, OTHER_PROMPT, OTHER_SEED),
        *(family.params(tier) for tier in APPROXIMATE_TIERS),
    ]
    alone = [None, *(family.outputs[tier] for tier in APPROXIMATE_TIERS)]
    assert_batched_as_alone(family.name, family.gen, requests, alone)
