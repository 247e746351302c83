"""Issue 17 item 2: `/v1/images/edits` holds a request to what the served model can use before any image
is decoded (count: 400 naming `image`; body: 413 at `--max-body-bytes` for a model that takes none),
and decodes off the event loop in bounded worker pools of its own, so /health answers meanwhile.

The app is the route's own code path (`EditModel.served`, `read_edit_request`, `EditInputs.decode`)
behind the server's body-size middleware, over a stand-in engine report: no model is loaded.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from PIL import Image

import diffserve.server.request_body as request_body
from diffserve.configs.engine_args import EngineArgs
from diffserve.server.args import MAX_INPUT_IMAGES, ServerArgs
from diffserve.server.errors import install_error_handlers
from diffserve.server.image_edits import EditModel, read_edit_request
from diffserve.server.middleware import BodySizeLimitMiddleware

MAX_BODY_BYTES = 4096
MAX_IMAGE_BYTES = 3000
WAIT_S = 30.0  # only so that a broken test fails instead of hanging
TEXT_TO_IMAGE = {
    "task": "text-to-image",
    "diffusers_pipeline": "FluxPipeline",
    "max_input_images": 0,
    "pipelines_for_task": {"image-edit": ["FluxKontextPipeline", "QwenImageEditPipeline"]},
}
EDIT_TWO = {"task": "image-edit", "diffusers_pipeline": "QwenImageEditPlusPipeline", "max_input_images": 2}


def png(width: int = 8, height: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def make_app(engine_info: dict | None, **server_args) -> tuple[FastAPI, ServerArgs]:
    """/v1/images/edits as app.py runs it (and its body-size middleware), and /health."""
    args = ServerArgs(
        EngineArgs(model_path="/m"),
        max_body_bytes=MAX_BODY_BYTES,
        max_image_bytes=MAX_IMAGE_BYTES,
        **server_args,
    )
    engine = SimpleNamespace(ready=engine_info is not None, engine_info=engine_info or {})
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/images/edits")
    async def edits(request: Request) -> dict:
        model = EditModel.served(engine, args)
        inputs = await read_edit_request(request, args.max_edit_body_bytes, model)
        images, mask = await inputs.decode(args.allow_url_images, args.image_limits)
        return {"sizes": [list(image.size) for image in images], "mask": mask is not None}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    limits = {"/v1/images/edits": (args.max_edit_body_bytes, "--max-image-bytes and --max-body-bytes")}
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_body_bytes, path_limits=limits)
    return app, args


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The params of every image the route decodes (the real decoder still runs)."""
    calls: list[str] = []
    real = request_body.load_image

    def recording(source, *, param, **kwargs):
        calls.append(param)
        return real(source, param=param, **kwargs)

    monkeypatch.setattr(request_body, "load_image", recording)
    return calls


def assert_error(response, status: int, param: str | None, *parts: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for part in parts:
        assert part in error["message"], error


# -- a model that takes no input image ----------------------------------------------------------------
def test_a_text_to_image_model_refuses_images_before_decoding(decoded: list[str]) -> None:
    app, _ = make_app(TEXT_TO_IMAGE)
    with TestClient(app) as client:
        as_json = client.post("/v1/images/edits", json={"prompt": "p", "image": data_url(png())})
        files = [("image[]", ("a.png", png(), "image/png")), ("image[]", ("b.png", png(), "image/png"))]
        as_form = client.post("/v1/images/edits", data={"prompt": "p"}, files=files)
    for response in (as_json, as_form):
        assert_error(response, 400, "image", "FluxPipeline is a text-to-image model and takes no input image")
        assert (
            "need an edit model (FluxKontextPipeline, QwenImageEditPipeline)"
            in response.json()["error"]["message"]
        )
    assert decoded == []


def test_a_text_to_image_model_holds_the_body_to_max_body_bytes(decoded: list[str]) -> None:
    app, args = make_app(TEXT_TO_IMAGE)
    assert args.max_edit_body_bytes > 4 * MAX_BODY_BYTES  # what the middleware alone would let through
    padding = "x" * MAX_BODY_BYTES
    with TestClient(app) as client:
        by_length = client.post("/v1/images/edits", json={"prompt": padding, "image": data_url(png())})
        chunked = client.post(
            "/v1/images/edits",
            content=iter([b'{"prompt": "', padding.encode(), b'"}']),  # no Content-Length
            headers={"content-type": "application/json"},
        )
        within = client.post("/v1/images/edits", json={"prompt": "x" * (MAX_BODY_BYTES - 200)})
    for response in (by_length, chunked):
        assert_error(response, 413, None, f"limit of {MAX_BODY_BYTES} bytes", "FluxPipeline takes no input")
    assert_error(within, 400, "image", "image is required")  # under the limit the body is read
    assert decoded == []


# -- a model that takes input images ------------------------------------------------------------------
def test_an_edit_model_refuses_more_images_than_it_takes_before_decoding(decoded: list[str]) -> None:
    app, _ = make_app(EDIT_TWO)
    three = [data_url(png()) for _ in range(3)]
    with TestClient(app) as client:
        response = client.post("/v1/images/edits", json={"prompt": "p", "image": three})
    assert_error(response, 400, "image", "QwenImageEditPlusPipeline takes at most 2 input image(s), got 3")
    assert decoded == []


def test_an_edit_model_gets_room_for_the_images_it_takes(decoded: list[str]) -> None:
    app, args = make_app(EDIT_TWO)
    limit = args.image_body_bytes(2)
    assert MAX_BODY_BYTES < limit < args.max_edit_body_bytes
    with TestClient(app) as client:
        ok = client.post("/v1/images/edits", json={"prompt": "p", "image": [data_url(png(8, 4))] * 2})
        over = client.post("/v1/images/edits", json={"prompt": "x" * limit, "image": data_url(png())})
    assert ok.status_code == 200, ok.text
    assert ok.json() == {"sizes": [[8, 4], [8, 4]], "mask": False}
    assert decoded == ["image[0]", "image[1]"]
    assert_error(over, 413, None, f"limit of {limit} bytes", "takes at most 2 input image(s)")


def test_before_the_engine_reports_the_server_wide_bounds_apply(decoded: list[str]) -> None:
    app, _ = make_app(None)
    too_many = [data_url(png(2, 2))] * (MAX_INPUT_IMAGES + 1)
    with TestClient(app) as client:
        refused = client.post("/v1/images/edits", json={"prompt": "p", "image": too_many})
        decodes = client.post("/v1/images/edits", json={"prompt": "p", "image": data_url(png(4, 4))})
    assert_error(refused, 400, "image", f"at most {MAX_INPUT_IMAGES} input images")
    assert decodes.status_code == 200 and decoded == ["image"]


# -- off the event loop, in bounded pools -------------------------------------------------------------
class SlowDecoder:
    """A decoder that waits for `release`, so a test can act while a decode is in progress."""

    def __init__(self) -> None:
        self.started, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()
        self.real = request_body.load_image

    def __call__(self, source, **kwargs) -> Image.Image:
        self.started.set()
        self.release.wait(WAIT_S)
        try:
            return self.real(source, **kwargs)
        finally:
            self.finished.set()


@pytest.fixture
def slow_decoder(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowDecoder]:
    decoder = SlowDecoder()
    monkeypatch.setattr(request_body, "load_image", decoder)
    yield decoder
    decoder.release.set()


def post_in_thread(client: TestClient, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def post() -> None:
        out["response"] = client.post("/v1/images/edits", json=body)

    thread = threading.Thread(target=post)
    thread.start()
    return thread, out


def test_health_answers_while_an_image_decodes(slow_decoder: SlowDecoder) -> None:
    app, _ = make_app(EDIT_TWO)
    with TestClient(app) as client:
        thread, out = post_in_thread(client, {"prompt": "p", "image": data_url(png(6, 6))})
        assert slow_decoder.started.wait(WAIT_S)
        health = client.get("/health")
        assert health.status_code == 200 and not slow_decoder.finished.is_set()  # answered mid-decode
        slow_decoder.release.set()
        thread.join(WAIT_S)
    assert out["response"].status_code == 200 and out["response"].json()["sizes"] == [[6, 6]]


def test_a_full_decode_pool_answers_429(monkeypatch: pytest.MonkeyPatch, slow_decoder: SlowDecoder) -> None:
    monkeypatch.setattr(request_body, "DECODE_POOL", request_body.WorkerPool("test-decode", 1, 0, "busy now"))
    app, _ = make_app(EDIT_TWO)
    body = {"prompt": "p", "image": data_url(png())}
    with TestClient(app) as client:
        thread, out = post_in_thread(client, body)
        assert slow_decoder.started.wait(WAIT_S)
        refused = client.post("/v1/images/edits", json=body)
        slow_decoder.release.set()
        thread.join(WAIT_S)
        after = client.post("/v1/images/edits", json=body)  # the slot is free again
    assert_error(refused, 429, None, "busy now")
    assert refused.headers["retry-after"] == "1"
    assert out["response"].status_code == 200 and after.status_code == 200


def test_downloads_and_decodes_run_in_their_own_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL is fetched on an image-fetch thread and decoded on an image-decode thread: neither on the
    event loop nor on the default executor's threads (which engine restarts use)."""
    threads: dict[str, str] = {}

    def fetch(source, **kwargs) -> bytes:
        threads["fetch"] = threading.current_thread().name
        return png(5, 3)

    def decode(data, **kwargs) -> Image.Image:
        threads["decode"] = threading.current_thread().name
        return Image.open(io.BytesIO(data)).convert("RGB")

    monkeypatch.setattr(request_body, "read_image_source", fetch)
    monkeypatch.setattr(request_body, "decode_image", decode)
    app, _ = make_app(EDIT_TWO, allow_url_images=True)
    with TestClient(app) as client:
        response = client.post("/v1/images/edits", json={"prompt": "p", "image": "https://cdn.example/a.png"})
    assert response.status_code == 200 and response.json()["sizes"] == [[5, 3]]
    assert threads["fetch"].startswith("image-fetch") and threads["decode"].startswith("image-decode")


# -- what an edit model's decoding refuses, naming the image at fault ---------------------------------
def noise_png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_bad_images_are_400_naming_the_field() -> None:
    junk = np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes()
    app, _ = make_app(EDIT_TWO)
    fields = {"prompt": "p"}
    with TestClient(app) as client:
        one = client.post("/v1/images/edits", files={"image": ("in.png", junk)}, data=fields)
        two = client.post(
            "/v1/images/edits",
            files=[("image[]", ("a.png", png())), ("image[]", ("b.png", junk))],
            data=fields,
        )
        mask = client.post(
            "/v1/images/edits", files=[("image", ("a.png", png())), ("mask", ("m.png", junk))], data=fields
        )
        base64_junk = client.post(
            "/v1/images/edits", json={"prompt": "p", "image": "data:image/png;base64,@@@"}
        )
        path = client.post("/v1/images/edits", data={"prompt": "p", "image": "/etc/hostname"})
        url = client.post(
            "/v1/images/edits", json={"prompt": "p", "images": [{"image_url": "https://a.example/c.png"}]}
        )
    assert_error(one, 400, "image", "image: data is not a recognised image")
    assert_error(two, 400, "image[1]", "image[1]: data is not a recognised image")
    assert_error(mask, 400, "mask", "mask: data is not a recognised image")
    assert_error(base64_junk, 400, "image", "not valid base64")
    assert_error(path, 400, "image", "the server never reads file paths")
    assert_error(url, 400, "images", "image URLs are disabled on this server", "--allow-url-images")


def test_oversized_images_get_413() -> None:
    app, args = make_app(EDIT_TWO, max_image_pixels=64 * 64)
    big = noise_png(40, 40)  # over --max-image-bytes, within the body limit and the pixel limit
    assert len(big) > MAX_IMAGE_BYTES and len(big) * 4 // 3 + 100 < args.image_body_bytes(2)
    with TestClient(app) as client:
        upload = client.post("/v1/images/edits", files={"image": ("big.png", big)}, data={"prompt": "p"})
        as_json = client.post("/v1/images/edits", json={"prompt": "p", "image": data_url(big)})
        wide = client.post("/v1/images/edits", files={"image": ("w.png", png(128, 64))}, data={"prompt": "p"})
    assert_error(upload, 413, "image", "over the limit of 2.9 KiB")
    assert upload.json()["error"]["code"] == "image_too_large"
    assert_error(as_json, 413, "image", "decoded data URL is")
    assert_error(wide, 413, "image", "image is 128x64 (8192 pixels), over the limit of 4096 pixels")
