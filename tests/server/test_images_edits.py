"""`POST /v1/images/edits` against the tiny FLUX checkpoint, which takes one input image (image-to-image,
and inpainting with a mask): every way a request can be wrong gets OpenAI's error shape with the right
status and field, the front end parses exactly what the `openai` SDK sends, and the server keeps serving
afterwards. Parsing and limits are also checked without a server. The success path on an edit model is in
test_images_edits_qwen.py, FLUX.1 Fill's with a mask in test_images_edits_mask.py."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from api_checks import assert_error
from PIL import Image
from server_process import serving

from diffserve.configs.engine_args import EngineArgs
from diffserve.errors import InvalidRequestError
from diffserve.image_inputs import ImageInputLimits, ImageTooLargeError, load_images
from diffserve.server.args import MAX_INPUT_IMAGES, ServerArgs
from diffserve.server.errors import ApiError
from diffserve.server.image_edits import EditInputs, from_json
from diffserve.server.schemas import ApiParamError

SIZE = 32
MAX_IMAGE_BYTES = 4000
MAX_IMAGE_PIXELS = 64 * 64
MAX_BODY_BYTES = 65536
API_KEY = "edit-key"
TAKES_ONE = "FluxPipeline takes at most 1 input image(s), got 2"


def png(width: int, height: int, noise: bool = False, seed: int = 0) -> bytes:
    if noise:
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        image = Image.fromarray(pixels)
    else:
        image = Image.new("RGB", (width, height), (200, 40, 40))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# -- without a server -------------------------------------------------------------------------------
def test_edit_body_limit_fits_max_images_as_base64() -> None:
    args = ServerArgs(EngineArgs(model_path="/m"), max_image_bytes=3000, max_body_bytes=1000)
    assert args.max_edit_body_bytes == (MAX_INPUT_IMAGES + 1) * 4000 + 1000
    # Once the model is known: as generations for a model that takes no image, else room for its images.
    assert args.image_body_bytes(0) == 1000 and args.image_body_bytes(2) == 2 * 4000 + 1000
    assert ServerArgs(EngineArgs(model_path="/m")).image_limits == ImageInputLimits(
        max_bytes=20 << 20, max_pixels=4096 * 4096, url_timeout_s=10.0
    )
    fetch_limit = ServerArgs(EngineArgs(model_path="/m"), url_fetch_timeout=2.5).image_limits.url_timeout_s
    assert fetch_limit == 2.5


def test_json_body_forms() -> None:
    one = data_url(png(8, 4))
    inputs = from_json({"prompt": "p", "image": one, "size": "64x32", "n": 2, "seed": 3})
    assert inputs.images == [("image", one)] and inputs.mask is None
    params = inputs.body.to_sampling_params()  # the generations' size and n handling
    assert (params.width, params.height, params.num_outputs_per_prompt, params.seed) == (64, 32, 2, 3)
    assert params.input_images is None  # filled by the route once decoded
    unsized = from_json({"prompt": "p", "image": one}).body.to_sampling_params()
    assert unsized.width is None and unsized.height is None  # the engine's family decides

    two = from_json({"prompt": "p", "image": [one, one], "mask": one})
    assert [name for name, _ in two.images] == ["image[0]", "image[1]"] and two.mask == ("mask", one)
    refs = from_json({"prompt": "p", "images": [{"image_url": one}], "mask": {"image_url": one}})
    assert refs.images == [("images", one)] and refs.mask == ("mask", one)


@pytest.mark.parametrize(
    ("body", "exc", "message", "param"),
    [
        ({"prompt": "p"}, ApiParamError, "image is required", "image"),
        ({"prompt": "p", "image": []}, ApiParamError, "image is required", "image"),
        ({"image": "data:,"}, ApiError, "prompt is required", "prompt"),
        (
            {"prompt": "p", "image": "data:,", "colour": "red"},
            ApiError,
            "unknown field 'colour'; accepted fields: prompt, model, n, size",
            "colour",
        ),
        (
            {"prompt": "p", "image": "/etc/passwd"},
            ApiParamError,
            "the server never reads file paths",
            "image",
        ),
        (
            {"prompt": "p", "image": "data:,", "mask": "secret.png"},
            ApiParamError,
            "never reads file paths",
            "mask",
        ),
        (
            {"prompt": "p", "image": "data:,", "images": [{"image_url": "data:,"}]},
            ApiParamError,
            "either 'image' or 'images'",
            "images",
        ),
        (
            {"prompt": "p", "images": [{"file_id": "file-1"}]},
            ApiParamError,
            "file_id is not supported",
            "images[0]",
        ),
        (
            {"prompt": "p", "image": ["data:,"] * (MAX_INPUT_IMAGES + 1)},
            ApiParamError,
            f"at most {MAX_INPUT_IMAGES} input images",
            "image",
        ),
        (
            {"prompt": "p", "image": "data:,", "n": 11},
            ApiError,
            "n: Input should be less than or equal to 10",
            "n",
        ),
        ([1, 2], ApiError, "request body must be a JSON object", None),
    ],
)
def test_json_body_errors(body, exc, message, param) -> None:
    with pytest.raises(exc, match=message.replace("[", r"\[").replace("(", r"\(")) as info:
        from_json(body)
    assert (info.value.param if isinstance(info.value, ApiError) else info.value.param) == param


def test_unknown_fields_message_lists_the_edit_fields() -> None:
    with pytest.raises(ApiError) as info:
        from_json({"prompt": "p", "image": "data:,", "input_fidelity": "high"})
    assert "accepted fields:" in info.value.message and "image, images, mask" in info.value.message


def test_loading_applies_the_limits() -> None:
    def load(inputs: EditInputs):
        return asyncio.run(inputs.decode(allow_urls=False, limits=limits))

    limits = ImageInputLimits(max_bytes=MAX_IMAGE_BYTES, max_pixels=MAX_IMAGE_PIXELS)
    ok = EditInputs(from_json({"prompt": "p", "image": data_url(png(48, 16))}).body, [("image", png(48, 16))])
    images, mask = load(ok)
    assert [im.size for im in images] == [(48, 16)] and images[0].mode == "RGB" and mask is None
    too_many_bytes = EditInputs(ok.body, [("image[1]", png(64, 64, noise=True))])
    with pytest.raises(ImageTooLargeError, match="over the limit of 3.9 KiB") as info:
        load(too_many_bytes)
    assert info.value.param == "image[1]"
    with pytest.raises(ImageTooLargeError, match="over the limit of 4096 pixels"):
        load(EditInputs(ok.body, [("image", png(65, 64))]))
    with pytest.raises(InvalidRequestError, match="--allow-url-images") as info:
        load(EditInputs(ok.body, [("image", "https://example.com/a.png")]))
    assert not isinstance(info.value, ImageTooLargeError)


def test_load_images_helper(tmp_path) -> None:
    path = tmp_path / "in.png"
    path.write_bytes(png(10, 6))
    rgba = Image.new("RGBA", (5, 7))
    images = load_images([path, str(path), png(3, 2), data_url(png(4, 4)), rgba])
    assert [im.size for im in images] == [(10, 6), (10, 6), (3, 2), (4, 4), (5, 7)]
    assert all(im.mode == "RGB" for im in images)
    assert load_images(rgba)[0].mode == "RGB"
    with pytest.raises(InvalidRequestError) as info:
        load_images([png(2, 2), b"not an image"], param="image")
    assert info.value.param == "image[1]"
    with pytest.raises(InvalidRequestError, match="URLs are disabled"):
        load_images("https://example.com/a.png")


# -- against a server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_flux_dir, tmp_path_factory):
    with serving(
        tiny_flux_dir,
        tmp_path_factory.mktemp("edits-server"),
        "--max-image-bytes",
        str(MAX_IMAGE_BYTES),
        "--max-image-pixels",
        str(MAX_IMAGE_PIXELS),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        api_key=API_KEY,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


def edit(server, *, files=None, data=None, json_body=None, headers=None) -> httpx.Response:
    url = f"{server.base_url}/v1/images/edits"
    hdrs = {**server.headers, **(headers or {})}
    if json_body is not None:
        return httpx.post(url, json=json_body, headers=hdrs, timeout=60)
    return httpx.post(url, files=files, data=data, headers=hdrs, timeout=60)


FIELDS = {"prompt": "make it blue", "num_inference_steps": "1"}


def test_sdk_edit_on_flux_is_image_to_image(server, client, tiny_flux_dir) -> None:
    response = client.images.edit(
        model=Path(tiny_flux_dir).name,
        image=("in.png", png(48, 16), "image/png"),
        prompt="make it blue",
        n=2,
        size="32x16",
        response_format="b64_json",
        extra_body={"seed": 3, "num_inference_steps": 2, "guidance_scale": 2.0, "strength": 0.5},
    )
    pixels = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in response.data]
    assert [p.shape for p in pixels] == [(16, 32, 3)] * 2

    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(
            image=("in.png", png(48, 16), "image/png"),
            prompt="p",
            extra_body={"num_inference_steps": 1, "strength": 1.5},
        )
    assert info.value.body["param"] == "strength", info.value.body

    with pytest.raises(openai.BadRequestError, match="takes at most 1 input image"):  # 'image[]' parts
        client.images.edit(
            image=[("a.png", png(16, 16), "image/png"), ("b.png", png(16, 16), "image/png")],
            prompt="merge them",
            extra_body={"num_inference_steps": 1},
        )


def test_mask_errors_name_the_mask(server, client) -> None:
    # FLUX inpaints: a mask of another size than the image, or one that is not an image, is named.
    with pytest.raises(openai.BadRequestError, match="mask is 16x16 but the image is 48x16") as info:
        client.images.edit(
            image=("in.png", png(48, 16), "image/png"),
            mask=("m.png", png(16, 16), "image/png"),
            prompt="p",
            extra_body={"num_inference_steps": 1},
        )
    assert info.value.body["param"] == "mask"
    r = edit(
        server, files=[("image", ("in.png", png(16, 16))), ("mask", ("m.png", b"\x00garbage"))], data=FIELDS
    )
    assert_error(r, 400, "mask: data is not a recognised image", "mask")
    r = edit(
        server,
        files=[
            ("image", ("in.png", png(16, 16))),
            ("mask", ("a.png", png(4, 4))),
            ("mask", ("b.png", png(4, 4))),
        ],
        data=FIELDS,
    )
    assert_error(r, 400, "mask is given more than once", "mask")


def test_images_are_refused_for_the_model_before_decoding(server, client) -> None:
    """Junk, oversized or URL images beyond the one FLUX takes meet the model's refusal first: nothing
    is decoded or fetched (what decoding refuses: test_edit_inputs_bounded.py)."""
    junk = np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes()
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(image=[("a.png", junk, "image/png"), ("b.png", junk, "image/png")], prompt="p")
    assert info.value.body["param"] == "image" and TAKES_ONE in info.value.body["message"]
    big, wide = ("big.png", png(64, 64, noise=True)), ("wide.png", png(128, 64))
    assert_error(
        edit(server, files=[("image[]", big), ("image[]", wide)], data=FIELDS), 400, TAKES_ONE, "image"
    )
    for image in ("data:image/png;base64,@@@", "https://example.com/cat.png"):
        r = edit(server, json_body={"prompt": "p", "image": [image, image]})
        assert_error(r, 400, TAKES_ONE, "image")
    # One image is decoded, and refused when it is not an image.
    with pytest.raises(openai.BadRequestError, match="not a recognised image"):
        client.images.edit(image=("in.png", junk, "image/png"), prompt="p")


def test_edit_body_limit_follows_the_model(server) -> None:
    # FLUX takes one input image: the edits body is held to --max-body-bytes plus one base64 image.
    limit = ServerArgs(
        EngineArgs(model_path="/m"), max_image_bytes=MAX_IMAGE_BYTES, max_body_bytes=MAX_BODY_BYTES
    ).image_body_bytes(1)
    long_prompt = {**FIELDS, "prompt": "blue " * 20_000}
    r = edit(server, files={"image": ("in.png", png(16, 16))}, data=long_prompt)
    error = assert_error(r, 413, f"limit of {limit} bytes for /v1/images/edits: FluxPipeline")
    assert (
        error["code"] == "request_too_large"
        and "(--max-image-bytes and --max-body-bytes)" in error["message"]
    )
    # The generic limit holds on the other routes.
    r = httpx.post(
        f"{server.base_url}/v1/images/generations",
        json={"prompt": "x" * 70_000},
        headers=server.headers,
        timeout=30,
    )
    assert_error(r, 413, "limit of 65536 bytes (--max-body-bytes)")


def test_unknown_file_parts_are_named(server) -> None:
    r = edit(server, files={"x": ("x", b"")}, data={**FIELDS, "image": "https://example.com/cat.png"})
    assert_error(r, 400, "unknown field 'x'", "x")


def test_field_errors(server) -> None:
    img = {"image": ("in.png", png(16, 16))}
    r = edit(server, files=img, data={**FIELDS, "colour": "red", "input_fidelity": "high"})
    assert_error(r, 400, "unknown fields 'colour', 'input_fidelity'; accepted fields: prompt", "colour")
    assert_error(edit(server, data=FIELDS), 400, "image is required", "image")
    assert_error(
        edit(server, files=img, data={"num_inference_steps": "1"}), 400, "prompt is required", "prompt"
    )
    assert_error(
        edit(server, files=img, data={**FIELDS, "size": "big"}), 400, "size must be 'WIDTHxHEIGHT'", "size"
    )
    assert_error(edit(server, files=img, data={**FIELDS, "n": "11"}), 400, "less than or equal to 10", "n")
    # `quality` is the engine's to check: FLUX takes the image, and the engine names the field.
    assert_error(
        edit(server, files=img, data={**FIELDS, "quality": "ultra"}), 400, "quality must be", "quality"
    )
    assert_error(
        edit(server, files=img, data={**FIELDS, "model": "dall-e-2"}),
        404,
        "'dall-e-2' is not served",
        "model",
    )
    r = edit(server, files={**img, "prompt": ("p.txt", b"a file")}, data={"num_inference_steps": "1"})
    assert_error(r, 400, "prompt must be a text field, not a file", "prompt")
    r = edit(server, files=[("image", ("in.png", png(16, 16)))], data={**FIELDS, "seed": ["1", "2"]})
    assert_error(r, 400, "seed is given more than once", "seed")
    r = httpx.post(
        f"{server.base_url}/v1/images/edits",
        content=b"<xml/>",
        headers={**server.headers, "Content-Type": "text/xml"},
    )
    assert_error(r, 415, "Content-Type 'text/xml' is not supported")
    r = httpx.post(
        f"{server.base_url}/v1/images/edits",
        content=b"{oops",
        headers={**server.headers, "Content-Type": "application/json"},
    )
    assert_error(r, 400, "request body is not valid JSON", None)
    assert_error(
        httpx.post(f"{server.base_url}/v1/images/edits", files=img, data=FIELDS), 401, "missing API key"
    )


def test_json_bodies_reach_the_engine(server) -> None:
    """Both JSON forms parse and run (the output keeps the input's size); two images are refused."""
    url = data_url(png(16, 16))
    for body in ({"image": url, "strength": 0.7}, {"images": [{"image_url": url}], "mask": url}):
        r = edit(server, json_body={"prompt": "p", "num_inference_steps": 1, **body})
        assert r.status_code == 200 and r.json()["size"] == "16x16", r.text
    r = edit(server, json_body={"prompt": "p", "num_inference_steps": 1, "image": [url, url]})
    assert_error(r, 400, TAKES_ONE, "image")
    r = edit(server, json_body={"prompt": "p", "image": url, "size": "40"})
    assert_error(r, 400, "size must be 'WIDTHxHEIGHT'", "size")


def test_server_keeps_serving(server, client) -> None:
    response = client.images.generate(
        prompt="a fox", size=f"{SIZE}x{SIZE}", extra_body={"num_inference_steps": 1}
    )
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))))
    assert pixels.shape == (SIZE, SIZE, 3)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    info = httpx.get(f"{server.base_url}/server_info", headers=server.headers).json()
    assert info["engine"]["requires_input_image"] is False and info["engine"]["restarts"] == 0
    assert info["server_args"]["allow_url_images"] is False
    assert info["server_args"]["max_image_bytes"] == MAX_IMAGE_BYTES
    metrics = httpx.get(f"{server.base_url}/metrics").text
    lines = [line for line in metrics.splitlines() if line.startswith("diffserve_http_requests_total{")]
    assert any('route="/v1/images/edits"' in line and 'status="413"' in line for line in lines)
    assert "Traceback" not in server.log()
    # The docs describe both body forms.
    schema = httpx.get(f"{server.base_url}/openapi.json", headers=server.headers).json()
    content = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]
    assert {"multipart/form-data", "application/json"} <= set(content)
    assert "$ref" not in json.dumps(content["application/json"])


# -- the Python API and the CLI (same loading, no server) -------------------------------------------
def test_api_generate_takes_image_and_mask(tiny_flux_dir, tmp_path) -> None:
    from diffserve.api import DiffGenerator
    from diffserve.errors import UserError

    generator = DiffGenerator.from_pretrained(tiny_flux_dir, show_progress=False)
    path = tmp_path / "in.png"
    path.write_bytes(png(16, 16))
    for image in (path, str(path), png(16, 16), Image.new("RGBA", (16, 16)), data_url(png(16, 16))):
        assert generator.generate("p", image=image, num_inference_steps=1).images[0].size == (16, 16)
    with pytest.raises(InvalidRequestError, match=re.escape(TAKES_ONE)) as info:
        generator.generate("p", image=[path, path], num_inference_steps=1)
    assert info.value.param == "image"
    with pytest.raises(InvalidRequestError, match="mask is 8x8 but the image is 16x16") as info:
        generator.generate("p", image=path, mask=Image.new("L", (8, 8)), num_inference_steps=1)
    assert info.value.param == "mask"
    with pytest.raises(InvalidRequestError, match="URLs are disabled"):
        generator.generate("p", image="https://example.com/a.png")
    with pytest.raises(InvalidRequestError, match="is not an existing file") as info:
        generator.generate("p", mask=tmp_path / "missing.png")
    assert info.value.param == "mask"
    with pytest.raises(UserError, match="pass one mask image"):
        generator.generate("p", mask=[path, path])
    with pytest.raises(UserError, match="either image= or input_images="):
        generator.generate("p", image=path, input_images=[])
    # Without images nothing changes.
    assert generator.generate("p", height=16, width=16, num_inference_steps=1).images[0].size == (16, 16)


def test_cli_generate_image_flags(tiny_flux_dir, tmp_path, capsys) -> None:
    from diffserve.cli.main import main

    path = tmp_path / "in.png"
    path.write_bytes(png(16, 16))
    base = [
        "generate",
        "--model-path",
        str(tiny_flux_dir),
        "--prompt",
        "p",
        "--num-inference-steps",
        "1",
        "--output-path",
        str(tmp_path / "out"),
        "--log-level",
        "warning",
    ]
    assert main([*base, "--image", str(tmp_path / "missing.png")]) == 2
    assert "error: --image: " in capsys.readouterr().err
    (tmp_path / "bad.png").write_bytes(b"junk")
    assert main([*base, "--image", str(path), "--mask", str(tmp_path / "bad.png")]) == 2
    assert "--mask: data is not a recognised image" in capsys.readouterr().err
    assert main([*base, "--image", str(path), "--image", str(path)]) == 2
    assert TAKES_ONE in capsys.readouterr().err
    assert main([*base, "--image", str(path), "--strength", "1.5"]) == 2
    assert "strength must be a number in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- the engine's probe on an edit model (warm-up, /health_generate) --------------------------------
def test_engine_probes_edit_models_with_an_input_image(tmp_path) -> None:
    from types import SimpleNamespace

    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.server.engine_process import EngineProcess, EngineProcessConfig
    from diffserve.server.protocol import GenerateJob, JobRejected
    from diffserve.testing.fake_pipeline import FakeFamily, FakeGenerator, FakePipeline, image_facts

    sent: list = []
    pipeline = FakePipeline(image_facts("EditPipeline", min_input_images=1, max_input_images=1))
    generator = FakeGenerator(pipeline, FakeFamily("edit", "E", "image-edit"))
    config = EngineProcessConfig(EngineArgs(model_path="/m", output_path=str(tmp_path)), "", "", 1)
    engine = EngineProcess(config, SimpleNamespace(send=sent.append), generator=generator)
    probe = engine.probe_params("warm-up")
    assert [im.size for im in probe.input_images] == [(engine.probe_size, engine.probe_size)]
    info = engine.info(None)
    assert info["requires_input_image"] is True and info["default_params"]["height"] is None
    assert "input_images" not in info["default_params"]
    engine._handle(
        GenerateJob("a" * 32, SamplingParams(prompt="health", num_inference_steps=1), internal=True)
    )
    assert engine.scheduler.num_waiting == 1 and not sent  # /health_generate got the probe image
    engine._handle(GenerateJob("b" * 32, SamplingParams(prompt="user", num_inference_steps=1)))
    assert isinstance(sent[0], JobRejected) and sent[0].param == "image"  # users' requests do not
