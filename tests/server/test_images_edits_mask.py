"""`POST /v1/images/edits` with a mask: a tiny FLUX.1 Fill checkpoint served by a real `diffserve serve`,
driven by the official `openai` SDK (`client.images.edit(image=..., mask=...)`, OpenAI's mask: transparent
pixels mark the area to edit) and raw JSON (a black/white mask, white = edit). The server's pixels equal
the in-process API's (`DiffGenerator.generate(image=..., mask=...)`) for the same seed. Mask and strength
errors without a model: tests/unit/test_masks.py."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from api_checks import b64_pixels
from PIL import Image
from server_process import serving

WIDTH, HEIGHT = 48, 32
FAST = {"num_inference_steps": 2, "guidance_scale": 30.0}
BOX = (8, 8, 32, 24)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def input_image(seed: int = 0) -> Image.Image:
    coarse = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((WIDTH, HEIGHT), Image.Resampling.BICUBIC)


def alpha_mask() -> Image.Image:
    """OpenAI's convention: opaque everywhere except the transparent box to fill."""
    mask = Image.new("RGBA", (WIDTH, HEIGHT), (255, 255, 255, 255))
    mask.paste((0, 0, 0, 0), BOX)
    return mask


def white_mask() -> Image.Image:
    """Diffusers' convention, the same area: white = fill."""
    mask = Image.new("L", (WIDTH, HEIGHT), 0)
    mask.paste(255, BOX)
    return mask


def assert_same_pixels(served: list[np.ndarray], offline: list[Image.Image]) -> None:
    """Equal up to float reduction order (the server's engine runs with one torch thread, this process not)."""
    assert len(served) == len(offline)
    for got, image in zip(served, offline, strict=True):
        diff = np.abs(got.astype(np.int16) - np.asarray(image.convert("RGB"), dtype=np.int16))
        print(f"served vs DiffGenerator: max diff {diff.max()}, mean {diff.mean():.4f}")
        assert got.std() > 5 and diff.max() <= 2 and diff.mean() < 0.01, (diff.max(), diff.mean())


@pytest.fixture(scope="module")
def tiny_flux_fill_dir(tmp_path_factory) -> Path:
    from diffserve.families.flux.tiny_fill import build_tiny_flux_fill

    return Path(build_tiny_flux_fill(tmp_path_factory.mktemp("tiny-flux-fill")))


@pytest.fixture(scope="module")
def server(tiny_flux_fill_dir, tmp_path_factory):
    with serving(tiny_flux_fill_dir, tmp_path_factory.mktemp("flux-fill-server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_flux_fill_dir):
    from diffserve.api import DiffGenerator

    return DiffGenerator.from_pretrained(tiny_flux_fill_dir, show_progress=False)


def test_engine_reports_fill_and_warms_up_with_a_mask(server) -> None:
    info = server.info()
    assert info["engine"]["family"] == "flux-fill" and info["engine"]["requires_input_image"] is True
    assert info["engine"]["inpainting"] is True  # the web playground shows its mask brush from this
    assert "Warm-up generation done" in server.log()
    assert httpx.get(f"{server.base_url}/health_generate", timeout=300).status_code == 200


def test_sdk_edit_with_an_alpha_mask_matches_the_python_api(server, client, offline) -> None:
    response = client.images.edit(
        image=("in.png", png_bytes(input_image()), "image/png"),
        mask=("mask.png", png_bytes(alpha_mask()), "image/png"),
        prompt="a red ball",
        n=2,
        response_format="b64_json",
        extra_body={"seed": 9, **FAST},
    )
    served = [b64_pixels(d.b64_json) for d in response.data]
    assert [p.shape for p in served] == [(HEIGHT, WIDTH, 3)] * 2  # the input's size by default
    out = offline.generate(
        "a red ball", image=input_image(), mask=alpha_mask(), seed=9, num_outputs_per_prompt=2, **FAST
    )
    assert_same_pixels(served, out.images)
    # The same area given as a black/white mask is the same request.
    same = offline.generate(
        "a red ball", image=input_image(), mask=white_mask(), seed=9, num_outputs_per_prompt=2, **FAST
    )
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out.images, same.images, strict=True)
    )


def test_json_body_with_a_black_and_white_mask_and_strength(server, offline) -> None:
    def url(image: Image.Image) -> str:
        return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()

    body = {
        "prompt": "a cat",
        "image": url(input_image(1)),
        "mask": url(white_mask()),
        "seed": 4,
        "strength": 0.5,
    }
    r = httpx.post(f"{server.base_url}/v1/images/edits", json={**body, **FAST}, timeout=300)
    assert r.status_code == 200, r.text
    out = offline.generate("a cat", image=input_image(1), mask=white_mask(), seed=4, strength=0.5, **FAST)
    assert_same_pixels([b64_pixels(r.json()["data"][0]["b64_json"])], out.images)


def test_fill_needs_a_mask_of_the_image_size(server, client) -> None:
    with pytest.raises(openai.BadRequestError, match="FluxFillPipeline needs a mask") as info:
        client.images.edit(image=("in.png", png_bytes(input_image()), "image/png"), prompt="p")
    assert info.value.body["param"] == "mask"
    with pytest.raises(openai.BadRequestError, match="mask is 16x16 but the image is 48x32") as info:
        client.images.edit(
            image=("in.png", png_bytes(input_image()), "image/png"),
            mask=("m.png", png_bytes(Image.new("L", (16, 16))), "image/png"),
            prompt="p",
        )
    assert info.value.body["param"] == "mask"
    r = httpx.post(
        f"{server.base_url}/v1/images/edits",
        files={"image": ("in.png", png_bytes(input_image())), "mask": ("m.png", png_bytes(white_mask()))},
        data={"prompt": "p", "strength": "2"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "strength", r.text
