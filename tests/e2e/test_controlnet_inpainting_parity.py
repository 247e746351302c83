"""Inpainting ControlNets per request: diffserve against Diffusers' `StableDiffusion3ControlNetInpaintingPipeline`
and `QwenImageControlNetInpaintPipeline` on tiny folders and tiny random inpainting ControlNets (the mask as
extra control channels), same seed, fp32, PSNR >= 40 dB: without and with CFG, two outputs per prompt,
non-square; each with a control run (another mask) that must score well below the bar. Diffusers draws the
masked image's posterior from torch's global RNG: the tests seed it with the request's seed. Then an
inpainting row batched with a plain ControlNet row and a row without any (each as alone), a pipeline folder
of the inpainting class, and the refusals (an inpainting ControlNet without a mask, a plain one with one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from controlnet_checks import ControlNetRequests, assert_controlnets_refused, load_controlnet_folder
from diffusers import QwenImageControlNetInpaintPipeline, StableDiffusion3ControlNetInpaintingPipeline
from diffusers import QwenImageControlNetModel as DiffusersQwenControlNet
from diffusers import QwenImagePipeline as DiffusersQwenImagePipeline
from diffusers import SD3ControlNetModel as DiffusersSD3ControlNet
from diffusers import StableDiffusion3Pipeline as DiffusersSD3Pipeline
from PIL import Image, ImageDraw

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.families.qwen_image.tiny import TinyQwenImageSpec, build_tiny_qwen_image
from diffserve.families.qwen_image.tiny_controlnet import (
    TinyQwenImageControlNetSpec,
    build_tiny_qwen_image_controlnet,
    sharpen_vae_posterior,
)
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.families.sd3.tiny_controlnet import (
    TinySD3ControlNetSpec,
    build_tiny_sd3_controlnet,
    build_tiny_sd3_controlnet_pipeline,
)
from diffserve.loader.model_index import read_json
from diffserve.testing.parity import assert_batched_as_alone, assert_images_match, smooth_random_image
from diffserve.testing.tiny_writing import write_json

PSNR_BAR_DB = 40.0
PROMPT = "a fox in the snow"
HEIGHT, WIDTH = 48, 80  # non-square
IMAGE = smooth_random_image(WIDTH, HEIGHT, seed=21)
EDGES = smooth_random_image(WIDTH, HEIGHT, seed=22)


def _mask(box: tuple[int, int, int, int]) -> Image.Image:
    """White (repaint) inside `box`, black (keep) elsewhere, Diffusers' convention."""
    mask = Image.new("L", (WIDTH, HEIGHT), 0)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


MASK = _mask((20, 8, 60, 36))
OTHER_MASK = _mask((0, 0, 30, 47))


# -- SD3 ---------------------------------------------------------------------------------------------

SD3_KW = dict(num_inference_steps=3)
SD3_CFG = dict(guidance_scale=3.0, negative_prompt="blurry")
SD3_REQUESTS = ControlNetRequests(PROMPT, HEIGHT, WIDTH, SD3_KW)


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-sd3-inpainting-controlnet")
    spec = TinySD3Spec(seed=0)
    folder = build_tiny_sd3(root / "sd3", spec)
    paths = {
        "inpaint": build_tiny_sd3_controlnet(
            root / "inpaint", TinySD3ControlNetSpec(spec, inpainting=True, seed=5)
        ),
        "canny": build_tiny_sd3_controlnet(root / "canny", TinySD3ControlNetSpec(spec, seed=1)),
    }
    ours = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False, controlnets=paths)
    base = DiffusersSD3Pipeline.from_pretrained(folder, dtype=torch.float32)
    pipe = StableDiffusion3ControlNetInpaintingPipeline(
        **base.components, controlnet=DiffusersSD3ControlNet.from_pretrained(paths["inpaint"])
    )
    pipe.set_progress_bar_config(disable=True)

    def reference(seed: int, **kwargs) -> np.ndarray:
        torch.manual_seed(seed)  # Diffusers' masked-image posterior draws from the global RNG
        return SD3_REQUESTS.reference(pipe, seed, **kwargs)

    return ours, reference


_sd3_generate = SD3_REQUESTS.generate


@pytest.mark.parametrize(
    "extra",
    [dict(guidance_scale=1.0), dict(**SD3_CFG, num_outputs_per_prompt=2)],
    ids=["no-cfg", "cfg-n2"],
)
def test_sd3_inpainting_controlnet_matches_diffusers(sd3, extra) -> None:
    ours, reference = sd3
    entry = {"name": "inpaint", "image": IMAGE, "mask": MASK, "scale": 0.9, "end": 0.67}
    got = _sd3_generate(ours, 5, controlnets=[entry], **extra)
    theirs = {("num_images_per_prompt" if k == "num_outputs_per_prompt" else k): v for k, v in extra.items()}
    ref = reference(
        5, control_image=IMAGE, control_mask=MASK, controlnet_conditioning_scale=0.9, control_guidance_end=0.67,
        **theirs,
    )  # fmt: skip
    other = _sd3_generate(ours, 5, controlnets=[{**entry, "mask": OTHER_MASK}], **extra)
    assert_images_match(got, ref, f"SD3 inpainting ControlNet ({extra})", min_db=PSNR_BAR_DB, control=other)


def test_sd3_inpainting_controlnet_pipeline_folder_with_diffusers_keywords(tmp_path) -> None:
    """A `StableDiffusion3ControlNetInpaintingPipeline` folder: its `controlnet` is loaded as "default", and
    Diffusers' `control_image` / `control_mask` keywords on `generate` apply it."""
    folder = build_tiny_sd3_controlnet_pipeline(
        tmp_path / "pipe", TinySD3ControlNetSpec(TinySD3Spec(seed=3), inpainting=True, seed=4)
    )
    index = read_json(folder / "model_index.json")
    write_json(
        folder / "model_index.json", {**index, "_class_name": "StableDiffusion3ControlNetInpaintingPipeline"}
    )
    ours, pipe = load_controlnet_folder(folder, StableDiffusion3ControlNetInpaintingPipeline)
    control = dict(control_image=IMAGE, control_mask=MASK, controlnet_conditioning_scale=1.1)
    got = _sd3_generate(ours, 3, **control, **SD3_CFG)
    torch.manual_seed(3)
    ref = SD3_REQUESTS.reference(pipe, 3, **SD3_CFG, **control)
    other = _sd3_generate(ours, 3, **{**control, "control_mask": OTHER_MASK}, **SD3_CFG)
    assert_images_match(got, ref, "SD3 ControlNet inpainting folder", min_db=PSNR_BAR_DB, control=other)


def _sd3_params(prompt: str, seed: int, controlnets=(), **extra) -> SamplingParams:
    return SD3_REQUESTS.params(prompt, seed, controlnets, **{"guidance_scale": 1.0, **extra})


def test_sd3_inpainting_plain_and_uncontrolled_rows_batch_as_alone(sd3) -> None:
    ours, _ = sd3
    params = [
        _sd3_params("inpaint", 1, [ControlNetChoice("inpaint", IMAGE, scale=1.2, mask=MASK)]),
        _sd3_params("inpaint cfg", 2, [ControlNetChoice("inpaint", IMAGE, mask=OTHER_MASK)], **SD3_CFG),
        _sd3_params("canny", 3, [ControlNetChoice("canny", EDGES, scale=0.7)]),
        _sd3_params("no controlnet", 4),
    ]
    assert assert_batched_as_alone(ours, params, "SD3 inpainting ControlNet batch")[0] == 4


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            ControlNetChoice("inpaint", IMAGE),
            r"controlnets\[0\]\.mask \(control_mask\): 'inpaint' is an inpainting",
        ),
        (
            ControlNetChoice("canny", EDGES, mask=MASK),
            r"controlnets\[0\]\.mask \(control_mask\): 'canny' is not an",
        ),
        (
            ControlNetChoice("inpaint", IMAGE, mask="mask.png"),
            r"controlnets\[0\]\.mask \(control_mask\) must be a",
        ),
    ],
    ids=["no-mask", "mask-on-a-plain-one", "not-an-image"],
)
def test_sd3_mask_refusals_name_the_field(sd3, entry, message) -> None:
    ours, _ = sd3
    assert_controlnets_refused(ours, _sd3_params("bad", 1, [entry]), message)


# -- Qwen-Image --------------------------------------------------------------------------------------

QWEN_KW = dict(num_inference_steps=3, max_sequence_length=64)
QWEN_REQUESTS = ControlNetRequests(PROMPT, HEIGHT, WIDTH, QWEN_KW)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-qwen-image-inpainting-controlnet")
    spec = TinyQwenImageSpec(seed=0)
    folder = build_tiny_qwen_image(root / "qwen", spec)
    sharpen_vae_posterior(folder)  # so that the control image matters
    path = build_tiny_qwen_image_controlnet(
        root / "inpaint", TinyQwenImageControlNetSpec(spec, inpainting=True, seed=6)
    )
    ours = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, controlnets={"inpaint": path}
    )
    base = DiffusersQwenImagePipeline.from_pretrained(folder, dtype=torch.float32)
    pipe = QwenImageControlNetInpaintPipeline(
        **base.components, controlnet=DiffusersQwenControlNet.from_pretrained(path)
    )
    pipe.set_progress_bar_config(disable=True)

    def reference(seed: int, **kwargs) -> np.ndarray:
        torch.manual_seed(seed)  # Diffusers' masked-image posterior draws from the global RNG
        return QWEN_REQUESTS.reference(pipe, seed, **kwargs)

    return ours, reference


_qwen_generate = QWEN_REQUESTS.generate


@pytest.mark.parametrize(
    "extra",
    [dict(true_cfg_scale=1.0), dict(true_cfg_scale=3.0, negative_prompt="blurry", num_outputs_per_prompt=2)],
    ids=["no-cfg", "true-cfg-n2"],
)
def test_qwen_image_inpainting_controlnet_matches_diffusers(qwen, extra) -> None:
    ours, reference = qwen
    entry = {"name": "inpaint", "image": IMAGE, "mask": MASK, "scale": 0.8}
    got = _qwen_generate(ours, 7, controlnets=[entry], **extra)
    theirs = {("num_images_per_prompt" if k == "num_outputs_per_prompt" else k): v for k, v in extra.items()}
    ref = reference(
        7, control_image=IMAGE, control_mask=MASK, controlnet_conditioning_scale=0.8,
        **theirs,
    )  # fmt: skip
    other = _qwen_generate(ours, 7, controlnets=[{**entry, "mask": OTHER_MASK}], **extra)
    assert_images_match(
        got, ref, f"Qwen-Image inpainting ControlNet ({extra})", min_db=PSNR_BAR_DB, control=other
    )


def test_qwen_image_inpainting_and_uncontrolled_rows_batch_as_alone(qwen) -> None:
    ours, _ = qwen
    params = [
        SamplingParams(prompt="inpaint", seed=1, height=HEIGHT, width=WIDTH, true_cfg_scale=1.0, **QWEN_KW,
                       controlnets=[ControlNetChoice("inpaint", IMAGE, scale=1.1, mask=MASK)]),
        SamplingParams(prompt="plain", seed=2, height=HEIGHT, width=WIDTH, true_cfg_scale=1.0, **QWEN_KW),
    ]  # fmt: skip
    assert assert_batched_as_alone(ours, params, "Qwen-Image inpainting ControlNet batch")[0] == 2
