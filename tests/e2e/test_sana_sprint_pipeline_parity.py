"""Whole SANA-Sprint generations: diffserve against Diffusers' SanaSprintPipeline, same tiny folder and seed.

The folder's DiT embeds the guidance scale and normalises q/k across heads; its sample_size 32 takes the
1024 px bins (64x96 is generated at 832x1216 and resized back). The SCM scheduler draws fresh noise at
every step from the request's generator, so a match also checks that the noise is drawn in Diffusers'
order.
"""

from __future__ import annotations

import pytest
from diffusers import SanaSprintPipeline

from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.families.sana.tiny import TinySanaSpec, build_tiny_sana
from diffserve.testing.parity import (
    assert_generation_matches,
    generator_and_reference,
)

PSNR_BAR_DB = 40.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = build_tiny_sana(tmp_path_factory.mktemp("sana_sprint"), TinySanaSpec(sprint=True, sample_size=32))
    return generator_and_reference(DiffGenerator, root, SanaSprintPipeline)


@pytest.mark.parametrize(
    ("steps", "n", "reference_extra"),
    [
        (2, 2, {}),  # Diffusers' default: angles pi/2, 1.3, 0; two outputs
        (1, 1, {"intermediate_timesteps": None}),  # one step: Diffusers needs its intermediate angle off
    ],
)
def test_sana_sprint_pixels_match_diffusers(engines, steps, n, reference_extra) -> None:
    ours, reference = engines
    kwargs = dict(height=64, width=96, num_inference_steps=steps, guidance_scale=4.5)
    label = f"SANA-Sprint {steps} step(s), n={n}"
    assert_generation_matches(
        ours, reference, label, min_db=PSNR_BAR_DB, prompt="A cat in the Rain", seed=7,
        num_outputs_per_prompt=n, reference_extra=reference_extra, **kwargs,
    )  # fmt: skip


def test_sana_sprint_refuses_a_negative_prompt(engines) -> None:
    ours, _ = engines
    with pytest.raises(InvalidRequestError, match="negative_prompt"):
        ours.generate(prompt="a cat", negative_prompt="blurry", height=64, width=96, num_inference_steps=2)


def test_sana_sprint_binned_size_that_is_no_multiple_of_32_matches_diffusers(engines) -> None:
    """Binning (the default) takes any size: 70x100 is generated at a 1024 px bin and resized back."""
    ours, reference = engines
    kwargs = dict(height=70, width=100, num_inference_steps=2, guidance_scale=4.5)
    assert_generation_matches(
        ours,
        reference,
        "SANA-Sprint binned 70x100",
        min_db=PSNR_BAR_DB,
        prompt="A cat in the Rain",
        seed=2,
        **kwargs,
    )
