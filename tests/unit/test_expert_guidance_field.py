"""`guidance_scale_2` (Wan 2.2 A14B's low-noise expert) is refused, naming the field, by every family that
does not read it, instead of being ignored."""

from __future__ import annotations

import pytest

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.stages.input_validation import ImageInputRule, InputValidationStage


def _stage(expert_guidance: bool) -> InputValidationStage:
    return InputValidationStage(
        defaults=SamplingParams(num_inference_steps=4, guidance_scale=3.0),
        pixel_multiple=16,
        default_pixels=64,
        max_sequence_length_limit=None,
        cfg_mode="classic",
        image_inputs=ImageInputRule(pipeline_name="SomePipeline"),
        expert_guidance=expert_guidance,
    )


def test_a_family_without_a_second_expert_refuses_guidance_scale_2() -> None:
    with pytest.raises(
        InvalidRequestError, match="guidance_scale_2 is not a parameter of SomePipeline"
    ) as err:
        _stage(expert_guidance=False).resolve(SamplingParams(prompt="x", guidance_scale_2=2.0))
    assert err.value.param == "guidance_scale_2"


def test_a_two_expert_family_keeps_it() -> None:
    resolved = _stage(expert_guidance=True).resolve(SamplingParams(prompt="x", guidance_scale_2=2.0))
    assert resolved.guidance_scale_2 == 2.0
