"""`"stream": true` on /v1/images/generations, driven by the official `openai` SDK against a real server
on the tiny FLUX checkpoint (conftest's module-scoped `server`): OpenAI's partial-image events, then
one completed event per image equal to the plain response, plain JSON errors before the stream starts,
`error` events after, and a client that leaves mid-stream cancels its request in the engine."""

from __future__ import annotations

import base64
import io
import json
import re

import httpx
import httpx2
import numpy as np
import openai
import pytest
from PIL import Image
from server_process import start_server

from diffserve.server.engine_client import EngineUnavailableError, JobFailedError
from diffserve.server.protocol import JobPreview
from diffserve.server.streaming import StreamHeader, error_event

WIDTH, HEIGHT = 48, 32
BODY = {"seed": 5, "num_inference_steps": 4}


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0)


def pixels(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def generate(server, stream: bool, **kwargs):
    extra = {**BODY, **kwargs.pop("extra_body", {})}
    return sdk(server).images.generate(
        model=server.model_name,
        prompt="a red fox",
        size=f"{WIDTH}x{HEIGHT}",
        extra_body=extra,
        **({"stream": True} if stream else {}),
        **kwargs,
    )


def metric(server, outcome: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    match = re.search(rf'^diffserve_generation_requests_total\{{outcome="{outcome}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_partial_images_then_the_final_image_equal_to_the_plain_response(server) -> None:
    events = list(generate(server, True, partial_images=2))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    for event in events:
        assert (event.size, event.output_format, event.quality, event.background) == (
            f"{WIDTH}x{HEIGHT}",
            "png",
            "high",  # the tier the request ran at ("auto" resolved to the server's default)
            "auto",
        )
        assert isinstance(event.created_at, int)
        assert pixels(event.b64_json).shape == (HEIGHT, WIDTH, 3)
    assert events[-1].usage.total_tokens == 0
    assert events[-1].model_extra["steps_computed_in_full"] == BODY["num_inference_steps"]
    plain = generate(server, False)
    # The seed is in both answers (a diffserve extension); BODY sets it, so both runs used the same.
    assert events[-1].model_extra["seed"] == plain.model_extra["seed"] == BODY["seed"]
    final = pixels(events[-1].b64_json)
    assert np.array_equal(final, pixels(plain.data[0].b64_json))
    # The previews are of the image being made (not noise): the second is closer to the final one.
    errors = [np.abs(pixels(e.b64_json).astype(float) - final).mean() for e in events[:2]]
    print(f"mean abs pixel error of the previews to the final image: {errors}")
    assert errors[1] <= errors[0]


def test_zero_partial_images_streams_only_the_final_image(server) -> None:
    events = list(generate(server, True, partial_images=0))
    assert [e.type for e in events] == ["image_generation.completed"]
    events = list(generate(server, True))  # partial_images unset: none either
    assert [e.type for e in events] == ["image_generation.completed"]


def test_n_images_give_one_completed_event_each(server) -> None:
    events = list(generate(server, True, n=2, partial_images=1))
    assert [(e.type, e.image_index) for e in events] == [
        ("image_generation.partial_image", 0),
        ("image_generation.partial_image", 1),
        ("image_generation.completed", 0),
        ("image_generation.completed", 1),
    ]
    plain = generate(server, False, n=2)
    for event, image in zip(events[2:], plain.data, strict=True):
        assert np.array_equal(pixels(event.b64_json), pixels(image.b64_json))


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        ({"partial_images": 4}, "partial_images: Input should be less than or equal to 3", "partial_images"),
        ({"size": "40x32"}, "width=40 is not a multiple of 16", "width"),  # found by the engine
        (
            {"response_format": "url"},
            "response_format='url' is not available with stream=true",
            "response_format",
        ),
        ({"quality": "best"}, "quality must be one of auto, high", "quality"),  # found by the engine
    ],
)
def test_bad_parameters_are_plain_400s_before_the_stream(server, extra, message, param) -> None:
    body = {
        "prompt": "a fox",
        "size": f"{WIDTH}x{HEIGHT}",
        "stream": True,
        "partial_images": 1,
        **BODY,
        **extra,
    }
    r = httpx.post(f"{server.base_url}/v1/images/generations", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        list(
            generate(
                server,
                True,
                **{k: v for k, v in extra.items() if k != "size"},
                extra_body={"size": extra["size"]} if "size" in extra else {},
            )
        )


def test_partial_images_without_stream_is_a_400(server) -> None:
    with pytest.raises(openai.BadRequestError, match="partial_images=2 needs stream=true"):
        generate(server, False, partial_images=2)
    generate(server, False, partial_images=0)  # zero previews: nothing to stream, accepted


def test_leaving_mid_stream_cancels_the_request(server) -> None:
    cancelled_before = metric(server, "cancelled")
    steps = 400  # the first preview comes at step 100: three quarters of the work are left to cancel
    body = {
        "prompt": "a fox",
        "size": f"{WIDTH}x{HEIGHT}",
        "stream": True,
        "partial_images": 3,
        "seed": 1,
        "num_inference_steps": steps,
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/images/generations", json=body, headers=server.headers, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        assert next(lines) == "event: image_generation.partial_image"  # the first preview, at step 100
        event = json.loads(next(lines).removeprefix("data: "))
        assert event["partial_image_index"] == 0
    # The client has closed the connection: the engine stops the request at its next step.
    log = server.wait_for(
        lambda: re.search(rf"Request {request_id} cancelled at step (\d+)", server.log()),
        timeout=60,
        what="the cancellation in the server log",
    )
    assert 100 <= int(log.group(1)) < steps
    server.wait_for(lambda: metric(server, "cancelled") == cancelled_before + 1, what="the cancelled count")
    server.wait_for(lambda: server.info()["engine"]["running"] == 0, what="no request left running")


@pytest.fixture(scope="module")
def edit_server(tmp_path_factory):
    """A tiny Qwen-Image-Edit server (the FLUX one takes no input image), without warm-up."""
    from diffserve.families.qwen_image.tiny import build_tiny_qwen_image_edit

    model_dir = build_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny-qwen-edit"))
    srv = start_server(model_dir, tmp_path_factory.mktemp("qwen-edit-server"), "--no-warmup")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.process.terminate()
        srv.process.wait(30)


def test_streamed_edit_sends_image_edit_events_and_the_plain_image(edit_server) -> None:
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 64, 3), dtype=np.uint8)).save(
        png, format="PNG"
    )
    client = openai.OpenAI(base_url=f"{edit_server.base_url}/v1", api_key="unused", max_retries=0)
    kwargs = {
        "image": ("in.png", png.getvalue(), "image/png"),
        "prompt": "make it blue",
        "size": "64x32",
        "extra_body": {"seed": 2, "num_inference_steps": 3, "true_cfg_scale": 1.0},
    }
    events = list(client.images.edit(stream=True, partial_images=1, **kwargs))
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    for event in events:
        assert event.size == "64x32" and pixels(event.b64_json).shape == (32, 64, 3)
    plain = client.images.edit(**kwargs)
    assert np.array_equal(pixels(events[-1].b64_json), pixels(plain.data[0].b64_json))


def test_events_parse_as_the_sdk_types_and_errors_raise() -> None:
    """The event bytes themselves, through the SDK's stream decoder (edits' names included), and an
    error after the stream started becoming `openai.APIError`."""
    png = io.BytesIO()
    Image.new("RGB", (WIDTH, HEIGHT)).save(png, format="PNG")
    header = StreamHeader("image_edit", f"{WIDTH}x{HEIGHT}", "png")
    preview = JobPreview("rid", index=0, step=1, total_steps=2, images=[png.getvalue()])
    failure = JobFailedError("boom", user_error=False)
    body = header.partial(preview, 0) + header.completed(png.getvalue(), 0, seed=3) + error_event(failure)

    def handler(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    transport = httpx2.MockTransport(handler)
    client = openai.OpenAI(
        base_url="http://test/v1",
        api_key="k",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(transport=transport),
    )
    stream = client.images.edit(image=png.getvalue(), prompt="x", stream=True, partial_images=1)
    first, second = next(stream), next(stream)
    assert type(first).__name__ == "ImageEditPartialImageEvent" and first.partial_image_index == 0
    assert type(second).__name__ == "ImageEditCompletedEvent" and second.output_format == "png"
    assert second.model_extra["seed"] == 3
    with pytest.raises(openai.APIError, match="the engine failed on this request: boom") as info:
        next(stream)
    assert info.value.body["type"] == "server_error" and info.value.body["code"] == "engine_error"
    unavailable = json.loads(
        error_event(EngineUnavailableError("gone", code="engine_died")).split(b"data: ")[1]
    )
    assert (
        unavailable["error"]["code"] == "engine_died"
        and unavailable["error"]["type"] == "service_unavailable"
    )
