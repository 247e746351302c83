"""`POST /v1/images/edits` succeeding on an edit model: a tiny Qwen-Image-Edit checkpoint served by a real
`diffserve serve`, driven by the official `openai` SDK and raw HTTP. Also checks that the server's
pixels for a seed equal the in-process API's (`DiffGenerator.generate(image=...)`) and the CLI's
`--image`. Failures on a text-to-image model and all parsing errors: test_images_edits.py."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from api_checks import b64_pixels
from edit_inputs import cli_generate_with_image, random_png
from PIL import Image
from server_process import serving

#: A 2:1 input; the output keeps its aspect ratio when no size is given.
INPUT_SIZE = (64, 32)
#: Few steps, no true CFG: fast. (Two steps rather than one: a one-step Qwen-Image schedule is 0/0 in
#: Diffusers' shift_terminal stretch; diffserve leaves it unstretched, see flow_match_euler.py.)
FAST = {"num_inference_steps": 2, "true_cfg_scale": 1.0}


def input_png(size: tuple[int, int] = INPUT_SIZE, seed: int = 0) -> bytes:
    return random_png(size, seed)


@pytest.fixture(scope="module")
def tiny_qwen_edit_dir(tmp_path_factory) -> Path:
    from diffserve.families.qwen_image.tiny import build_tiny_qwen_image_edit

    return Path(build_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny-qwen-edit")))


@pytest.fixture(scope="module")
def server(tiny_qwen_edit_dir, tmp_path_factory):
    with serving(tiny_qwen_edit_dir, tmp_path_factory.mktemp("qwen-edit-server")) as srv:
        yield srv


def test_engine_warms_up_with_a_probe_image(server) -> None:
    info = server.info()
    assert info["engine"]["family"] == "qwen-image-edit" and info["engine"]["requires_input_image"] is True
    assert "Warm-up generation done" in server.log()
    r = httpx.get(f"{server.base_url}/health_generate", timeout=300)
    assert r.status_code == 200, r.text


def test_sdk_edit_keeps_the_input_aspect_ratio(server, client, tiny_qwen_edit_dir) -> None:
    response = client.images.edit(
        model=tiny_qwen_edit_dir.name,
        image=("in.png", input_png(), "image/png"),
        prompt="make it blue",
        response_format="b64_json",
        extra_body={"seed": 5, **FAST},
    )
    assert len(response.data) == 1
    pixels = b64_pixels(response.data[0].b64_json)
    height, width = pixels.shape[:2]
    assert abs(width / height - INPUT_SIZE[0] / INPUT_SIZE[1]) < 0.05, (width, height)
    assert response.size == f"{width}x{height}" and response.model_extra["seed"] == 5


def test_sdk_edit_n2_with_size_matches_the_python_api(server, client, tiny_qwen_edit_dir, tmp_path) -> None:
    from diffserve.api import DiffGenerator

    response = client.images.edit(
        image=("in.png", input_png(), "image/png"),
        prompt="make it blue",
        n=2,
        size="64x32",
        response_format="b64_json",
        extra_body={"seed": 9, **FAST},
    )
    pixels = [b64_pixels(d.b64_json) for d in response.data]
    assert [p.shape for p in pixels] == [(32, 64, 3)] * 2
    assert pixels[0].std() > 0 and not np.array_equal(pixels[0], pixels[1])

    # The same seed through the in-process API (image given as a path) gives the same pixels.
    path = tmp_path / "in.png"
    path.write_bytes(input_png())
    offline = DiffGenerator.from_pretrained(tiny_qwen_edit_dir, show_progress=False)
    out = offline.generate(
        "make it blue", image=path, width=64, height=32, seed=9, num_outputs_per_prompt=2, **FAST
    )
    # Equal up to float reduction order (the server's engine runs with one torch thread, this process not).
    for got, image in zip(pixels, out.images, strict=True):
        diff = np.abs(got.astype(np.int16) - np.asarray(image.convert("RGB"), dtype=np.int16))
        assert diff.max() <= 2 and diff.mean() < 0.01, (diff.max(), diff.mean())


def test_json_body_and_url_response(server) -> None:
    url = "data:image/png;base64," + base64.b64encode(input_png(seed=1)).decode()
    for images in ({"image": url}, {"images": [{"image_url": url}]}):
        r = httpx.post(
            f"{server.base_url}/v1/images/edits",
            timeout=300,
            json={
                "prompt": "add a hat",
                "size": "32x32",
                "response_format": "url",
                "output_format": "webp",
                **FAST,
                **images,
            },
        )
        assert r.status_code == 200, r.text
        content = httpx.get(r.json()["data"][0]["url"], timeout=30)
        assert content.status_code == 200 and content.headers["content-type"] == "image/webp"
        assert Image.open(io.BytesIO(content.content)).size == (32, 32)


def test_mask_and_second_image_are_refused(server, client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(
            image=("in.png", input_png(), "image/png"),
            mask=("m.png", input_png(), "image/png"),
            prompt="p",
            extra_body=FAST,
        )
    assert info.value.body["param"] == "mask" and "mask" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(
            image=[("a.png", input_png(), "image/png"), ("b.png", input_png(), "image/png")],
            prompt="p",
            extra_body=FAST,
        )
    assert info.value.body["param"] == "image" and "at most 1 input image" in info.value.body["message"]
    # Still serving.
    ok = client.images.edit(
        image=("in.png", input_png(), "image/png"), prompt="p", size="32x32", extra_body=FAST
    )
    assert b64_pixels(ok.data[0].b64_json).shape == (32, 32, 3)


def test_cli_generate_with_image(tiny_qwen_edit_dir, tmp_path) -> None:
    out_dir = cli_generate_with_image(
        tiny_qwen_edit_dir, tmp_path, input_png(), "make it blue", (64, 32), "edited.png"
    )
    with Image.open(out_dir / "edited.png") as image:
        assert image.size == (64, 32) and np.asarray(image).std() > 0
