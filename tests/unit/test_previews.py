"""Partial-image previews (`diffserve.stages.previews`) on every image family's tiny checkpoint.

What is measured, per family (FLUX, SD3, Qwen-Image, Z-Image), for a non-square 48x32 request with two
outputs over 3 steps:
- the predicted clean latent after step k equals `x_{k-1} - sigma_{k-1} * v`, with `v` recovered from
  the latents the sampler actually visited: the stashed prediction has the right sign (Z-Image's DiT
  output is negated) and the right step (max abs diff < 1e-4 relative);
- every preview has the output's size, and the last one (x0 = the final latent, decoded full size)
  has exactly the final image's pixels (measured: identical on CPU float32, all four families);
- above `PREVIEW_MAX_PIXELS` the VAE decodes pooled latents: with the cap forced down to a quarter of
  the image the previews keep the output size; the last one against the final image is only printed
  and loosely bounded (measured 12.7-26 dB: random decoders are not smooth in their latents, which is
  why the cap is as high as 1 megapixel).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from diffserve import DiffGenerator
from diffserve.configs.sampling_params import SamplingParams
from diffserve.request import Req
from diffserve.stages.previews import PREVIEW_MAX_PIXELS, pool_factor, predicted_clean_latents, preview_images
from diffserve.testing.image_metrics import psnr_uint8 as psnr

WIDTH, HEIGHT, STEPS = 48, 32, 3
BUILDERS = {
    "flux": None,  # the session's tiny_flux_dir
    "sd3": "diffserve.families.sd3.tiny:build_tiny_sd3",
    "qwen-image": "diffserve.families.qwen_image.tiny:build_tiny_qwen_image",
    "zimage": "diffserve.families.z_image.tiny:build_tiny_zimage",
}
#: Last preview from latents pooled 2x (a quarter of the pixels decoded) against the final image: a
#: sanity bound only (measured 12.7-26 dB on the random test VAEs).
POOLED_MIN_PSNR = 10.0


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def run(request, tmp_path_factory):
    """One generation with a preview and the state of the request recorded after every step."""
    family = request.param
    if BUILDERS[family] is None:
        model_dir = request.getfixturevalue("tiny_flux_dir")
    else:
        module, function = BUILDERS[family].split(":")
        model_dir = getattr(importlib.import_module(module), function)(tmp_path_factory.mktemp(family))
    generator = DiffGenerator.from_pretrained(model_dir, device="cpu", show_progress=False)
    params = SamplingParams(
        prompt="a red fox",
        width=WIDTH,
        height=HEIGHT,
        seed=3,
        num_inference_steps=STEPS,
        num_outputs_per_prompt=2,
    )
    records = []

    def on_step(req: Req) -> None:
        records.append(
            {
                "step": req.step_index,
                "latents": req.latents.float().clone(),
                "x0": predicted_clean_latents(req).clone(),
                "previews": generator.pipeline.preview_images(req),
                "pooled": preview_images(
                    generator.pipeline.decoding_stage, req, max_pixels=WIDTH * HEIGHT // 4
                ),
            }
        )

    req = Req(params=params, on_step=on_step)
    out = generator.generate_from_params(params, request=req)
    return family, req, records, out.images


def test_predicted_clean_latent_matches_the_sampled_trajectory(run) -> None:
    family, req, records, _ = run
    sigmas = req.schedule.sigmas.double()
    for before, after in zip(records, records[1:], strict=False):
        i, k = before["step"], after["step"]
        velocity = (after["latents"].double() - before["latents"].double()) / (sigmas[k] - sigmas[i])
        expected = before["latents"].double() - sigmas[i] * velocity
        diff = (after["x0"].double() - expected).abs().max().item()
        scale = expected.abs().max().item()
        print(f"{family}: x0 after step {k}: max abs diff {diff:.2e} (latent scale {scale:.2f})")
        assert diff <= 1e-4 * max(scale, 1.0)
    assert torch.equal(records[-1]["x0"], records[-1]["latents"])  # sigma is 0 after the last step


def test_previews_have_the_output_size_and_end_on_the_final_image(run) -> None:
    family, _, records, finals = run
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert [image.size for image in record["previews"]] == [(WIDTH, HEIGHT)] * 2
        assert [image.size for image in record["pooled"]] == [(WIDTH, HEIGHT)] * 2
    for preview, pooled, final in zip(records[-1]["previews"], records[-1]["pooled"], finals, strict=True):
        assert np.array_equal(np.asarray(preview), np.asarray(final))
        value = psnr(pooled, final)
        print(f"{family}: last preview from 2x-pooled latents vs the final image: PSNR {value:.2f} dB")
        assert value >= POOLED_MIN_PSNR
    first = [psnr(p, f) for p, f in zip(records[0]["previews"], finals, strict=True)]
    print(f"{family}: first preview (step 1 of {STEPS}) vs the final image: PSNR {min(first):.2f} dB")


def test_pool_factor_bounds_the_decoded_pixels() -> None:
    assert pool_factor(1024, 1024) == 1  # decoded at full size up to the cap
    assert pool_factor(1328, 1328) == 2  # Qwen-Image's default size
    assert pool_factor(2048, 2048) == 2
    assert pool_factor(2048, 4096) == 3
    assert pool_factor(64, 48, max_pixels=64 * 48 // 4) == 2
    for height, width in ((1024, 1024), (1536, 640), (1328, 1328), (3072, 2048)):
        s = pool_factor(height, width)
        assert (height / s) * (width / s) <= PREVIEW_MAX_PIXELS
        assert s == 1 or (height / (s - 1)) * (width / (s - 1)) > PREVIEW_MAX_PIXELS


def test_wan_previews_the_first_frame_from_unipc_data_prediction(tmp_path) -> None:
    """Wan samples with UniPC, whose step is not an Euler move: x0 comes from its history, and must be
    the data prediction of the step just taken, `x_{k-1} - sigma_{k-1} * v_{k-1}`. The preview is the
    video's first frame (exact: the causal VAE decodes it from the first latent frame alone)."""
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    model_dir = build_tiny_wan(tmp_path / "wan", TinyWanSpec(scheduler="unipc"))
    generator = DiffGenerator.from_pretrained(model_dir, device="cpu", show_progress=False)
    params = SamplingParams(
        prompt="a red fox", width=WIDTH, height=HEIGHT, num_frames=5, seed=3, num_inference_steps=STEPS
    )
    records = []

    def on_step(req: Req) -> None:
        records.append(
            (
                req.latents.double().clone(),
                req.last_prediction.double().clone(),
                predicted_clean_latents(req).double(),
                generator.pipeline.preview_images(req),
            )
        )

    req = Req(params=params, on_step=on_step)
    out = generator.generate_from_params(params, request=req)
    sigmas = req.schedule.sigmas.double()
    for step, (before, after) in enumerate(zip(records, records[1:], strict=False), start=1):
        expected = before[0] - sigmas[step] * after[1]
        assert (after[2] - expected).abs().max().item() <= 1e-4 * max(expected.abs().max().item(), 1.0)
    assert [image.size for image in records[-1][3]] == [(WIDTH, HEIGHT)]
    assert np.array_equal(np.asarray(records[-1][3][0]), out.frames[0][0])
