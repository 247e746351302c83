"""Qwen-Image ControlNets per request: diffserve against Diffusers' `QwenImageControlNetPipeline` on one tiny
Qwen-Image folder and tiny random ControlNets (Diffusers layout), same seed, fp32, PSNR >= 40 dB: one
ControlNet (non-square), Diffusers' `QwenImageMultiControlNetModel` (one ControlNet over two control images,
with a start fraction) under true CFG, and a `QwenImageControlNetPipeline` folder with Diffusers' keywords;
each with a control run (another control image) that must score well below the bar. Then step batching (a
ControlNet row next to a plain row, each as alone; the plain row bit for bit) and the refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from controlnet_checks import (
    ControlNetRequests,
    assert_controlnets_refused,
    assert_plain_row_unaffected,
    load_controlnet_folder,
)
from diffusers import QwenImageControlNetModel as DiffusersControlNet
from diffusers import QwenImageControlNetPipeline
from diffusers import QwenImagePipeline as DiffusersQwenImagePipeline
from diffusers.models.controlnets.controlnet_qwenimage import QwenImageMultiControlNetModel

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.engine_args import ControlNetSpec
from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.errors import UserError
from diffserve.families.qwen_image.pipeline import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffserve.families.qwen_image.tiny import TinyQwenImageSpec, build_tiny_qwen_image
from diffserve.families.qwen_image.tiny_controlnet import (
    TinyQwenImageControlNetSpec,
    build_tiny_qwen_image_controlnet,
    build_tiny_qwen_image_controlnet_pipeline,
    sharpen_vae_posterior,
)
from diffserve.loader.controlnets import load_controlnets
from diffserve.testing.parity import assert_batched_as_alone, assert_images_match, smooth_random_image

PSNR_BAR_DB = 40.0
PROMPT = "a fox in the snow"
HEIGHT, WIDTH = 48, 80  # non-square: the packed grid's rows and columns differ
KW = dict(num_inference_steps=3, max_sequence_length=64)
NO_CFG = dict(true_cfg_scale=1.0)
EDGES = smooth_random_image(WIDTH, HEIGHT, seed=11)
DEPTH = smooth_random_image(WIDTH, HEIGHT, seed=12)
OTHER = smooth_random_image(WIDTH, HEIGHT, seed=13)
REQUESTS = ControlNetRequests(PROMPT, HEIGHT, WIDTH, KW)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-qwen-image-controlnet")
    qwen = TinyQwenImageSpec(seed=0)
    folder = build_tiny_qwen_image(root / "qwen", qwen)
    sharpen_vae_posterior(folder)  # so that the control image matters
    canny = build_tiny_qwen_image_controlnet(root / "canny", TinyQwenImageControlNetSpec(qwen, seed=1))
    union = build_tiny_qwen_image_controlnet(
        root / "union", TinyQwenImageControlNetSpec(qwen, num_layers=2, seed=2)
    )
    ours = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, controlnets={"canny": canny, "union": union}
    )
    base = DiffusersQwenImagePipeline.from_pretrained(folder, dtype=torch.float32)
    nets = {
        "canny": DiffusersControlNet.from_pretrained(canny),
        "union": DiffusersControlNet.from_pretrained(union),
    }

    def reference(controlnet, seed: int, **kwargs) -> np.ndarray:
        pipe = QwenImageControlNetPipeline(**base.components, controlnet=controlnet)
        pipe.set_progress_bar_config(disable=True)
        return REQUESTS.reference(pipe, seed, **kwargs)

    return ours, nets, reference


def generate(ours, seed: int, **kwargs) -> np.ndarray:
    return REQUESTS.generate(ours, seed, **{**NO_CFG, **kwargs})


def test_one_controlnet_matches_diffusers(setup) -> None:
    ours, nets, reference = setup
    entry = {"name": "canny", "image": EDGES, "scale": 0.8}
    got = generate(ours, 5, controlnets=[entry])
    ref = reference(nets["canny"], 5, control_image=EDGES, controlnet_conditioning_scale=0.8, **NO_CFG)
    other = generate(ours, 5, controlnets=[{**entry, "image": OTHER}])
    assert_images_match(got, ref, "one ControlNet", min_db=PSNR_BAR_DB, control=other)


def test_multi_images_with_a_start_and_true_cfg_match_diffusers_multi(setup) -> None:
    """Diffusers' `QwenImageMultiControlNetModel`: one (Union) ControlNet over several control images, the
    samples summed; here with true CFG (the residuals go to both branches) and a later start."""
    ours, nets, reference = setup
    cfg = dict(true_cfg_scale=3.0, negative_prompt="blurry")
    entries = [
        {"name": "union", "image": EDGES, "scale": 0.6},
        {"name": "union", "image": DEPTH, "scale": 0.9, "start": 0.34},
    ]
    got = generate(ours, 9, controlnets=entries, **cfg)
    ref = reference(
        QwenImageMultiControlNetModel([nets["union"]]), 9,
        control_image=[EDGES, DEPTH], controlnet_conditioning_scale=[0.6, 0.9],
        control_guidance_start=[0.0, 0.34], control_guidance_end=[1.0, 1.0], **cfg,
    )  # fmt: skip
    other = generate(ours, 9, controlnets=[{**entries[0], "image": OTHER}, entries[1]], **cfg)
    assert_images_match(got, ref, "Multi (two images), true CFG", min_db=PSNR_BAR_DB, control=other)


def test_a_controlnet_pipeline_folder_serves_its_controlnet_with_diffusers_keywords(tmp_path) -> None:
    """A `QwenImageControlNetPipeline` folder: its `controlnet` is loaded as "default", and Diffusers'
    keywords on `generate` apply it."""
    folder = build_tiny_qwen_image_controlnet_pipeline(
        tmp_path / "pipe", TinyQwenImageControlNetSpec(TinyQwenImageSpec(seed=3), seed=4)
    )
    ours, pipe = load_controlnet_folder(folder, QwenImageControlNetPipeline)
    control = dict(control_image=EDGES, controlnet_conditioning_scale=1.1, control_guidance_end=0.67)
    got = generate(ours, 3, **control)
    ref = REQUESTS.reference(pipe, 3, **NO_CFG, **control)
    other = generate(ours, 3, **{**control, "control_image": OTHER})
    assert_images_match(got, ref, "QwenImageControlNetPipeline folder", min_db=PSNR_BAR_DB, control=other)


def _params(prompt: str, seed: int, controlnets=(), **extra) -> SamplingParams:
    return REQUESTS.params(prompt, seed, controlnets, **{**NO_CFG, **extra})


def test_a_controlnet_row_and_a_plain_row_batch_as_alone(setup) -> None:
    ours, _, _ = setup
    params = [
        _params("canny", 1, [ControlNetChoice("canny", EDGES, scale=1.2)]),
        _params("union with cfg", 2, [ControlNetChoice("union", DEPTH, scale=0.5, end=0.67)],
                true_cfg_scale=2.0, negative_prompt="ugly"),
        _params("no controlnet", 4),
    ]  # fmt: skip
    assert assert_batched_as_alone(ours, params, "Qwen-Image ControlNet batch")[0] == 3


def test_controlnets_next_to_a_block_range_cache_batch_as_alone(setup) -> None:
    """DBCache runs the DiT's blocks in ranges over some rows: the residuals follow the rows it computes."""
    ours, _, _ = setup
    dbcache = {"method": "dbcache", "Fn_compute_blocks": 1, "Bn_compute_blocks": 0}
    params = [
        _params("ctrl", 1, [ControlNetChoice("canny", EDGES, 0.9)], num_inference_steps=5),
        _params("cached", 2, cache=dbcache, num_inference_steps=5),
        _params("ctrl and cache", 3, [ControlNetChoice("union", DEPTH, 0.5, start=0.2)], cache=dbcache,
                num_inference_steps=5),
    ]  # fmt: skip
    assert_batched_as_alone(ours, params, "Qwen-Image ControlNets next to DBCache")


def test_rows_without_a_controlnet_are_bit_identical(setup) -> None:
    ours, _, _ = setup
    controlled = _params("neighbour", 1, [ControlNetChoice("canny", EDGES, scale=1.5)])
    assert_plain_row_unaffected(ours, _params("plain", 4), controlled, _params("neighbour", 1))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (ControlNetChoice("nope", EDGES), r"controlnets\[0\].name 'nope' is not a ControlNet"),
        (ControlNetChoice("canny", EDGES, mode=1), r"controlnets\[0\].mode.*not a Union"),
    ],
)
def test_bad_entries_are_refused_naming_the_field(setup, entry, message) -> None:
    ours, _, _ = setup
    assert_controlnets_refused(ours, _params("bad", 1, [entry]), message)


@pytest.mark.parametrize("cls", [QwenImageEditPipeline, QwenImageEditPlusPipeline])
def test_the_edit_pipelines_refuse_controlnets(cls) -> None:
    """Diffusers has no ControlNet pipeline for Qwen-Image-Edit: `--controlnet` is refused, naming it."""
    spec = ControlNetSpec("canny", "/nonexistent")
    with pytest.raises(
        UserError, match=rf"--controlnet: the qwen-image-edit family \({cls.__name__}\) takes no"
    ):
        load_controlnets(
            [spec], None, object.__new__(cls), "qwen-image-edit", platform=None, dtype=torch.float32
        )
