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
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.flux.kontext_preparation import FluxKontextPreparationStage
from diffserve.families.flux.tiny_fill import build_tiny_flux_fill
from diffserve.families.flux.tiny_kontext import build_tiny_flux_kontext
from diffserve.families.flux2.tiny import TinyFlux2Spec, build_tiny_flux2
from diffserve.families.sana.tiny import TinySanaSpec, build_tiny_sana
from diffserve.families.sana_video.tiny import build_tiny_sana_video
from diffserve.testing.cache_parity import TierCase, assert_mixed_tiers_as_alone, assert_tier_ladder

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


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory) -> TierCase:
    builder, kwargs = CASES[request.param]
    gen = DiffGenerator.from_pretrained(
        builder(tmp_path_factory.mktemp(request.param)), device="cpu", show_progress=False
    )
    for stage in gen.pipeline.stages:  # Kontext: keep the 32x32 input (not its 1024 px preferred size)
        if isinstance(stage, FluxKontextPreparationStage):
            stage.auto_resize = False
    return TierCase(request.param, gen, kwargs, STEPS, PROMPT, SEED).generate_tiers()


def test_each_tier_keeps_its_bar_and_computes_fewer_steps_than_the_one_above(family: TierCase) -> None:
    assert_tier_ladder(family)


def test_a_batch_mixing_the_tiers_gives_each_request_its_alone_output(family: TierCase) -> None:
    assert_mixed_tiers_as_alone(family, OTHER_PROMPT, OTHER_SEED)


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
