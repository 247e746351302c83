"""The HTTP `extra` field carries a family's own settings (LTX-2's guidance knobs) to the engine, bounded so
that nothing a client sends there grows the server's memory; which keys a family takes, the family checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from diffserve.server.schemas import (
    MAX_EXTRA_SETTINGS,
    ImageGenerationRequest,
    VideoCreateRequest,
    sampling_params,
)


@pytest.mark.parametrize("model", [ImageGenerationRequest, VideoCreateRequest])
def test_extra_reaches_the_sampling_params(model: type) -> None:
    body = model(prompt="x", extra={"stg_scale": 1.5, "spatio_temporal_guidance_blocks": [1, 2]})
    assert sampling_params(body).extra == {"stg_scale": 1.5, "spatio_temporal_guidance_blocks": [1, 2]}
    assert sampling_params(model(prompt="x")).extra == {}  # unset: no family settings


def test_a_multipart_form_sends_extra_as_json_text() -> None:
    assert VideoCreateRequest(prompt="x", extra='{"motion_speed": 0.5}').extra == {"motion_speed": 0.5}


@pytest.mark.parametrize(
    "extra",
    [
        {f"k{i}": 1 for i in range(MAX_EXTRA_SETTINGS + 1)},
        {"nested": {"a": 1}},
        {"long": list(range(10_000))},
        {"k" * 1000: 1},
        "not json",
        "[1, 2]",
        "[" * 100_000,
    ],
)
def test_unbounded_or_malformed_extra_is_refused(extra: object) -> None:
    with pytest.raises(ValidationError, match="extra"):
        VideoCreateRequest(prompt="x", extra=extra)
