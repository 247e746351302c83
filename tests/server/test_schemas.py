"""Request parsing and error messages of the HTTP layer, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from diffserve.server.errors import validation_error_message
from diffserve.server.middleware import content_token
from diffserve.server.schemas import ApiParamError, ImageGenerationRequest


def parse(**body) -> ImageGenerationRequest:
    return ImageGenerationRequest.model_validate({"prompt": "a fox", **body})


def test_openai_request_maps_to_sampling_params() -> None:
    params = parse(
        n=3,
        size="64x32",
        seed=5,
        output_format="webp",
        num_inference_steps=4,
        guidance_scale=2.0,
        negative_prompt="blur",
        true_cfg_scale=4.0,
    ).to_sampling_params()
    assert (params.width, params.height, params.num_outputs_per_prompt, params.seed) == (64, 32, 3, 5)
    assert params.output_format == "webp" and params.num_inference_steps == 4 and params.guidance_scale == 2.0
    assert params.negative_prompt == "blur" and params.true_cfg_scale == 4.0


@pytest.mark.parametrize("size", [None, "auto"])
def test_auto_size_leaves_model_defaults(size) -> None:
    params = parse(size=size).to_sampling_params()
    assert params.width is None and params.height is None and params.num_inference_steps is None


def test_width_height_extension_and_consistent_size() -> None:
    params = parse(width=48, height=32).to_sampling_params()
    assert (params.width, params.height) == (48, 32)
    assert parse(size="48x32", width=48).to_sampling_params().width == 48


def test_unset_seed_is_random_and_in_range() -> None:
    seeds = {parse().to_sampling_params().seed for _ in range(5)}
    assert len(seeds) > 1 and all(0 <= s < 2**32 for s in seeds)


@pytest.mark.parametrize(
    ("body", "ok"),
    [
        (
            {
                "quality": "auto",
                "background": "auto",
                "moderation": "auto",
                "stream": False,
                "partial_images": 0,
            },
            True,
        ),
        ({"stream": True, "partial_images": 3}, True),
        ({"quality": "medium"}, True),  # the tier is the engine's to check: the family may not have it
        ({"quality": "draft"}, True),
        ({"quality": "high"}, True),  # OpenAI's best image: the exact path
        ({"quality": "lossless"}, True),
        ({"quality": "hd"}, True),  # OpenAI's "hd" is high
        ({"quality": "standard"}, True),
        ({"background": "transparent"}, False),
        ({"moderation": "low"}, False),
        ({"style": "vivid"}, False),
        ({"output_format": "jpeg", "output_compression": 40}, True),
        ({"output_compression": 100}, True),
    ],
)
def test_openai_fields_only_with_no_op_values(body, ok) -> None:
    request = parse(**body)
    if ok:
        request.to_sampling_params()
    else:
        with pytest.raises(ApiParamError, match="not supported yet") as info:
            request.to_sampling_params()
        assert info.value.param == next(iter(body))


def test_partial_images_need_stream_and_streams_answer_b64_json() -> None:
    with pytest.raises(ApiParamError, match="partial_images=2 needs stream=true") as info:
        parse(partial_images=2).to_sampling_params()
    assert info.value.param == "partial_images"
    with pytest.raises(
        ApiParamError, match="response_format='url' is not available with stream=true"
    ) as info:
        parse(stream=True, response_format="url").to_sampling_params()
    assert info.value.param == "response_format"
    with pytest.raises(ValidationError):
        parse(stream=True, partial_images=4)


def test_validation_messages_name_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        ImageGenerationRequest.model_validate({"prompt": "x", "colour": "red"})
    message, param = validation_error_message(info.value.errors())
    assert (
        message.startswith("unknown field 'colour'; accepted fields: prompt, model, n,") and param == "colour"
    )
    with pytest.raises(ValidationError) as info:
        ImageGenerationRequest.model_validate({"prompt": "x", "n": 20})
    message, param = validation_error_message(info.value.errors())
    assert message == "n: Input should be less than or equal to 10, got 20" and param == "n"


def test_content_tokens_are_per_image_and_per_key() -> None:
    token = content_token("key", "a" * 32 + "-0")
    assert token == content_token("key", "a" * 32 + "-0") and len(token) == 32
    assert token != content_token("key", "a" * 32 + "-1") and token != content_token("other", "a" * 32 + "-0")


def test_front_end_never_imports_torch() -> None:
    """The HTTP process stays small and starts fast; only the engine process loads torch."""
    import subprocess
    import sys

    code = (
        "import sys, pickle\n"
        "import diffserve.cli.main, diffserve.server.runner\n"
        "from diffserve.server.protocol import EngineReady\n"
        "pickle.loads(pickle.dumps(EngineReady(pid=1, info={'versions': {'torch': '2.0'}}, probe_size=64)))\n"
        "assert 'torch' not in sys.modules, 'the front end imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
