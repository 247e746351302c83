"""`diffserve serve` on each native image family other than FLUX (FLUX: test_server.py), driven by the
official `openai` SDK: the served image equals the in-process API's for the same seed, and a sampling
parameter the family does not have is a 400 that names it."""

from __future__ import annotations

import base64
import importlib
import importlib.util
import io
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from server_process import start_server

from diffserve import DiffGenerator
from diffserve.testing.image_metrics import psnr_uint8 as psnr

#: family -> (builder, request extras with CFG on, a parameter the family refuses)
FAMILIES = {
    "sd3": ("diffserve.families.sd3.tiny:build_tiny_sd3", {"guidance_scale": 5.0}, "true_cfg_scale"),
    "qwen-image": (
        "diffserve.families.qwen_image.tiny:build_tiny_qwen_image",
        {"true_cfg_scale": 4.0, "negative_prompt": "blurry"},
        "guidance_scale",
    ),
    "z-image": (
        "diffserve.families.z_image.tiny:build_tiny_zimage",
        {"guidance_scale": 3.0},
        "true_cfg_scale",
    ),
    "chroma": (
        "diffserve.families.chroma.tiny:build_tiny_chroma",
        {"guidance_scale": 4.0, "negative_prompt": "blurry"},
        "true_cfg_scale",
    ),
    "longcat-image": (
        "diffserve.families.longcat_image.tiny:build_tiny_longcat_image",
        {"guidance_scale": 4.5, "negative_prompt": "blurry"},
        "true_cfg_scale",
    ),
    # RGBA output (its VAE's four channels), served as PNG with alpha.
    "qwen-image-2.1": (
        "diffserve.families.qwen_image21.tiny:build_tiny_qwen_image21",
        {"true_cfg_scale": 3.0, "negative_prompt": "blurry"},
        "guidance_scale",
    ),
}
WIDTH, HEIGHT = 48, 32
#: family -> (width, height) where the family's pixel multiple is not 16 (Qwen-Image 2.1: 32).
SIZES = {"qwen-image-2.1": (64, 32)}


def _build(target: str, out_dir: Path) -> Path:
    module_name, function = target.split(":")
    return Path(getattr(importlib.import_module(module_name), function)(out_dir))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    builder, extras, refused = FAMILIES[family]
    model_dir = _build(builder, tmp_path_factory.mktemp(family))
    srv = start_server(model_dir, tmp_path_factory.mktemp(f"{family}-server"), "--no-warmup")
    try:
        srv.wait_ready()
        yield family, model_dir, srv, extras, refused
    finally:
        srv.process.terminate()
        srv.process.wait(30)


def test_generation_with_the_openai_sdk_matches_the_python_api(served) -> None:
    family, model_dir, srv, extras, _ = served
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused")
    body = {"seed": 11, "num_inference_steps": 2, **extras}
    width, height = SIZES.get(family, (WIDTH, HEIGHT))
    result = client.images.generate(
        model=str(model_dir),
        prompt="a red fox",
        size=f"{width}x{height}",
        response_format="b64_json",
        extra_body=body,
    )
    with Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))) as image:
        served_pixels = np.asarray(image.convert("RGB"))
    assert served_pixels.shape == (height, width, 3)
    local = DiffGenerator.from_pretrained(model_dir, device="cpu", show_progress=False).generate(
        prompt="a red fox", height=height, width=width, **body
    )
    value = psnr(served_pixels, np.asarray(local.images[0].convert("RGB")))
    print(f"{family}: served vs in-process PSNR {value:.2f} dB")
    assert value >= 40.0


def test_a_parameter_the_family_lacks_is_a_400_naming_it(served) -> None:
    family, model_dir, srv, _, refused = served
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(
            model=str(model_dir),
            prompt="a fox",
            size="32x32",
            extra_body={refused: 3.0, "num_inference_steps": 1},
        )
    assert refused in str(info.value)
    assert info.value.body["param"] == refused
