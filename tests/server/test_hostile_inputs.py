"""Issue 17 item 4: what a hostile client sends to the routes that read their own bodies (/v1/videos,
/v1/images/edits) is a 400 naming what is wrong, never a 500, and nothing reaches the job store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.server import video_routes
from diffserve.server.app_state import AppState, set_app_state
from diffserve.server.args import ServerArgs
from diffserve.server.errors import install_error_handlers
from diffserve.server.health_probe import HealthProbe
from diffserve.server.image_edits import read_edit_request
from diffserve.server.metrics import ServerMetrics
from diffserve.testing.fake_pipeline import FakeFamily, FakeGenerator, FakePipeline, video_facts

DEEP = 100_000  # far beyond the JSON parser's recursion limit


class NoJobs:
    """A job manager that fails the test when anything would be stored."""

    ttl = 60.0

    async def create(self, *args, **kwargs):
        raise AssertionError("a bad request reached the job store")


@pytest.fixture(scope="module")
def client():
    engine = SimpleNamespace(
        ready=True,
        engine_info={
            "task": "text-to-video",
            "diffusers_pipeline": "WanPipeline",
            "video": {"temporal_factor": 4, "max_frames": 81, "max_fps": 120},
            "default_params": {"fps": 16},
        },
    )
    app = FastAPI()
    install_error_handlers(app)
    args = ServerArgs(EngineArgs(model_path="/m"))
    set_app_state(
        app, AppState(args, engine, ServerMetrics(), NoJobs(), HealthProbe(engine, 1.0, 1.0), started_at=0)
    )
    app.include_router(video_routes.router)

    @app.post("/edits")
    async def edits(request: Request) -> dict:
        await read_edit_request(request, 1 << 20)
        return {}

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def assert_400(response, param: str | None, *message_parts: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for part in message_parts:
        assert part in error["message"], error


def post_raw(client, path: str, text: str):
    return client.post(
        path, content=text.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"}
    )


@pytest.mark.parametrize("path", ["/v1/videos", "/edits"])
def test_deeply_nested_json_is_a_400(client, path: str) -> None:
    body = '{"prompt": ' + "[" * DEEP + "]" * DEEP + "}"
    assert_400(post_raw(client, path, body), None, "nested too deeply")


@pytest.mark.parametrize("path", ["/v1/videos", "/edits"])
@pytest.mark.parametrize("field", ["prompt", "negative_prompt", "model"])
def test_lone_surrogates_are_a_400_naming_the_field(client, path: str, field: str) -> None:
    body = {"prompt": "a cat", field: "a \ud800 b"}
    import json

    r = post_raw(client, path, json.dumps(body))  # ensure_ascii: "\ud800" as JSON escapes it
    assert_400(r, field, "lone surrogate")


@pytest.mark.parametrize("seconds", ["1e308", "Infinity", "-Infinity", "NaN", "1e20"])
def test_huge_or_non_finite_seconds_are_a_400(client, seconds: str) -> None:
    r = post_raw(client, "/v1/videos", '{"prompt": "a cat", "seconds": ' + seconds + "}")
    assert_400(r, "seconds")
    r = client.post("/v1/videos", json={"prompt": "a cat", "seconds": seconds})  # OpenAI's string form
    assert_400(r, "seconds")


@pytest.mark.parametrize("value", ["Infinity", "NaN", "-Infinity"])
def test_non_finite_guidance_is_a_400(client, value: str) -> None:
    r = post_raw(client, "/v1/videos", '{"prompt": "a cat", "guidance_scale": ' + value + "}")
    assert_400(r, "guidance_scale")
    r = post_raw(client, "/edits", '{"prompt": "a cat", "true_cfg_scale": ' + value + "}")
    assert_400(r, "true_cfg_scale")


def test_engine_process_rejects_too_many_steps_and_bad_text_naming_the_field(tmp_path) -> None:
    """What the front end lets through, the engine refuses at submission, before any work or memory."""
    from diffserve.server.engine_process import EngineProcess, EngineProcessConfig
    from diffserve.server.protocol import GenerateJob, JobRejected

    channel = SimpleNamespace(sent=[])
    channel.send = channel.sent.append
    config = EngineProcessConfig(EngineArgs(model_path="/fake/wan", output_path=str(tmp_path)), "", "", 1)
    family = FakeFamily("fake-wan", "WanPipeline", "text-to-video")
    engine = EngineProcess(
        config, channel, generator=FakeGenerator(FakePipeline(video_facts("WanPipeline")), family)
    )
    try:
        cases = {
            "num_inference_steps": SamplingParams(prompt="p", num_inference_steps=10**8),
            "prompt": SamplingParams(prompt="p\ud800"),
            "guidance_scale": SamplingParams(prompt="p", guidance_scale=float("inf")),
        }
        for i, (param, params) in enumerate(cases.items()):
            engine._handle(GenerateJob(f"v{i}", params, video_path=str(tmp_path / f"v{i}.mp4"), ack=True))
            reply = channel.sent[-1]
            assert isinstance(reply, JobRejected) and reply.param == param, reply
        assert not engine.generator.engine.has_work
    finally:
        engine.encoder.shutdown(wait=True)
