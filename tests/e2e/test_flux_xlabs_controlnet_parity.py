"""XLabs' FLUX.1 ControlNets per request (Diffusers' `FluxControlNetModel` with `conditioning_embedding_channels`:
the control image itself through a pixel-space hint encoder, and the DiT cycling their double-stream
samples over its blocks): diffserve against Diffusers' `FluxControlNetPipeline` on a tiny FLUX folder and a
tiny random XLabs ControlNet, same seed, fp32, PSNR >= 40 dB, without and with true CFG (two outputs per
prompt), non-square; a control run (another control image) well below the bar. Then an XLabs row batched
with an InstantX-style row and a plain row, each as alone, and a request mixing the two kinds refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from controlnet_checks import ControlNetRequests, assert_controlnets_refused
from diffusers import FluxControlNetModel as DiffusersControlNet
from diffusers import FluxControlNetPipeline
from diffusers import FluxPipeline as DiffusersFluxPipeline

from diffserve import DiffGenerator
from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.families.flux.tiny_controlnet import TinyFluxControlNetSpec, build_tiny_flux_controlnet
from diffserve.testing.parity import assert_batched_as_alone, assert_images_match, smooth_random_image

PSNR_BAR_DB = 40.0
PROMPT = "a fox in the snow"
HEIGHT, WIDTH = 48, 80  # non-square
KW = dict(num_inference_steps=3, max_sequence_length=16, guidance_scale=3.5)
EDGES = smooth_random_image(WIDTH, HEIGHT, seed=11)
OTHER = smooth_random_image(WIDTH, HEIGHT, seed=13)
REQUESTS = ControlNetRequests(PROMPT, HEIGHT, WIDTH, KW)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-flux-xlabs-controlnet")
    flux = TinyFluxSpec(seed=0)
    folder = build_tiny_flux(root / "flux", flux)
    # Two double-stream samples for the DiT's blocks: cycled (XLabs), not spread by intervals.
    xlabs = build_tiny_flux_controlnet(
        root / "xlabs", TinyFluxControlNetSpec(flux, num_layers=2, num_single_layers=0, xlabs=True, seed=3)
    )
    canny = build_tiny_flux_controlnet(root / "canny", TinyFluxControlNetSpec(flux, seed=1))
    ours = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, controlnets={"xlabs": xlabs, "canny": canny}
    )
    assert ours.pipeline.controlnets["xlabs"].config.reads_pixels
    base = DiffusersFluxPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe = FluxControlNetPipeline(**base.components, controlnet=DiffusersControlNet.from_pretrained(xlabs))
    pipe.set_progress_bar_config(disable=True)

    def reference(seed: int, **kwargs) -> np.ndarray:
        return REQUESTS.reference(pipe, seed, **kwargs)

    return ours, reference


generate = REQUESTS.generate


@pytest.mark.parametrize(
    "extra",
    [{}, dict(true_cfg_scale=2.0, negative_prompt="blurry", num_outputs_per_prompt=2)],
    ids=["no-cfg", "true-cfg-n2"],
)
def test_xlabs_controlnet_matches_diffusers(setup, extra) -> None:
    ours, reference = setup
    entry = {"name": "xlabs", "image": EDGES, "scale": 0.9}
    got = generate(ours, 5, controlnets=[entry], **extra)
    theirs = {("num_images_per_prompt" if k == "num_outputs_per_prompt" else k): v for k, v in extra.items()}
    ref = reference(5, control_image=EDGES, controlnet_conditioning_scale=0.9, **theirs)
    other = generate(ours, 5, controlnets=[{**entry, "image": OTHER}], **extra)
    assert_images_match(got, ref, f"XLabs ControlNet ({extra})", min_db=PSNR_BAR_DB, control=other)


_params = REQUESTS.params


def test_xlabs_instantx_and_plain_rows_batch_as_alone(setup) -> None:
    ours, _ = setup
    params = [
        _params("xlabs", 1, [ControlNetChoice("xlabs", EDGES, scale=1.1)]),
        _params("instantx", 2, [ControlNetChoice("canny", EDGES, scale=0.8)]),
        _params("plain", 3),
    ]
    assert assert_batched_as_alone(ours, params, "XLabs ControlNet batch")[0] == 3


def test_a_request_mixing_xlabs_and_instantx_is_refused(setup) -> None:
    ours, _ = setup
    entries = [ControlNetChoice("xlabs", EDGES), ControlNetChoice("canny", EDGES)]
    assert_controlnets_refused(ours, _params("mixed", 1, entries), "mixes XLabs ControlNets")
