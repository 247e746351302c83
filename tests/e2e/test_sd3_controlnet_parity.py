"""SD3 ControlNets per request: diffserve against Diffusers' `StableDiffusion3ControlNetPipeline` on one tiny
SD3 folder and tiny random ControlNets (Diffusers layout), same seed, fp32, PSNR >= 40 dB: one ControlNet
(non-square), CFG (the ControlNet runs on each branch with its own text and control latents), two
ControlNets as Diffusers' `SD3MultiControlNetModel` with a start fraction, and a ControlNet that takes the
pooled projection (no `force_zeros_for_pooled_projection`: the VAE shift applies), and SD3.5-Large's kind
(single-stream blocks on the DiT's patch embedding and positions); each with a control run
(another control image) that must score well below the bar. Diffusers draws the control posterior from
torch's global RNG: the tests seed it with the request's seed. Then step batching and the refusals.
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
from diffusers import SD3ControlNetModel as DiffusersControlNet
from diffusers import StableDiffusion3ControlNetPipeline
from diffusers import StableDiffusion3Pipeline as DiffusersSD3Pipeline
from diffusers.models.controlnets.controlnet_sd3 import SD3MultiControlNetModel

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.families.sd3.tiny_controlnet import (
    TinySD3ControlNetSpec,
    build_tiny_sd3_controlnet,
    build_tiny_sd3_controlnet_pipeline,
)
from diffserve.testing.parity import assert_batched_as_alone, assert_images_match, smooth_random_image

PSNR_BAR_DB = 40.0
PROMPT = "a fox in the snow"
HEIGHT, WIDTH = 48, 80  # non-square
KW = dict(num_inference_steps=3)
NO_CFG = dict(guidance_scale=1.0)
CFG = dict(guidance_scale=3.0, negative_prompt="blurry")
EDGES = smooth_random_image(WIDTH, HEIGHT, seed=11)
DEPTH = smooth_random_image(WIDTH, HEIGHT, seed=12)
OTHER = smooth_random_image(WIDTH, HEIGHT, seed=13)
REQUESTS = ControlNetRequests(PROMPT, HEIGHT, WIDTH, KW)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-sd3-controlnet")
    sd3 = TinySD3Spec(seed=0)
    folder = build_tiny_sd3(root / "sd3", sd3)
    paths = {
        "canny": build_tiny_sd3_controlnet(root / "canny", TinySD3ControlNetSpec(sd3, seed=1)),
        "depth": build_tiny_sd3_controlnet(root / "depth", TinySD3ControlNetSpec(sd3, num_layers=2, seed=2)),
        "pooled": build_tiny_sd3_controlnet(
            root / "pooled", TinySD3ControlNetSpec(sd3, force_zeros_for_pooled_projection=False, seed=3)
        ),
        # SD3.5-Large's kind: single-stream blocks on the DiT's patch embedding and positions.
        "large": build_tiny_sd3_controlnet(
            root / "large",
            TinySD3ControlNetSpec(
                sd3, num_layers=2, force_zeros_for_pooled_projection=False, single_stream=True, seed=4
            ),
        ),
    }
    ours = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False, controlnets=paths)
    base = DiffusersSD3Pipeline.from_pretrained(folder, dtype=torch.float32)
    nets = {name: DiffusersControlNet.from_pretrained(path) for name, path in paths.items()}

    def reference(controlnet, seed: int, **kwargs) -> np.ndarray:
        pipe = StableDiffusion3ControlNetPipeline(**base.components, controlnet=controlnet)
        pipe.set_progress_bar_config(disable=True)
        torch.manual_seed(seed)  # Diffusers' control posterior draws from the global RNG
        return REQUESTS.reference(pipe, seed, **kwargs)

    return ours, nets, reference


generate = REQUESTS.generate


@pytest.mark.parametrize(
    ("name", "cfg"), [("canny", NO_CFG), ("canny", CFG), ("pooled", CFG), ("large", NO_CFG), ("large", CFG)]
)
def test_one_controlnet_matches_diffusers(setup, name, cfg) -> None:
    ours, nets, reference = setup
    entry = {"name": name, "image": EDGES, "scale": 0.8}
    got = generate(ours, 5, controlnets=[entry], **cfg)
    ref = reference(nets[name], 5, control_image=EDGES, controlnet_conditioning_scale=0.8, **cfg)
    other = generate(ours, 5, controlnets=[{**entry, "image": OTHER}], **cfg)
    assert_images_match(got, ref, f"one ControlNet ({name}, {cfg})", min_db=PSNR_BAR_DB, control=other)


def test_two_controlnets_with_a_start_match_diffusers_multi(setup) -> None:
    ours, nets, reference = setup
    entries = [
        {"name": "canny", "image": EDGES, "scale": 0.6},
        {"name": "depth", "image": DEPTH, "scale": 0.9, "start": 0.3},
    ]
    got = generate(ours, 9, controlnets=entries, **CFG)
    ref = reference(
        SD3MultiControlNetModel([nets["canny"], nets["depth"]]), 9,
        control_image=[EDGES, DEPTH], controlnet_conditioning_scale=[0.6, 0.9],
        control_guidance_start=[0.0, 0.3], control_guidance_end=[1.0, 1.0], **CFG,
    )  # fmt: skip
    other = generate(ours, 9, controlnets=[{**entries[0], "image": OTHER}, entries[1]], **CFG)
    assert_images_match(got, ref, "two ControlNets (Multi), CFG", min_db=PSNR_BAR_DB, control=other)


def test_a_controlnet_pipeline_folder_serves_its_controlnet_with_diffusers_keywords(tmp_path) -> None:
    """A `StableDiffusion3ControlNetPipeline` folder: its `controlnet` is loaded as "default", and Diffusers'
    keywords on `generate` apply it."""
    folder = build_tiny_sd3_controlnet_pipeline(
        tmp_path / "pipe", TinySD3ControlNetSpec(TinySD3Spec(seed=3), seed=4)
    )
    ours, pipe = load_controlnet_folder(folder, StableDiffusion3ControlNetPipeline)
    control = dict(control_image=EDGES, controlnet_conditioning_scale=1.1, control_guidance_end=0.67)
    got = generate(ours, 3, **control, **CFG)
    torch.manual_seed(3)
    ref = REQUESTS.reference(pipe, 3, **CFG, **control)
    other = generate(ours, 3, **{**control, "control_image": OTHER}, **CFG)
    assert_images_match(
        got, ref, "StableDiffusion3ControlNetPipeline folder", min_db=PSNR_BAR_DB, control=other
    )


def _params(prompt: str, seed: int, controlnets=(), **extra) -> SamplingParams:
    return REQUESTS.params(prompt, seed, controlnets, **{**NO_CFG, **extra})


def test_a_controlnet_row_and_a_plain_row_batch_as_alone(setup) -> None:
    ours, _, _ = setup
    params = [
        _params("canny", 1, [ControlNetChoice("canny", EDGES, scale=1.2)]),
        _params("depth with cfg", 2, [ControlNetChoice("depth", DEPTH, scale=0.5, end=0.67)], **CFG),
        _params("sd3.5-large kind", 3, [ControlNetChoice("large", EDGES, scale=0.9)]),
        _params("no controlnet", 4),
    ]
    assert assert_batched_as_alone(ours, params, "SD3 ControlNet batch")[0] == 4


def test_rows_without_a_controlnet_are_bit_identical(setup) -> None:
    ours, _, _ = setup
    controlled = _params("neighbour", 1, [ControlNetChoice("canny", EDGES, scale=1.5)])
    assert_plain_row_unaffected(ours, _params("plain", 4), controlled, _params("neighbour", 1))


@pytest.mark.parametrize(
    ("entry", "extra", "message"),
    [
        (ControlNetChoice("nope", EDGES), {}, r"controlnets\[0\].name 'nope' is not a ControlNet"),
        (ControlNetChoice("canny", EDGES, mode=1), {}, r"controlnets\[0\].mode.*not a Union"),
        (ControlNetChoice("canny", EDGES), {"skip_guidance_layers": [0], **CFG}, "skip_guidance_layers"),
    ],
)
def test_bad_entries_are_refused_naming_the_field(setup, entry, extra, message) -> None:
    ours, _, _ = setup
    assert_controlnets_refused(ours, _params("bad", 1, [entry], **extra), message)
