"""`diffserve.outputs`: one encoder and one metadata record for the CLI/API files and the server's bodies.

The CLI and `DiffGenerator(save_output=True)` write through `write_outputs` -> `save_image`; the server
answers with `encode_image` bytes (b64_json) or writes them with `save_image` (url). These tests pin that
the same image, format and quality give the same bytes on every path, with the same embedded metadata.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffserve.configs.sampling_params import SamplingParams
from diffserve.outputs import (
    CONTENT_TYPES,
    DEFAULT_IMAGE_QUALITY,
    encode_image,
    encoded_format,
    metadata_json,
    output_metadata,
    save_image,
    write_outputs,
)
from diffserve.server.image_files import find_image, image_path

MODEL, PIPELINE = "/models/flux-dev", "FluxPipeline"


def _image(width: int = 48, height: int = 32, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    pixels = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 2 % 256], axis=-1)
    pixels = np.clip(pixels + rng.integers(-8, 8, pixels.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def _params(**overrides) -> SamplingParams:
    values = {"prompt": "a red fox", "height": 32, "width": 48, "num_inference_steps": 3, "seed": 7}
    return SamplingParams(**{**values, **overrides})


def _psnr(a: Image.Image, b: Image.Image) -> float:
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return float(10 * np.log10(255**2 / max(np.mean(diff**2), 1e-12)))


@pytest.mark.parametrize("output_format", ["jpeg", "webp", "png"])
@pytest.mark.parametrize("quality", [None, 80])
def test_cli_and_server_paths_write_identical_bytes(
    tmp_path: Path, output_format: str, quality: int | None
) -> None:
    image, params = _image(), _params(output_format=output_format)
    metadata = output_metadata(MODEL, PIPELINE, params)

    # CLI / Python API: write_outputs, as `diffserve generate --save-output` does.
    [cli_path] = write_outputs(tmp_path / "cli", params, "req-1", metadata, images=[image], quality=quality)
    # Server, response_format="b64_json": the body bytes; response_format="url": the file it serves.
    body = encode_image(image, output_format, quality, metadata)
    url_file = save_image(
        image, image_path(tmp_path / "srv", "a" * 32 + "-0", output_format), metadata, output_format, quality
    )

    assert cli_path.suffix == f".{output_format}" and encoded_format(body) == output_format
    assert cli_path.read_bytes() == body == url_file.read_bytes()
    assert find_image(tmp_path / "srv", "a" * 32 + "-0") == url_file
    assert CONTENT_TYPES[url_file.suffix.lstrip(".")] == Image.MIME[Image.open(url_file).format]


def test_metadata_is_the_same_dict_on_every_path() -> None:
    """The API/CLI sees the request's params with its input images; the server's engine sees them decoded
    or replaced by None; the record must not depend on which."""
    edit = _params(input_images=[_image(), _image(16, 16)], mask_image=_image())
    server_side = dataclasses.replace(edit, input_images=None, mask_image=None)
    api = output_metadata(MODEL, PIPELINE, edit)
    assert api == output_metadata(MODEL, PIPELINE, server_side)
    assert "input_images" not in api and "mask_image" not in api
    assert api["model"] == MODEL and api["pipeline"] == PIPELINE and api["seed"] == 7
    json.loads(metadata_json(api))  # everything in it is JSON


def test_png_carries_the_metadata_in_a_parameters_chunk(tmp_path: Path) -> None:
    params = _params(extra={"note": "é"})
    metadata = output_metadata(MODEL, PIPELINE, params)
    [path] = write_outputs(tmp_path, params, "req-1", metadata, images=[_image()])
    with Image.open(path) as written:
        assert json.loads(written.text["parameters"]) == metadata
    with Image.open(io.BytesIO(encode_image(_image(), "png"))) as bare:
        assert "parameters" not in bare.text  # previews: no metadata given, none written


def test_default_quality_is_100_for_jpeg_and_webp() -> None:
    image = _image(seed=1)
    for output_format in ("jpeg", "webp"):
        default = encode_image(image, output_format)
        assert default == encode_image(image, output_format, DEFAULT_IMAGE_QUALITY)
        assert DEFAULT_IMAGE_QUALITY == 100
        low = encode_image(image, output_format, 10)
        assert len(low) < len(default)
        assert _psnr(Image.open(io.BytesIO(default)).convert("RGB"), image) > 35


def test_non_rgb_images_are_converted_for_jpeg() -> None:
    rgba = _image().convert("RGBA")
    assert encode_image(rgba, "jpeg", 90) == encode_image(rgba.convert("RGB"), "jpeg", 90)


@pytest.mark.parametrize(
    ("output_format", "quality"), [("gif", None), ("jpeg", 101), ("webp", -1), ("jpeg", 90.0), ("jpeg", True)]
)
def test_bad_format_or_quality_is_refused(tmp_path: Path, output_format: str, quality) -> None:
    with pytest.raises(ValueError):
        save_image(_image(), tmp_path / f"x.{output_format}", None, output_format, quality)
    assert list(tmp_path.iterdir()) == []


def test_encoded_format_refuses_unknown_bytes() -> None:
    with pytest.raises(ValueError):
        encoded_format(b"GIF89a....")


def test_write_outputs_names(tmp_path: Path) -> None:
    params = _params(num_outputs_per_prompt=2)
    metadata = output_metadata(MODEL, PIPELINE, params)
    images = [_image(seed=0), _image(seed=1)]

    named = write_outputs(tmp_path, params, "req-1", metadata, images=images, file_name="fox.jpg")
    assert [p.name for p in named] == ["fox_0.png", "fox_1.png"]
    again = write_outputs(tmp_path, params, "req-1", metadata, images=images, file_name="fox.jpg")
    assert [p.name for p in again] == ["fox_0-1.png", "fox_1-1.png"]  # never overwrites
    [single] = write_outputs(tmp_path, params, "req-1", metadata, images=images[:1], file_name="one")
    assert single.name == "one.png"
    generated = write_outputs(tmp_path, params, "req-2", metadata, images=images)
    assert all(p.name.startswith("a_red_fox_") for p in generated) and len({p.name for p in generated}) == 2
    assert not list(tmp_path.glob(".*.partial"))


def test_write_outputs_videos_and_frames(tmp_path: Path) -> None:
    pytest.importorskip("av")
    params = _params(num_frames=3, fps=8, video_format="gif")
    metadata = output_metadata(MODEL, PIPELINE, params)
    frames = np.stack([np.asarray(_image(16, 16, seed=i)) for i in range(3)])

    [path] = write_outputs(
        tmp_path,
        params,
        "req-1",
        metadata,
        images=[_image()],
        videos=[frames],
        file_name="clip",
        save_frames=True,
    )
    assert path.name == "clip.gif"
    with Image.open(path) as gif:
        # A video records its container, never the image default output_format="png" it was handed.
        assert json.loads(gif.info["comment"]) == {k: v for k, v in metadata.items() if k != "output_format"}
    assert sorted(p.name for p in (tmp_path / "clip_frames").iterdir()) == [
        "clip_00000.png",
        "clip_00001.png",
        "clip_00002.png",
    ]
