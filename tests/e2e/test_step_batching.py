"""Step-level batching at the pipeline level: requests with different seeds, step counts, guidance
and CFG on/off share denoising steps (joining and leaving at different steps), and each one's image
is what it would have been alone (batch invariance: max abs pixel diff <= 1, PSNR >= 45 dB)."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import DiffGenerator, SamplingParams
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import denoise_joining

#: (family builder, three requests' extra params: different steps / guidance / CFG on and off)
CASES = {
    "flux": (
        "diffserve.families.flux.tiny:build_tiny_flux",
        [
            {"num_inference_steps": 4, "guidance_scale": 3.5},
            {
                "num_inference_steps": 3,
                "guidance_scale": 1.0,
                "true_cfg_scale": 3.0,
                "negative_prompt": "ugly",
            },
            {"num_inference_steps": 5, "guidance_scale": 5.0, "num_outputs_per_prompt": 2},
        ],
    ),
    "qwen-image": (
        "diffserve.families.qwen_image.tiny:build_tiny_qwen_image",
        [
            {"num_inference_steps": 4, "true_cfg_scale": 4.0, "negative_prompt": "blurry"},
            {"num_inference_steps": 3, "true_cfg_scale": 1.0},
            {
                "num_inference_steps": 5,
                "true_cfg_scale": 2.0,
                "negative_prompt": " a much longer negative prompt",
            },
        ],
    ),
    "longcat-image": (
        "diffserve.families.longcat_image.tiny:build_tiny_longcat_image",
        [
            {"num_inference_steps": 4, "guidance_scale": 4.5},
            {"num_inference_steps": 3, "guidance_scale": 1.0},
            {
                "num_inference_steps": 5,
                "guidance_scale": 3.0,
                "negative_prompt": "blurry",
                "num_outputs_per_prompt": 2,
            },
        ],
    ),
    "z-image": (
        "diffserve.families.z_image.tiny:build_tiny_zimage",
        [
            {"num_inference_steps": 4, "guidance_scale": 4.0},
            {"num_inference_steps": 3, "guidance_scale": 0.0},
            {"num_inference_steps": 5, "guidance_scale": 2.0, "negative_prompt": "blurry and dark"},
        ],
    ),
    "chroma": (
        "diffserve.families.chroma.tiny:build_tiny_chroma",
        [
            {"num_inference_steps": 4, "guidance_scale": 4.0, "max_sequence_length": 32},
            {"num_inference_steps": 3, "guidance_scale": 1.0, "max_sequence_length": 32},
            {
                "num_inference_steps": 5,
                "guidance_scale": 2.0,
                "negative_prompt": "blurry and dark",
                "num_outputs_per_prompt": 2,
                "max_sequence_length": 32,
            },
        ],
    ),
}
PROMPTS = ["a red fox", "a blue bird on a branch", "a green tree"]


def _build(target: str, out_dir):
    import importlib

    module_name, function = target.split(":")
    return getattr(importlib.import_module(module_name), function)(out_dir)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    builder, extras = CASES[request.param]
    root = _build(builder, tmp_path_factory.mktemp(request.param))
    gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, batch_policy="throughput")
    return request.param, gen, extras


def _params(extras: list[dict]) -> list[SamplingParams]:
    return [
        SamplingParams(prompt=prompt, height=32, width=48, seed=10 + i, **extra)
        for i, (prompt, extra) in enumerate(zip(PROMPTS, extras, strict=True))
    ]


def test_batched_steps_give_the_images_each_request_gets_alone(case) -> None:
    family, gen, extras = case
    params = _params(extras)
    alone = [gen.generate_from_params(p).images for p in params]
    done = denoise_joining(gen.pipeline, _params(extras), join_after=[0, 0, 2])  # the third joins mid-way
    by_prompt = {prompt: r.outputs.images for prompt, r in done.items()}
    for p, expected in zip(params, alone, strict=True):
        got = np.stack([np.asarray(im) for im in by_prompt[p.prompt]])
        want = np.stack([np.asarray(im) for im in expected])
        diff = int(np.abs(got.astype(int) - want.astype(int)).max())
        value = psnr(got, want)
        print(f"{family} {p.prompt!r}: batched vs alone max diff {diff}, PSNR {value:.1f} dB")
        assert diff <= 1 and value >= 45.0


def test_transposed_sizes_with_equal_token_counts_do_not_share_a_batch(tmp_path) -> None:
    """48x80 and 80x48 FLUX latents pack to the same (tokens, channels) shape but have other position
    ids: they must run in separate DiT batches, each equal to its own run."""
    from diffserve.families.flux.tiny import build_tiny_flux

    gen = DiffGenerator.from_pretrained(build_tiny_flux(tmp_path / "flux"), device="cpu", show_progress=False)
    params = [
        SamplingParams(prompt="a red fox", seed=1, height=48, width=80, num_inference_steps=3),
        SamplingParams(prompt="a red fox", seed=1, height=80, width=48, num_inference_steps=3),
    ]
    alone = [np.asarray(gen.generate_many([p])[0].images[0]) for p in params]
    counts = gen.engine.scheduler.batch_size_counts
    shared_before = sum(n for size, n in counts.items() if size >= 2)
    together = [np.asarray(out.images[0]) for out in gen.generate_many(params)]
    assert sum(n for size, n in counts.items() if size >= 2) == shared_before
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a, b)
