"""Inputs of the edit-model server tests (test_images_edits_qwen*.py): a random input PNG, and the CLI's
`diffserve generate --image` run on a tiny edit checkpoint (the CLI's counterpart of an edit request).

A plain module (not conftest.py) so test files can import it by name."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def random_png(size: tuple[int, int], seed: int = 0) -> bytes:
    """A PNG of `size` (width, height) with uniformly random RGB pixels drawn from `seed`."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def cli_generate_with_image(
    model_dir: Path, tmp_path: Path, image: bytes, prompt: str, size: tuple[int, int], file_name: str
) -> Path:
    """`diffserve generate --image` (2 steps, no true CFG) on `model_dir` with `image` written under
    `tmp_path`, at `size` (width, height), into `file_name`: must exit 0. Returns the output folder."""
    from diffserve.cli.main import main

    path = tmp_path / "in.png"
    path.write_bytes(image)
    out_dir = tmp_path / "out"
    width, height = size
    rc = main(
        [
            "generate",
            "--model-path",
            str(model_dir),
            "--prompt",
            prompt,
            "--image",
            str(path),
            "--num-inference-steps",
            "2",
            "--true-cfg-scale",
            "1",
            "--width",
            str(width),
            "--height",
            str(height),
            "--output-path",
            str(out_dir),
            "--output-file-name",
            file_name,
            "--log-level",
            "warning",
        ]
    )
    assert rc == 0
    return out_dir
