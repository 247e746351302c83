"""ControlNets through the HTTP server: one `diffserve serve` on a tiny FLUX folder with `--controlnet
canny=PATH`. A request's `controlnets` (the control image as a data URL, or plain base64) gives the image
the Python API gives for the same entry; an unknown name, a bad image or mask, a mode on a non-Union ControlNet
and a mask on a non-inpainting one are 400s naming `controlnets`. In-process: the field's schema, and a mask
decoded in either convention (white or transparent = repaint) as an "L" image."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image
from server_process import serving

from diffserve import DiffGenerator
from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.errors import InvalidRequestError
from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.families.flux.tiny_controlnet import TinyFluxControlNetSpec, build_tiny_flux_controlnet
from diffserve.image_inputs import ImageInputLimits
from diffserve.server.controlnet_schema import decode_controlnets
from diffserve.server.schemas import ImageGenerationRequest
from diffserve.testing.parity import smooth_random_image

BASE = {
    "prompt": "a red fox",
    "size": "48x32",
    "num_inference_steps": 2,
    "seed": 7,
    "max_sequence_length": 16,
}
CONTROL = smooth_random_image(48, 32, seed=5)
#: The area to repaint, white on black (Diffusers' convention) and as OpenAI's masks mark it (alpha 0).
REPAINT = np.zeros((32, 48), dtype=bool)
REPAINT[8:24, 12:36] = True
WHITE_MASK = Image.fromarray(np.where(REPAINT, 255, 0).astype(np.uint8), mode="L")
ALPHA_MASK = Image.fromarray(
    np.dstack([np.full((32, 48, 3), 90, np.uint8), np.where(REPAINT, 0, 255).astype(np.uint8)]), mode="RGBA"
)


def png_b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("controlnet-server")
    flux = TinyFluxSpec(seed=0)
    return build_tiny_flux(root / "flux", flux), build_tiny_flux_controlnet(
        root / "canny", TinyFluxControlNetSpec(flux, seed=1)
    )


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    folder, canny = folders
    with serving(folder, tmp_path_factory.mktemp("server"), "--controlnet", f"canny={canny}") as srv:
        yield srv


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/images/generations", json=body, timeout=120)


def test_a_request_with_a_controlnet_gets_the_python_apis_image(server, folders) -> None:
    folder, canny = folders
    entry = {"name": "canny", "image": f"data:image/png;base64,{png_b64(CONTROL)}", "scale": 0.8}
    response = post(server, {**BASE, "controlnets": [entry]})
    assert response.status_code == 200, response.text
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))))
    plain = post(server, {**BASE, "controlnets": [{**entry, "image": png_b64(CONTROL)}]})  # plain base64
    assert plain.status_code == 200, plain.text
    assert plain.json()["data"][0]["b64_json"] == response.json()["data"][0]["b64_json"]
    ours = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, controlnets={"canny": canny}
    )
    kw = dict(height=32, width=48, num_inference_steps=2, seed=7, max_sequence_length=16)
    choice = ControlNetChoice("canny", CONTROL, 0.8)
    want = np.asarray(ours.generate("a red fox", controlnets=[choice], **kw).images[0])
    assert np.abs(served.astype(int) - want.astype(int)).max() <= 1
    uncontrolled = np.asarray(ours.generate("a red fox", **kw).images[0])
    assert np.abs(served.astype(int) - uncontrolled.astype(int)).max() > 8


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "nope", "image": png_b64(CONTROL)}, "is not a ControlNet"),
        ({"name": "canny", "image": "not base64!"}, "controlnets[0].image"),
        ({"name": "canny", "image": png_b64(CONTROL), "mode": 1}, "not a Union ControlNet"),
        ({"name": "canny", "image": png_b64(CONTROL), "mask": "not base64!"}, "controlnets[0].mask"),
        (
            {"name": "canny", "image": png_b64(CONTROL), "mask": png_b64(WHITE_MASK)},
            "controlnets[0].mask (control_mask): 'canny' is not an inpainting ControlNet",
        ),
    ],
)
def test_bad_entries_are_400s_naming_the_field(server, entry, message) -> None:
    response = post(server, {**BASE, "controlnets": [entry]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"].startswith("controlnets"), error


def test_the_field_decodes_base64_and_data_urls() -> None:
    body = ImageGenerationRequest.model_validate(
        {"prompt": "x", "controlnets": json.dumps([{"name": "a", "image": png_b64(CONTROL), "start": 0.2}])}
    )
    (choice,) = decode_controlnets(body.controlnets, allow_urls=False, limits=ImageInputLimits())
    assert (choice.name, choice.start, choice.image.size) == ("a", 0.2, (48, 32))
    with pytest.raises(ValueError):
        ImageGenerationRequest.model_validate(
            {"prompt": "x", "controlnets": [{"name": "a", "image": "x", "bad": 1}]}
        )


def test_server_info_says_whether_a_controlnet_takes_a_mask(server) -> None:
    info = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
    assert info["engine"]["controlnets"] == [{"name": "canny", "modes": None, "inpainting": False}]


@pytest.mark.parametrize("mask", [WHITE_MASK, ALPHA_MASK], ids=["white", "transparent"])
def test_a_mask_is_decoded_in_either_convention(mask) -> None:
    entry = {"name": "a", "image": png_b64(CONTROL), "mask": f"data:image/png;base64,{png_b64(mask)}"}
    body = ImageGenerationRequest.model_validate({"prompt": "x", "controlnets": json.dumps([entry])})
    (choice,) = decode_controlnets(body.controlnets, allow_urls=False, limits=ImageInputLimits())
    assert choice.mask.mode == "L" and choice.mask.size == (48, 32)
    assert np.array_equal(np.asarray(choice.mask), np.where(REPAINT, 255, 0))
    plain = ImageGenerationRequest.model_validate(
        {"prompt": "x", "controlnets": [{**entry, "mask": png_b64(mask)}]}
    )
    (again,) = decode_controlnets(plain.controlnets, allow_urls=False, limits=ImageInputLimits())
    assert np.array_equal(np.asarray(again.mask), np.asarray(choice.mask))  # plain base64 too


@pytest.mark.parametrize(
    "mask",
    [
        base64.b64encode(b"not an image").decode(),
        "data:image/png;base64,bm90IGFuIGltYWdl",
        "https://example.com/mask.png",  # URLs need --allow-url-images
    ],
)
def test_a_bad_mask_names_its_entry(mask) -> None:
    entries = [
        {"name": "a", "image": png_b64(CONTROL)},
        {"name": "b", "image": png_b64(CONTROL), "mask": mask},
    ]
    body = ImageGenerationRequest.model_validate({"prompt": "x", "controlnets": entries})
    with pytest.raises(InvalidRequestError) as caught:
        decode_controlnets(body.controlnets, allow_urls=False, limits=ImageInputLimits())
    assert caught.value.param == "controlnets[1].mask" and "controlnets[1].mask" in str(caught.value)


def test_a_mask_is_held_to_the_image_limits() -> None:
    entry = {"name": "a", "image": png_b64(Image.new("RGB", (4, 4))), "mask": png_b64(WHITE_MASK)}
    body = ImageGenerationRequest.model_validate({"prompt": "x", "controlnets": [entry]})
    with pytest.raises(InvalidRequestError) as caught:  # the 4x4 image passes, the 48x32 mask does not
        decode_controlnets(body.controlnets, allow_urls=False, limits=ImageInputLimits(max_pixels=16))
    assert caught.value.param == "controlnets[0].mask"
