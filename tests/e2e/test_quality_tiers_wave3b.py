"""Approximate quality tiers (presets of the cache methods by name, issues 35/36) for FLUX.1 Kontext, FLUX.1
Fill, FLUX.2 [dev], FLUX.2 [klein], SANA and SANA-Video; SANA-Sprint and step-distilled klein serve `high`
only.

On each family's tiny random-weight checkpoint (what `diffserve make-tiny` writes), at the settings the
presets were chosen at (20 steps, each family's default guidance, 32x32, 5 frames), on a prompt and seed the choice
did not use: every tier keeps its PSNR bar against the exact output (`high`), each tier computes no more
steps in full than the tier above it and low and draft fewer, and one DiT batch mixing the four tiers (the
exact request on another prompt) gives each request what it gets alone, with the same cache report. The
figures each preset was chosen by are in the comment above the family's `step_cache_policies`.
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
from diffserve.errors import InvalidRequestError
from diffserve.families.flux.kontext_preparation import FluxKontextPreparationStage
from diffserve.families.flux.tiny_fill import build_tiny_flux_fill
from diffserve.families.flux.tiny_kontext import build_tiny_flux_kontext
from diffserve.families.flux2.tiny import TinyFlux2Spec, build_tiny_flux2
from diffserve.families.sana.tiny import TinySanaSpec, build_tiny_sana
from diffserve.families.sana_video.tiny import build_tiny_sana_video
from diffserve.testing.cache_parity import assert_batched_as_alone, first_output_pixels
from diffserve.testing.image_metrics import psnr_uint8 as psnr

STEPS = 20
PROMPT, SEED = "a red fox in the snow", 7
OTHER_PROMPT, OTHER_SEED = "a lighthouse on a rocky coast at dusk, oil painting", 8
SIZE = {"height": 32, "width": 32}


def _input_image() -> Image.Image:
    y, x = np.mgrid[0:32, 0:32]
    rgb = np.stack([x / 32, y / 32, 0.5 + 0.5 * np.sin(x / 5.0)], axis=-1) * 255
    return Image.fromarray(rgb.astype(np.uint8))


def _mask() -> Image.Image:
    """White (to fill) in the middle 16x16 square."""
    mask = np.zeros((32, 32), np.uint8)
    mask[8:24, 8:24] = 255
    return Image.fromarray(mask)


#: name -> (builder of the model folder, generation kwargs; each family at its default guidance).
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any]]] = {
    "flux-kontext": (build_tiny_flux_kontext, {**SIZE, "input_images": [_input_image()]}),
    "flux-fill": (build_tiny_flux_fill, {**SIZE, "input_images": [_input_image()], "mask_image": _mask()}),
    "flux2": (lambda root: build_tiny_flux2(root, TinyFlux2Spec(variant="dev")), SIZE),
    "flux2-klein": (lambda root: build_tiny_flux2(root, TinyFlux2Spec(variant="klein")), SIZE),
    "sana": (build_tiny_sana, SIZE),
    "sana-video": (
        build_tiny_sana_video,
        {**SIZE, "num_frames": 5, "extra": {"use_resolution_binning": False}},
    ),
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
    for stage in gen.pipeline.stages:  # Kontext: keep the 32x32 input (not its 1024 px preferred size)
        if isinstance(stage, FluxKontextPreparationStage):
            stage.auto_resize = False
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


@pytest.mark.parametrize(
    "name, builder",
    [
        ("sana-sprint", lambda root: build_tiny_sana(root, TinySanaSpec(sprint=True, sample_size=32))),
        (
            "flux2-klein-distilled",
            lambda root: build_tiny_flux2(root, TinyFlux2Spec(variant="klein", is_distilled=True)),
        ),
    ],
)
def test_few_step_checkpoints_serve_only_the_exact_tier(name: str, builder, tmp_path: Path) -> None:
    gen = DiffGenerator.from_pretrained(builder(tmp_path / name), device="cpu", show_progress=False)
    with pytest.raises(InvalidRequestError, match="quality='medium' is not available"):
        gen.generate_from_params(
            SamplingParams(prompt=PROMPT, quality="medium", num_inference_steps=2, **SIZE)
        )
