"""Pixels pinned across refactors: each family's tiny checkpoint, one fixed request, compared with the
uint8 output stored in `tests/data/pinned/` (written by the engine before the one-engine redesign).

A refactor of the engine, the stages or the models must not move a pixel by more than one uint8 level
(float rounding of a reordered sum); a real change of semantics moves many. Rewrite the references only
for a deliberate change of output, with `python tests/e2e/test_pinned_outputs.py --write [CASE ...]`.
The Wan cases were rewritten when the Wan DiT's attention modules were reordered (shared AttentionWeights):
the tiny builder draws weights in module order, so the fixture's weights changed, not the maths (the Wan
pipelines still match diffusers in tests/e2e/test_wan_pipeline_parity.py).
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

PINNED_DIR = Path(__file__).resolve().parents[1] / "data" / "pinned"

#: The Qwen-Image edit case's request, which the layered case decomposes into layers.
QWEN_IMAGE_EDIT_REQUEST = {
    "height": 32,
    "width": 48,
    "num_inference_steps": 2,
    "true_cfg_scale": 2.0,
    "negative_prompt": "dark",
    "input_images": "gradient",
}

#: family -> (builder "module:function", builder spec kwargs or None, request params)
CASES: dict[str, tuple[str, dict, dict]] = {
    "flux": (
        "diffserve.families.flux.tiny:build_tiny_flux",
        {},
        {"height": 32, "width": 48, "num_inference_steps": 3, "guidance_scale": 3.5},
    ),
    "flux-true-cfg": (
        "diffserve.families.flux.tiny:build_tiny_flux",
        {},
        {
            "height": 48,
            "width": 32,
            "num_inference_steps": 2,
            "true_cfg_scale": 2.0,
            "negative_prompt": "ugly",
        },
    ),
    "sd3": (
        "diffserve.families.sd3.tiny:build_tiny_sd3",
        {},
        {"height": 32, "width": 32, "num_inference_steps": 3, "guidance_scale": 4.0},
    ),
    "qwen-image": (
        "diffserve.families.qwen_image.tiny:build_tiny_qwen_image",
        {},
        {
            "height": 32,
            "width": 48,
            "num_inference_steps": 3,
            "true_cfg_scale": 3.0,
            "negative_prompt": "blurry",
        },
    ),
    "qwen-image-edit": (
        "diffserve.families.qwen_image.tiny:build_tiny_qwen_image_edit",
        {},
        QWEN_IMAGE_EDIT_REQUEST,
    ),
    "qwen-image-layered": (  # the edit request, decomposed into 2 layers
        "diffserve.families.qwen_image.tiny:build_tiny_qwen_image_layered",
        {},
        {**QWEN_IMAGE_EDIT_REQUEST, "extra": {"layers": 2}},
    ),
    "z-image": (
        "diffserve.families.z_image.tiny:build_tiny_zimage",
        {},
        {"height": 32, "width": 32, "num_inference_steps": 3, "guidance_scale": 3.0},
    ),
    "chroma": (
        "diffserve.families.chroma.tiny:build_tiny_chroma",
        {},
        {
            "height": 48,
            "width": 32,
            "num_inference_steps": 3,
            "guidance_scale": 4.0,
            "negative_prompt": "blurry",
            "max_sequence_length": 32,
        },
    ),
    "wan-t2v": (
        "diffserve.families.wan.tiny:build_tiny_wan",
        {},
        {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 4.0},
    ),
    "wan-i2v": (
        "diffserve.families.wan.tiny:build_tiny_wan",
        {"image_to_video": True},
        {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "input_images": "gradient"},
    ),
    "skyreels-v2": (
        "diffserve.families.wan.skyreels_v2_tiny:build_tiny_skyreels_v2",
        {},
        {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 6.0},
    ),
    "skyreels-v2-i2v": (
        "diffserve.families.wan.skyreels_v2_tiny:build_tiny_skyreels_v2",
        {"image_to_video": True},
        {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "input_images": "gradient"},
    ),
    "skyreels-v2-df": (
        "diffserve.families.wan.skyreels_v2_tiny:build_tiny_skyreels_v2",
        {"diffusion_forcing": True, "num_frame_per_block": 2},
        {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 3, "guidance_scale": 6.0},
    ),
    "longcat-image": (
        "diffserve.families.longcat_image.tiny:build_tiny_longcat_image",
        {},
        {"height": 32, "width": 48, "num_inference_steps": 3, "guidance_scale": 4.5},
    ),
    "sana-video": (
        "diffserve.families.sana_video.tiny:build_tiny_sana_video",
        {},
        {
            "height": 32,
            "width": 64,
            "num_frames": 5,
            "num_inference_steps": 2,
            "guidance_scale": 4.0,
            "negative_prompt": "blurry",
            "extra": {"use_resolution_binning": False},
        },
    ),
    "cogvideox-t2v": (
        "diffserve.families.cogvideox.tiny:build_tiny_cogvideox",
        {},
        {"height": 32, "width": 48, "num_frames": 9, "num_inference_steps": 2, "guidance_scale": 6.0},
    ),
    "cogvideox-i2v": (
        "diffserve.families.cogvideox.tiny:build_tiny_cogvideox",
        {"variant": "1.5", "image_to_video": True},
        {
            "height": 48,
            "width": 64,
            "num_frames": 9,
            "num_inference_steps": 2,
            "guidance_scale": 6.0,
            "input_images": "gradient",
            "extra": {"use_dynamic_cfg": True},
        },
    ),
    "mochi": (
        "diffserve.families.mochi.tiny:build_tiny_mochi",
        {},
        {"height": 32, "width": 48, "num_frames": 7, "num_inference_steps": 3, "guidance_scale": 4.5},
    ),
    "hunyuan-video": (
        "diffserve.families.hunyuan_video.tiny:build_tiny_hunyuan_video",
        {},
        {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 6.0},
    ),
    "hunyuan-video-i2v": (
        "diffserve.families.hunyuan_video.image_to_video_tiny:build_tiny_hunyuan_video_i2v",
        {},
        {
            "height": 32,
            "width": 48,
            "num_frames": 5,
            "num_inference_steps": 2,
            "guidance_scale": 6.0,
            "true_cfg_scale": 2.0,
            "negative_prompt": "blurry",
            "max_sequence_length": 32,
            "input_images": "gradient",
        },
    ),
    "hidream-i1": (
        "diffserve.families.hidream.tiny:build_tiny_hidream",
        {},
        {
            "height": 32,
            "width": 56,
            "num_inference_steps": 2,
            "guidance_scale": 4.0,
            "negative_prompt": "blurry",
            "max_sequence_length": 16,
        },
    ),
    "qwen-image-2.1": (
        "diffserve.families.qwen_image21.tiny:build_tiny_qwen_image21",
        {},
        {
            "height": 32,
            "width": 32,
            "num_inference_steps": 2,
            "true_cfg_scale": 3.0,
            "negative_prompt": "blurry",
        },
    ),
    "hunyuan-image-2.1": (
        "diffserve.families.hunyuan_image.tiny:build_tiny_hunyuan_image",
        {},
        {"height": 32, "width": 64, "num_inference_steps": 3, "negative_prompt": "blurry"},
    ),
}


def _gradient_image() -> Image.Image:
    y, x = np.mgrid[0:40, 0:56]
    array = np.stack([x * 4, y * 6, (x + y) * 2], axis=-1).clip(0, 255).astype(np.uint8)
    return Image.fromarray(array)


def _build(name: str, out_dir: Path) -> Path:
    target, spec_kwargs, _ = CASES[name]
    module_name, function = target.split(":")
    module = importlib.import_module(module_name)
    builder = getattr(module, function)
    if not spec_kwargs:
        return builder(out_dir)
    spec_cls = next(getattr(module, n) for n in dir(module) if n.startswith("Tiny") and n.endswith("Spec"))
    return builder(out_dir, spec_cls(**spec_kwargs))


def generate_pinned(name: str, out_dir: Path) -> np.ndarray:
    """The case's output as one uint8 array: (outputs, H, W, 3) for images (4 channels for RGBA ones:
    Qwen-Image-Layered's layers), (outputs, F, H, W, 3) for videos."""
    from diffserve import DiffGenerator

    root = _build(name, out_dir)
    params = dict(CASES[name][2])
    if params.pop("input_images", None) == "gradient":
        params["image"] = _gradient_image()
    generator = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    out = generator.generate(prompt="a red fox in the snow", seed=7, **params)
    if out.frames:
        return np.stack(out.frames)
    return np.stack(
        [np.asarray(image if image.mode == "RGBA" else image.convert("RGB")) for image in out.images]
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_matches_the_pinned_pixels(name: str, tmp_path: Path) -> None:
    reference = np.load(PINNED_DIR / f"{name}.npy")
    output = generate_pinned(name, tmp_path)
    assert output.shape == reference.shape
    diff = np.abs(output.astype(np.int16) - reference.astype(np.int16))
    assert int(diff.max()) <= 1, f"{name}: max pixel difference {int(diff.max())}"
    assert float((diff > 0).mean()) < 0.01, f"{name}: {float((diff > 0).mean()):.2%} of the values moved"


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"] or not set(sys.argv[2:]) <= set(CASES):
        sys.exit(
            "usage: python tests/e2e/test_pinned_outputs.py --write [CASE ...]   (rewrites the pinned references;"
            f" all cases, or the named ones of {', '.join(sorted(CASES))})"
        )
    PINNED_DIR.mkdir(parents=True, exist_ok=True)
    for case_name in sorted(sys.argv[2:] or CASES):
        with tempfile.TemporaryDirectory() as tmp:
            array = generate_pinned(case_name, Path(tmp))
        np.save(PINNED_DIR / f"{case_name}.npy", array)
        print(f"{case_name}: {array.shape} written")
