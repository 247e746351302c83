"""Whole generations: diffserve's FLUX pipeline against Diffusers' FluxPipeline on the same folder and seed."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline as DiffusersFluxPipeline

from diffserve import DiffGenerator
from diffserve.testing.parity import assert_generation_matches, generator_and_reference

PSNR_BAR_DB = 40.0


@pytest.fixture(scope="module")
def generators(tiny_flux_dir, tiny_flux_schnell_dir):
    return {
        "dev": (
            DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False),
            DiffusersFluxPipeline.from_pretrained(tiny_flux_dir, torch_dtype=torch.float32),
        ),
        "schnell": (
            DiffGenerator.from_pretrained(tiny_flux_schnell_dir, device="cpu", show_progress=False),
            DiffusersFluxPipeline.from_pretrained(tiny_flux_schnell_dir, torch_dtype=torch.float32),
        ),
    }


CASES = [
    # (variant, height, width, steps, extra kwargs)
    ("dev", 64, 64, 4, {"guidance_scale": 3.5}),
    ("dev", 48, 80, 3, {"guidance_scale": 5.0}),  # non-square
    ("schnell", 64, 64, 4, {}),
    ("schnell", 96, 32, 2, {}),
    ("dev", 64, 48, 3, {"guidance_scale": 3.5, "true_cfg_scale": 4.0, "negative_prompt": "blurry, dark"}),
]


@pytest.mark.parametrize(("variant", "height", "width", "steps", "extra"), CASES)
def test_pixels_match_diffusers(generators, variant, height, width, steps, extra) -> None:
    ours, reference = generators[variant]
    kwargs = dict(height=height, width=width, num_inference_steps=steps, max_sequence_length=32, **extra)
    label = f"{variant} {height}x{width} {extra}"
    prompt = "a red fox in the snow"
    assert_generation_matches(ours, reference, label, min_db=PSNR_BAR_DB, prompt=prompt, seed=42, **kwargs)


def test_num_outputs_per_prompt_matches_diffusers_batch(generators) -> None:
    ours, reference = generators["dev"]
    kwargs = dict(height=32, width=32, num_inference_steps=2, max_sequence_length=16)
    ours_u8 = assert_generation_matches(
        ours, reference, "dev n=2", min_db=PSNR_BAR_DB, prompt="two foxes", seed=7, num_outputs_per_prompt=2,
        **kwargs,
    )  # fmt: skip
    assert not np.array_equal(ours_u8[0], ours_u8[1]), "two outputs of one request must differ"


def test_text_encoding_stage_matches_diffusers(generators) -> None:
    ours, reference = generators["dev"]
    stage = ours.pipeline.stages[1]
    sequence, pooled = stage.encode(["a red fox", "a blue bird"], max_sequence_length=24)
    ref_seq, ref_pooled, ref_ids = reference.encode_prompt(
        prompt=["a red fox", "a blue bird"], prompt_2=None, max_sequence_length=24
    )
    torch.testing.assert_close(sequence, ref_seq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pooled, ref_pooled, rtol=1e-5, atol=1e-5)


def test_initial_noise_matches_diffusers_seed(generators) -> None:
    ours, reference = generators["dev"]
    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.request import Req

    stages = ours.pipeline.stages
    req = Req(params=SamplingParams(prompt="x", height=64, width=48, num_inference_steps=2, seed=123))
    # validation, text encoding, control-image and input-image encoding (no-ops without images), latents
    for stage in stages[:5]:
        req = stage(req, ours.platform)
    ref_latents, ref_ids = reference.prepare_latents(
        1, 16, 64, 48, torch.float32, torch.device("cpu"), torch.Generator("cpu").manual_seed(123)
    )
    assert torch.equal(req.latents, ref_latents)
    assert torch.equal(req.conditioning.image_ids, ref_ids)  # FLUX.1's position ids


def test_a_dit_predicting_patches_of_its_own_matches_diffusers(tiny_flux_dir, tmp_path) -> None:
    """`patch_size` 2 with `out_channels` 16: the DiT still predicts 64 channels per token (2^2 x 16), which
    Diffusers' FluxPipeline runs like `patch_size` 1 (its latents have the DiT's in_channels / 4 channels, the
    VAE's 16). The same weights load; diffserve once took out_channels / 4 = 4 latent channels and failed."""
    folder = tmp_path / "patched"
    shutil.copytree(tiny_flux_dir, folder)
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "patch_size": 2, "out_channels": 16}))
    ours, reference = generator_and_reference(DiffGenerator, folder, DiffusersFluxPipeline)
    kwargs = dict(height=32, width=48, num_inference_steps=2, max_sequence_length=16)
    assert_generation_matches(
        ours, reference, "patch 2 x 16", min_db=PSNR_BAR_DB, prompt="a fox", seed=3, **kwargs
    )
