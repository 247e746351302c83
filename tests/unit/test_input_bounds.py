"""Issue 17 items 3 and 4: bounds and finiteness of what a request may ask for, checked at submission."""

from __future__ import annotations

import math

import pytest

from diffserve.cli.engine_flags import engine_args_from
from diffserve.cli.main import build_parser
from diffserve.configs.sampling_params import MAX_PROMPT_CHARS, SamplingParams
from diffserve.errors import InvalidRequestError, UserError
from diffserve.request import Req
from diffserve.runtime.scheduler import SchedulerConfig
from diffserve.server.schemas import ApiParamError, ImageGenerationRequest, VideoCreateRequest
from diffserve.stages.prompt_cache import PromptEmbeddingCache
from diffserve.testing.fake_pipeline import FakeGenerator

VIDEO_RULES = {"temporal_factor": 4, "max_frames": 81, "max_fps": 120}


def submit(generator: FakeGenerator, **params):
    return generator.engine.prepare(
        Req(params=SamplingParams(prompt=params.pop("prompt", "a cat"), **params))
    )


def rejected(generator: FakeGenerator, **params) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        submit(generator, **params)
    return info.value


def test_steps_above_the_engine_limit_are_refused_at_submission() -> None:
    generator = FakeGenerator()
    assert generator.engine.config.max_inference_steps == 1000
    submit(generator, num_inference_steps=1000)
    error = rejected(generator, num_inference_steps=10**8)
    assert error.param == "num_inference_steps"
    assert "<= 1000" in str(error) and "--max-inference-steps" in str(error) and "100000000" in str(error)
    small = FakeGenerator(config=SchedulerConfig(max_batch_tokens=16384, max_inference_steps=5))
    assert rejected(small, num_inference_steps=6).param == "num_inference_steps"
    with pytest.raises(ValueError, match="max_inference_steps"):
        SchedulerConfig(max_inference_steps=0)


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_long_and_non_utf8_text_is_refused_naming_the_field(field: str) -> None:
    generator = FakeGenerator()
    error = rejected(generator, **{field: "x" * (MAX_PROMPT_CHARS + 1)})
    assert error.param == field and f"at most {MAX_PROMPT_CHARS}" in str(error)
    submit(generator, **{field: "x" * MAX_PROMPT_CHARS})
    error = rejected(generator, **{field: "a cat \ud800"})
    assert error.param == field and "surrogate" in str(error)
    str(error).encode("utf-8")  # the message itself can be sent


@pytest.mark.parametrize("field", ["guidance_scale", "true_cfg_scale"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_guidance_must_be_finite(field: str, value: float) -> None:
    error = rejected(FakeGenerator(), **{field: value})
    assert error.param == field and "finite" in str(error)


def test_check_values_needs_no_model() -> None:
    SamplingParams(prompt="a cat").check_values()  # unset fields (model defaults) pass
    for field, value in [("num_inference_steps", 0), ("height", -8), ("num_frames", 0), ("seed", -1)]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(prompt="a cat", **{field: value}).check_values()
        assert info.value.param == field


def test_prompt_cache_bounds_its_entries_as_well_as_its_bytes() -> None:
    cache = PromptEmbeddingCache(max_entries=3)
    compute = lambda prompts: [() for _ in prompts]  # noqa: E731  (0 bytes each: only the key count bounds them)
    for i in range(10):
        cache.lookup([f"prompt {i}"], (), compute)
    assert len(cache) == 3
    misses = cache.misses
    cache.lookup(["prompt 9", "prompt 8", "prompt 7"], (), compute)
    assert cache.misses == misses  # the most recent three are kept
    assert len(PromptEmbeddingCache()) == 0 and PromptEmbeddingCache().max_entries >= 1


def test_schemas_refuse_non_finite_scales_and_surrogates() -> None:
    from pydantic import ValidationError

    for body in (
        {"prompt": "a", "guidance_scale": math.inf},
        {"prompt": "a", "true_cfg_scale": math.nan},
        {"prompt": "a\ud800"},
        {"prompt": "a", "negative_prompt": "\udfff"},
    ):
        with pytest.raises(ValidationError):
            ImageGenerationRequest.model_validate(body)
    with pytest.raises(ValidationError):
        VideoCreateRequest.model_validate({"prompt": "a", "seconds": "Infinity"})


@pytest.mark.parametrize("seconds", [1e308, "1e308", 1e20])
def test_huge_seconds_are_a_400_naming_seconds(seconds) -> None:
    body = VideoCreateRequest.model_validate({"prompt": "a", "seconds": seconds})
    with pytest.raises(ApiParamError) as info:
        body.to_sampling_params(VIDEO_RULES, 16)
    assert info.value.param == "seconds" and "81 frames" in str(info.value)


def test_max_inference_steps_flag_on_generate_and_serve() -> None:
    parser = build_parser()
    for command in ("generate", "serve"):
        extra = ["--prompt", "p"] if command == "generate" else []
        args = parser.parse_args([command, "--model-path", "/m", "--max-inference-steps", "50", *extra])
        assert engine_args_from(args).max_inference_steps == 50
        default = parser.parse_args([command, "--model-path", "/m", *extra])
        assert engine_args_from(default).max_inference_steps == 1000
        with pytest.raises(UserError, match="--max-inference-steps must be >= 1"):
            engine_args_from(
                parser.parse_args([command, "--model-path", "/m", "--max-inference-steps", "0", *extra])
            )
