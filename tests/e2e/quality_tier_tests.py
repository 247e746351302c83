"""The module fixture, the two tests and the input image every `TierCase`-based quality-tier file
(test_quality_tiers_*.py over several families) declares: built from the file's cases, so each file states
only its families, their requests and the prompts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from diffserve import DiffGenerator
from diffserve.testing.cache_parity import TierCase, assert_mixed_tiers_as_alone, assert_tier_ladder

#: name -> (builder of the model folder, generation kwargs).
TierCases = Mapping[str, tuple[Callable[[Path], Path], dict[str, Any]]]


def input_image() -> Image.Image:
    """A 32x32 RGB image with detail in every channel: the image-to-video cases' input."""
    y, x = np.mgrid[0:32, 0:32]
    rgb = np.stack([x / 32, y / 32, 0.5 + 0.5 * np.sin(x / 5.0)], axis=-1) * 255
    return Image.fromarray(rgb.astype(np.uint8))


def tier_case_fixture(
    cases: TierCases, steps: int, prompt: str, seed: int
) -> Callable[[pytest.FixtureRequest, pytest.TempPathFactory], TierCase]:
    """The module fixture `family`, parametrized by the names of `cases`: the case's tiny folder built and
    loaded on the CPU, and every tier's output for `prompt` / `seed` at `steps` generated alone."""

    @pytest.fixture(scope="module", params=list(cases))
    def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TierCase:
        builder, kwargs = cases[request.param]
        gen = DiffGenerator.from_pretrained(
            builder(tmp_path_factory.mktemp(request.param)), device="cpu", show_progress=False
        )
        return TierCase(request.param, gen, kwargs, steps, prompt, seed).generate_tiers()

    return family


def tier_ladder_test() -> Callable[[TierCase], None]:
    """The test that every tier keeps its bar and computes fewer steps than the one above
    (`assert_tier_ladder`)."""

    def test_each_tier_keeps_its_bar_and_computes_fewer_steps_than_the_one_above(family: TierCase) -> None:
        assert_tier_ladder(family)

    return test_each_tier_keeps_its_bar_and_computes_fewer_steps_than_the_one_above


def mixed_tiers_test(other_prompt: str, other_seed: int) -> Callable[[TierCase], None]:
    """The test that one DiT batch mixing the tiers, the exact request on `other_prompt` / `other_seed`,
    gives each request its alone output (`assert_mixed_tiers_as_alone`)."""

    def test_a_batch_mixing_the_tiers_gives_each_request_its_alone_output(family: TierCase) -> None:
        assert_mixed_tiers_as_alone(family, other_prompt, other_seed)

    return test_a_batch_mixing_the_tiers_gives_each_request_its_alone_output
