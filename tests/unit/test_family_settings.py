"""A family's own request settings (LTX-2's guidance knobs in `SamplingParams.extra`) are declared once with
`option` in the family's settings dataclass and checked by `settings_from`: types, bounds, unknown keys."""

from __future__ import annotations

import pytest

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.ltx2.config import LTX2Guidance, ltx2_guidance


def _settings(extra: dict, image_to_video: bool = False) -> LTX2Guidance:
    return ltx2_guidance(SamplingParams(prompt="x", extra=extra), image_to_video)


def test_no_extra_gives_the_declared_defaults() -> None:
    assert _settings({}) == LTX2Guidance()


def test_values_are_typed_and_normalised() -> None:
    settings = _settings(
        {"stg_scale": 2, "spatio_temporal_guidance_blocks": [3, 1, 3], "audio_guidance_scale": None}
    )
    assert settings.stg_scale == 2.0 and isinstance(settings.stg_scale, float)
    assert settings.spatio_temporal_guidance_blocks == (1, 3)
    assert settings.audio_guidance_scale is None  # an optional setting left unset takes the video's value
    assert _settings({"image_crf": 10}, image_to_video=True).image_crf == 10


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"stg_scale": -1}, r"extra\['stg_scale'\] must be a number >= 0, got -1"),
        ({"stg_scale": True}, r"extra\['stg_scale'\] must be a number >= 0, got True"),
        ({"stg_scale": None}, r"extra\['stg_scale'\] must be a number >= 0, got None"),
        ({"guidance_rescale": float("nan")}, r"extra\['guidance_rescale'\] must be a number in \[0, 1\]"),
        ({"motion_speed": 0}, r"extra\['motion_speed'\] must be a number > 0, got 0"),
        ({"use_cross_timestep": 1}, r"extra\['use_cross_timestep'\] must be true or false, got 1"),
        ({"spatio_temporal_guidance_blocks": [1, -2]}, r"must be a list of integers >= 0, got \[1, -2\]"),
        ({"spatio_temporal_guidance_blocks": 3}, r"must be a list of integers >= 0, got 3"),
        ({"nope": 1}, r"extra has unknown setting\(s\) 'nope'; allowed: audio_guidance_scale, stg_scale"),
        ({"image_crf": 3}, r"unknown setting\(s\) 'image_crf'"),  # text-to-video: no input image
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_the_rule(extra: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        _settings(extra)
    assert info.value.param == "extra"


def test_a_family_without_settings_refuses_extra_naming_it(tiny_flux_dir) -> None:  # noqa: ANN001
    from diffserve import DiffGenerator

    with DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False) as generator:
        with pytest.raises(
            InvalidRequestError, match=r"takes no family settings in extra, got 'stg_scale'"
        ) as info:
            generator.generate("x", height=64, width=64, num_inference_steps=1, extra={"stg_scale": 1.0})
        assert info.value.param == "extra"
