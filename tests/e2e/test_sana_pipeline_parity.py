"""Whole SANA generations: diffserve against Diffusers' SanaPipeline, same tiny folder and seed.

The folder's DiT has sample_size 16, so both sides snap sizes to SANA's 512 px aspect-ratio bins and
resize the images back (64x96 is generated at 416x608); the scheduler is the flow DPM-Solver++ SANA
ships, and prompts go through SANA's complex human instruction (Diffusers' defaults throughout).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import SanaPipeline
from sana_text_checks import prompt_and_negative_encodings

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError, UserError
from diffserve.families.sana.tiny import build_tiny_sana
from diffserve.testing.parity import (
    assert_generation_matches,
    assert_images_match,
    diffusers_uint8,
    generator_and_reference,
    stack_uint8,
)

PSNR_BAR_DB = 40.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = build_tiny_sana(tmp_path_factory.mktemp("sana"))
    return generator_and_reference(DiffGenerator, root, SanaPipeline)


@pytest.mark.parametrize(
    ("height", "width", "steps", "n", "extra"),
    [
        # CFG with a negative prompt (lower-cased, as the prompt, by both), two outputs; binned
        # 64x96 -> 416x608 and back.
        (64, 96, 2, 2, {"guidance_scale": 4.5, "negative_prompt": "Blurry, dark"}),
        # No CFG; 3 steps reach DPM-Solver++'s second-order update; binned 96x64 -> 608x416.
        (96, 64, 3, 1, {"guidance_scale": 1.0}),
    ],
)
def test_sana_pixels_match_diffusers(engines, height, width, steps, n, extra) -> None:
    ours, reference = engines
    prompt = "A red Fox in the snow"
    kwargs = dict(height=height, width=width, num_inference_steps=steps, **extra)
    label = f"SANA {height}x{width} n={n} {extra}"
    assert_generation_matches(
        ours, reference, label, min_db=PSNR_BAR_DB, prompt=prompt, seed=3, num_outputs_per_prompt=n, **kwargs
    )


def test_sana_text_encoding_matches_diffusers(engines) -> None:
    """The prompt after the instruction and the bare negative prompt: Diffusers' real tokens, no padding."""
    ours, reference = engines
    stage = ours.pipeline.stages[1]
    instruction = list(ours.pipeline.config.complex_human_instruction)
    for msl in (300, 6):  # 6: the prompt and the negative prompt are both truncated
        encodings = prompt_and_negative_encodings(stage, reference, instruction, msl)
        for got, want, mask in encodings:
            real = int(mask.sum())
            assert bool(mask[0, :real].all()) and got.shape == (1, real, want.shape[-1])
            torch.testing.assert_close(got, want[:, :real], rtol=0, atol=0)
        (prompt, _, _), (negative, _, _) = encodings
        print(
            f"max_sequence_length {msl}: prompt keeps {prompt.shape[1]} tokens, negative {negative.shape[1]}"
        )


def test_requests_with_different_text_lengths_share_a_step_and_match_diffusers(engines) -> None:
    """Two CFG requests whose prompts (and negative prompts) differ in length run their steps as one DiT
    batch (text padded and masked); each image still matches Diffusers' for that request alone."""
    ours, reference = engines
    params = [
        SamplingParams(
            prompt="a cat", seed=5, height=64, width=96, num_inference_steps=2, guidance_scale=4.0
        ),
        SamplingParams(
            prompt="a much longer prompt about a small boat on a calm lake at dawn",
            negative_prompt="low quality, blurry",
            seed=6,
            height=64,
            width=96,
            num_inference_steps=2,
            guidance_scale=5.0,
        ),
    ]
    counts = ours.engine.scheduler.batch_size_counts
    shared_before = sum(n for size, n in counts.items() if size >= 2)
    outputs = ours.generate_many(params)
    assert sum(n for size, n in counts.items() if size >= 2) > shared_before
    for p, out in zip(params, outputs, strict=True):
        kwargs = dict(
            height=p.height,
            width=p.width,
            num_inference_steps=p.num_inference_steps,
            guidance_scale=p.guidance_scale,
            negative_prompt=p.negative_prompt or "",
        )
        ref = diffusers_uint8(reference, seed=p.seed, prompt=p.prompt, num_images_per_prompt=1, **kwargs)
        label = f"SANA batched {p.prompt[:12]!r}"
        assert_images_match(stack_uint8(out.images), ref, label, min_db=PSNR_BAR_DB, shape=(1, 64, 96, 3))


def test_sana_any_size_with_binning_and_multiples_without_match_diffusers(engines) -> None:
    """With resolution binning (the default) Diffusers takes any size: 100x150 is generated at the 416x608
    bin and resized back. `extra={"use_resolution_binning": False}` (Diffusers' keyword) generates at the
    size asked, which must then be a multiple of 32 (refused otherwise, as Diffusers does)."""
    ours, reference = engines
    kwargs = dict(num_inference_steps=2, guidance_scale=4.5)
    prompt = "A red Fox in the snow"
    assert_generation_matches(
        ours, reference, "SANA binned 100x150", min_db=PSNR_BAR_DB, prompt=prompt, seed=4, height=100, width=150,
        **kwargs,
    )  # fmt: skip
    got = stack_uint8(
        ours.generate(
            prompt=prompt, seed=4, height=64, width=32, extra={"use_resolution_binning": False}, **kwargs
        ).images
    )
    want = diffusers_uint8(
        reference, seed=4, prompt=prompt, height=64, width=32, use_resolution_binning=False, **kwargs
    )
    assert_images_match(got, want, "SANA unbinned 64x32", min_db=PSNR_BAR_DB, shape=(1, 64, 32, 3))
    with pytest.raises(
        InvalidRequestError, match=r"width=150 is not a multiple of 32.*use_resolution_binning"
    ) as info:
        ours.generate(prompt=prompt, height=96, width=150, extra={"use_resolution_binning": False}, **kwargs)
    assert info.value.param == "width"


def test_a_dpm_solver_with_dynamic_shifting_keeps_its_flow_shift_as_diffusers(tmp_path) -> None:
    """SanaPipeline passes no mu: DPM-Solver with use_dynamic_shifting=True keeps its static flow_shift (in
    Diffusers too), so the folder loads and matches; FlowMatchEuler, which needs a mu, is refused at load."""
    import json

    root = build_tiny_sana(tmp_path / "sana")
    config_path = root / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_dynamic_shifting": True}))
    ours, reference = generator_and_reference(DiffGenerator, root, SanaPipeline)
    assert_generation_matches(
        ours, reference, "SANA DPM use_dynamic_shifting", min_db=PSNR_BAR_DB, prompt="a fox", seed=1,
        height=64, width=64, num_inference_steps=2, guidance_scale=1.0,
    )  # fmt: skip
    ours.close()
    euler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "use_dynamic_shifting": True}
    config_path.write_text(json.dumps(euler))
    index_path = root / "model_index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(
        json.dumps({**index, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]})
    )
    with pytest.raises(UserError, match="use_dynamic_shifting=True is not supported"):
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
