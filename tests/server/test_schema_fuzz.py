"""Issue 17: schemathesis over the server's own OpenAPI document, on a real server with the tiny FLUX.

Every operation is fuzzed with the API key (positive and negative data) and without it; the checks are
`not_a_server_error` and response conformance (status code, content type, headers, body schema): no 5xx,
and every answer as the document describes it. Bodies that reach real generations (JSON, SSE, url files,
multipart edits) are sent too, and validated by the same checks. Bounded: the tiny model, at most
MAX_STEPS steps (--max-inference-steps), FUZZ_EXAMPLES examples per operation and mode.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_process import ServerProcess, serving

schemathesis = pytest.importorskip(
    "schemathesis", reason="schemathesis is not installed (pip install schemathesis)"
)

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (hypothesis comes with schemathesis)
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from PIL import Image  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

API_KEY = "fuzz-key-0123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_STEPS = 2
FUZZ_EXAMPLES = 25
NO_KEY_EXAMPLES = 5
VALID_BODY_EXAMPLES = 12
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
#: Paths that need no key (middleware.OPEN_PATHS): probes and Prometheus.
OPEN_PATHS = {"/health", "/health_generate", "/metrics"}
#: Every operation the document must list (a route added without a test fails test_every_route_is_fuzzed).
OPERATIONS = [
    "POST /v1/images/generations",
    "POST /v1/images/edits",
    "GET /v1/images/{image_id}/content",
    "POST /v1/videos",
    "GET /v1/videos",
    "GET /v1/videos/{video_id}",
    "DELETE /v1/videos/{video_id}",
    "GET /v1/videos/{video_id}/content",
    "GET /v1/videos/{video_id}/stream",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "GET /v1/loras",
    "POST /v1/loras",
    "DELETE /v1/loras/{name}",
    "GET /health",
    "HEAD /health",
    "GET /health_generate",
    "GET /server_info",
    "GET /metrics",
]


@pytest.fixture(scope="module")
def fuzz_server(tiny_flux_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    with serving(
        tiny_flux_dir,
        tmp_path_factory.mktemp("fuzz-server"),
        "--max-inference-steps",
        str(MAX_STEPS),
        "--max-queue-size",
        "4",
        "--max-body-bytes",
        "65536",
        "--max-image-bytes",
        "65536",
        "--no-warmup",
        api_key=API_KEY,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def schema(fuzz_server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json", headers=AUTH, timeout=30)


def operation(schema: Any, label: str) -> Any:
    method, path = label.split(" ", 1)
    return schema[path][method]


def failures_of(
    run: Callable[[Callable[[Any], None]], None],
    headers: dict[str, str],
    statuses: list[int] | None = None,
    errors: list[str] | None = None,
) -> list[str]:
    """Every distinct check failure of the cases `run` feeds to the callback (all of them, not only the
    first, as hypothesis would stop at); `statuses` collects the answers' status codes."""
    found: dict[str, str] = {}

    def check(case: Any) -> None:
        response = case.call(headers=headers, timeout=120)
        if statuses is not None:
            statuses.append(response.status_code)
        if errors is not None and response.status_code >= 400:
            errors.append(f"{case.body!r} -> {response.status_code} {response.text[:300]}")
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (AssertionError, FailureGroup) as exc:
            text = str(exc)
            found.setdefault(text.splitlines()[0] if "ST" not in text else _codes(text), text[:2000])

    run(check)
    return list(found.values())


def _codes(text: str) -> str:
    """The failure kinds (`- ST105 Undocumented Content-Type`) of a schemathesis report: one per kind."""
    return "|".join(sorted(line.strip() for line in text.splitlines() if line.strip().startswith("- ")))


def fuzz(strategy: Any, examples: int) -> Callable[[Callable[[Any], None]], None]:
    def run(check: Callable[[Any], None]) -> None:
        @given(case=strategy)
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,  # the same cases on every run: a failure reproduces
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def each(case: Any) -> None:
            check(case)

        try:
            each()
        except Unsatisfiable:  # nothing to negate (no parameters or body): the positive mode covers it
            print(f"no cases: {strategy!r} has nothing to generate in this mode")

    return run


def test_every_route_is_fuzzed(schema: Any) -> None:
    listed = {f"{op.ok().method.upper()} {op.ok().path}" for op in schema.get_all_operations()}
    assert listed == set(OPERATIONS)


@pytest.mark.parametrize("label", [pytest.param(label, id=label) for label in OPERATIONS])
def test_fuzz_with_key(schema: Any, label: str) -> None:
    op = operation(schema, label)
    failures: list[str] = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        failures += failures_of(fuzz(op.as_strategy(generation_mode=mode), FUZZ_EXAMPLES), AUTH)
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("label", [pytest.param(label, id=label) for label in OPERATIONS])
def test_fuzz_without_key(schema: Any, fuzz_server: ServerProcess, label: str) -> None:
    """No key: the documented 401 everywhere but the open probes, and never a 5xx."""
    op = operation(schema, label)
    statuses: list[int] = []
    strategy = op.as_strategy(generation_mode=GenerationMode.POSITIVE)
    failures = failures_of(fuzz(strategy, NO_KEY_EXAMPLES), {}, statuses)
    assert not failures, "\n\n".join(failures)
    if op.path not in OPEN_PATHS:
        assert set(statuses) == {401}, statuses


# Bodies that reach real work: the fuzzer's random strings rarely make a valid request.


def png_bytes(size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


valid_generation_bodies = st.fixed_dictionaries(
    # num_inference_steps always: the model's default (28) is over --max-inference-steps (a 400).
    {
        "prompt": st.text(min_size=1, max_size=40).filter(str.strip),
        "num_inference_steps": st.integers(1, MAX_STEPS),
    },
    optional={
        "size": st.sampled_from(["16x16", "32x16", "auto"]),
        "n": st.integers(1, 2),
        "seed": st.integers(0, 2**32),
        "output_format": st.sampled_from(["png", "jpeg", "webp"]),
        "guidance_scale": st.floats(0, 10),
        "negative_prompt": st.text(max_size=20),
        "priority": st.integers(-1000, 1000),
    },
).map(lambda body: {"size": "16x16", **body} if body.get("size") in (None, "auto") else body)


def test_valid_generation_bodies_answer_as_documented(schema: Any) -> None:
    """Random valid bodies are 200s that conform to the document (streams: the next test)."""
    op = operation(schema, "POST /v1/images/generations")
    statuses: list[int] = []

    def run(check: Callable[[Any], None]) -> None:
        @given(body=valid_generation_bodies)
        @settings(max_examples=VALID_BODY_EXAMPLES, deadline=None, database=None, derandomize=True)
        def each(body: dict[str, Any]) -> None:
            check(op.Case(body=body, media_type="application/json"))

        each()

    failures = failures_of(run, AUTH, statuses, errors := [])
    assert not failures, "\n\n".join(failures)
    assert set(statuses) == {200}, errors


def test_streamed_generation_is_documented_sse(schema: Any) -> None:
    op = operation(schema, "POST /v1/images/generations")
    body = {
        "prompt": "a red square",
        "size": "16x16",
        "stream": True,
        "partial_images": 1,
        "num_inference_steps": 2,
    }
    case = op.Case(body=body, media_type="application/json")
    response = case.call(headers=AUTH, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
    assert b"image_generation.completed" in response.content
    case.validate_response(response, checks=CHECKS, headers=AUTH)


def assert_read_to_the_model(response: Any) -> None:
    """The tiny FLUX runs image-to-image: a well-formed edit body is read in full, its image decoded, and
    run by the model (one 16x16 image), past every parsing error."""
    assert response.status_code == 200, response.text
    assert response.json()["size"] == "16x16" and len(response.json()["data"]) == 1


def test_multipart_edit_is_documented(schema: Any) -> None:
    """The edits route reads multipart itself; its `openapi_extra` body must describe what it accepts."""
    op = operation(schema, "POST /v1/images/edits")
    body = {"image": [png_bytes()], "prompt": "make it blue", "size": "16x16", "num_inference_steps": "1"}
    case = op.Case(body=body, media_type="multipart/form-data")
    response = case.call(headers=AUTH, timeout=120)
    assert_read_to_the_model(response)
    case.validate_response(response, checks=CHECKS, headers=AUTH)


def test_json_edit_is_documented(schema: Any) -> None:
    op = operation(schema, "POST /v1/images/edits")
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    body = {"image": data_url, "prompt": "blue", "size": "16x16", "num_inference_steps": 1}
    case = op.Case(body=body, media_type="application/json")
    response = case.call(headers=AUTH, timeout=120)
    assert_read_to_the_model(response)
    case.validate_response(response, checks=CHECKS, headers=AUTH)


def test_url_image_content_is_documented(schema: Any, fuzz_server: ServerProcess) -> None:
    """A `response_format: url` answer's file is served as the document says (an image, not JSON)."""
    generate = operation(schema, "POST /v1/images/generations")
    body = {"prompt": "a cat", "size": "16x16", "response_format": "url", "num_inference_steps": 1}
    made = generate.Case(body=body, media_type="application/json").call(headers=AUTH, timeout=120)
    assert made.status_code == 200, made.text
    url = made.json()["data"][0]["url"]
    image_id = url.split("/v1/images/", 1)[1].split("/", 1)[0]
    case = operation(schema, "GET /v1/images/{image_id}/content").Case(path_parameters={"image_id": image_id})
    response = case.call(headers=AUTH, timeout=30)
    assert response.status_code == 200 and response.content.startswith(b"\x89PNG")
    case.validate_response(response, checks=CHECKS, headers=AUTH)


def test_video_create_body_is_documented(schema: Any) -> None:
    """POST /v1/videos reads its body itself (JSON or multipart): the document must say so, or the fuzzer
    never sends one. Fails today: video_routes.py's route has no `openapi_extra` request body."""
    content = operation(schema, "POST /v1/videos").definition.raw.get("requestBody", {}).get("content", {})
    assert {"application/json", "multipart/form-data"} <= set(content), sorted(content)
