"""`POST /v1/images/edits` on Qwen-Image-Layered: a tiny layered checkpoint served by a real `diffserve
serve` (its warm-up included), driven by the official `openai` SDK. A decomposition answers one RGBA PNG
per layer, output after output; the layered settings travel in `extra`, and bad ones are 400s naming
`extra`. Also `diffserve generate --image`, which writes one PNG per layer (the default 4: the CLI has no
flag for `extra`)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import openai
import pytest
from edit_inputs import cli_generate_with_image, random_png
from PIL import Image
from server_process import serving

#: Few steps, no true CFG: fast.
FAST = {"num_inference_steps": 2, "true_cfg_scale": 1.0}


def input_png(size: tuple[int, int] = (48, 32), seed: int = 0) -> bytes:
    return random_png(size, seed)


def rgba(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


@pytest.fixture(scope="module")
def tiny_layered_dir(tmp_path_factory) -> Path:
    from diffserve.families.qwen_image.tiny import build_tiny_qwen_image_layered

    return Path(build_tiny_qwen_image_layered(tmp_path_factory.mktemp("tiny-qwen-layered")))


@pytest.fixture(scope="module")
def server(tiny_layered_dir, tmp_path_factory):
    with serving(tiny_layered_dir, tmp_path_factory.mktemp("qwen-layered-server")) as srv:
        yield srv


def test_engine_is_the_layered_family_and_warmed_up(server) -> None:
    info = server.info()
    assert info["engine"]["family"] == "qwen-image-layered"
    assert info["engine"]["requires_input_image"] is True
    assert "Warm-up generation done" in server.log()


def test_sdk_edit_answers_one_rgba_png_per_layer(server, client) -> None:
    response = client.images.edit(
        image=("in.png", input_png(), "image/png"),
        prompt="a red fox",
        n=2,
        size="48x32",
        response_format="b64_json",
        # A multipart form carries `extra` as JSON text.
        extra_body={"seed": 3, "extra": json.dumps({"layers": 3}), **FAST},
    )
    images = [rgba(d.b64_json) for d in response.data]
    assert len(images) == 2 * 3  # 3 layers for each of the 2 outputs
    assert all(im.format == "PNG" and im.mode == "RGBA" and im.size == (48, 32) for im in images)
    arrays = [np.asarray(im) for im in images]
    assert all(a.std() > 0 for a in arrays) and not np.array_equal(arrays[0], arrays[1])


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"extra": json.dumps({"layers": 0})}, "extra", "extra['layers']"),
        ({"extra": json.dumps({"resolution": 512})}, "extra", "extra['resolution'] must be one of 640, 1024"),
        ({"output_format": "jpeg"}, "output_format", "output_format must be png"),
        ({"guidance_scale": 2.0}, "guidance_scale", "guidance_scale"),
    ],
)
def test_bad_layered_requests_are_400s_naming_the_parameter(server, client, body, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(
            image=("in.png", input_png(), "image/png"),
            prompt="a red fox",
            size="48x32",
            extra_body={**body, **FAST},
        )
    assert info.value.body["param"] == param and message in info.value.body["message"]


def test_a_missing_image_is_a_400(server, client) -> None:
    """The text-to-image route refuses a model that needs an input image."""
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red fox", size="48x32", extra_body=FAST)
    assert "image" in info.value.body["message"]


def test_cli_generate_writes_one_png_per_layer(tiny_layered_dir, tmp_path) -> None:
    out_dir = cli_generate_with_image(
        tiny_layered_dir, tmp_path, input_png(), "a red fox", (48, 32), "layers.png"
    )
    # The CLI has no flag for `extra`: Diffusers' default of 4 layers.
    names = [f"layers_{i}.png" for i in range(4)]
    assert sorted(p.name for p in out_dir.iterdir()) == names
    for name in names:
        with Image.open(out_dir / name) as image:
            assert image.mode == "RGBA" and image.size == (48, 32) and np.asarray(image).std() > 0
