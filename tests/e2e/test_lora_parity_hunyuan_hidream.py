"""LoRA parity with Diffusers for HunyuanVideo (text- and image-to-video) and HiDream-I1: whole generations
of diffserve (`load_lora` + per-request `loras=[...]`) against Diffusers' pipeline (`load_lora_weights` +
`set_adapters(names, weights)`), same tiny folder, seed and size, float32.

Per family: one Diffusers/PEFT-format LoRA at scale 0.8 whose metadata sets alpha != rank; two LoRAs at
different scales; HiDream's `diffusion_model.` files (Diffusers' names under that prefix); each at
PSNR >= 40 dB and each changing the output far more than that (else the comparison would prove nothing);
after all that, a request without LoRA equals diffserve's own output from before any adapter was loaded,
bit for bit. Every generation uses CFG, so the adapters run on two-row batches.

HunyuanImage 2.1 has no LoRA here: Diffusers' `HunyuanImagePipeline` has no LoRA loader; its refusal is
tested, as are the files HunyuanVideo refuses (original checkpoint names). HiDream's routed MoE experts
take adapters too (their tokens gathered from the whole batch): against Diffusers, and batched with a plain
request.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import HiDreamImagePipeline, HunyuanVideoImageToVideoPipeline, HunyuanVideoPipeline
from lora_suite_tests import engines_fixture, generation_test, no_lora_after_loras_test
from safetensors.torch import load_file, save_file

from diffserve import DiffGenerator
from diffserve.configs.sampling_params import LoraChoice, SamplingParams
from diffserve.errors import LoraError
from diffserve.families.hidream.tiny import build_tiny_hidream
from diffserve.families.hunyuan_image.tiny import build_tiny_hunyuan_image
from diffserve.families.hunyuan_video.image_to_video_tiny import build_tiny_hunyuan_video_i2v
from diffserve.families.hunyuan_video.tiny import build_tiny_hunyuan_video
from diffserve.testing import tiny_lora
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.lora_parity import (
    CHANGED_BAR_DB,
    PROMPT,
    RANK,
    SEED,
    STD,
    Engines,
    Family,
    Suite,
    check_adapter_matches,
    float32_pipeline,
)
from diffserve.testing.parity import smooth_random_image, stack_uint8

#: Every Linear of the repeated blocks: HunyuanVideo's double- and single-stream blocks; HiDream's
#: (`double_stream_blocks.0.block.…`) but its routed MoE experts, which the tests below take on their own.
BLOCKS = re.compile(
    r"(^|\.)(transformer_blocks|single_transformer_blocks|\w+_stream_blocks)\.\d+\.(?!block\.ff_i\.experts\.)"
)
ROUTED_EXPERTS = re.compile(r"\.ff_i\.experts\.\d+\.")


def _write_lora(root: Path, out: Path, pattern: re.Pattern[str] = BLOCKS, **kwargs) -> Path:
    """`write_random_lora` over these families' DiTs."""
    return tiny_lora.write_random_lora(root, out, pattern=pattern, **kwargs)


def _diffusion_model_file(root: Path, out: Path, pattern: re.Pattern[str] = BLOCKS) -> Path:
    """A `diffusion_model.`-prefixed file (ComfyUI / ai-toolkit style: Diffusers' module names), which
    Diffusers' HiDream loader reads by stripping the prefix; without `.alpha` tensors (alpha = rank), which
    that loader refuses (every key must name `lora`)."""
    peft = load_file(
        str(
            _write_lora(
                root, out.with_suffix(".peft.safetensors"), pattern, rank=RANK, seed=12, std=1.5 * STD
            )
        )
    )
    tensors = {f"diffusion_model.{key.removeprefix('transformer.')}": t for key, t in peft.items()}
    save_file(tensors, str(out))
    return out


def _hidream_files(root: Path, out: Path) -> dict[str, Path]:
    return {"diffusion_model": _diffusion_model_file(root, out / "dm.safetensors")}


FAMILIES: dict[str, Family] = {
    "hunyuan-video": Family(
        build_tiny_hunyuan_video,
        float32_pipeline(HunyuanVideoPipeline),
        dict(
            height=32, width=48, num_frames=5, num_inference_steps=2, max_sequence_length=40,
            guidance_scale=3.5, true_cfg_scale=4.0, negative_prompt="blurry",
        ),
        video=True,
    ),
    "hunyuan-video-i2v": Family(
        build_tiny_hunyuan_video_i2v,
        float32_pipeline(HunyuanVideoImageToVideoPipeline),
        dict(
            height=32, width=48, num_frames=5, num_inference_steps=2, max_sequence_length=40,
            guidance_scale=3.5, true_cfg_scale=4.0, negative_prompt="blurry",
        ),
        video=True,
        image=smooth_random_image(width=40, height=30, seed=1),
    ),
    "hidream": Family(
        build_tiny_hidream,
        float32_pipeline(HiDreamImagePipeline),
        dict(
            height=32, width=32, num_inference_steps=2, max_sequence_length=24,
            guidance_scale=5.0, negative_prompt="blurry",
        ),
        original_files=_hidream_files,
        originals=("diffusion_model",),
    ),
}  # fmt: skip

# Diffusers' base output is not compared here: a request without LoRA is checked against diffserve's own
SUITE = Suite(DiffGenerator, FAMILIES, a_pattern=BLOCKS, b_pattern=BLOCKS, reference_base=False)


engines_of = engines_fixture(SUITE)
test_lora_generation_matches_diffusers = generation_test(SUITE)
test_no_lora_after_loras_is_the_base_bit_for_bit = no_lora_after_loras_test(SUITE)


def test_hunyuan_image_refuses_lora(tmp_path: Path) -> None:
    """Diffusers' `HunyuanImagePipeline` loads no LoRA: diffserve refuses one naming the DiT."""
    assert not hasattr(__import__("diffusers").HunyuanImagePipeline, "load_lora_weights")
    root = build_tiny_hunyuan_image(tmp_path / "model")
    lora = _write_lora(root, tmp_path / "a.safetensors", rank=RANK, seed=1)
    gen = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    try:
        with pytest.raises(LoraError, match="not supported for HunyuanImageTransformer2DModel"):
            gen.load_lora("a", lora)
    finally:
        gen.close()


@pytest.mark.parametrize("layout", ["diffusers", "diffusion_model"])
def test_hidream_lora_on_routed_experts_matches_diffusers(
    engines_of: Callable[[str], Engines], tmp_path: Path, layout: str
) -> None:
    """An adapter on the routed MoE experts only (`ff_i.experts.<n>.w1|w2|w3`), each of its tokens' expert
    runs gathered from the whole batch: diffserve's output matches Diffusers' and differs from the base."""
    engines = engines_of("hidream")
    name = f"experts-{layout}"
    path = _routed_experts_lora(engines.root, tmp_path / f"{layout}.safetensors", layout)
    engines.ours.load_lora(name, path)
    engines.reference.load_lora_weights(str(path), adapter_name=name)
    try:
        ours = engines.family.generate(engines.ours, ((name, 0.9),))
        reference = engines.run_reference(((name, 0.9),))
        check_adapter_matches(engines, ours, reference, f"routed experts ({layout}) against Diffusers")
    finally:
        engines.ours.unload_lora(name)
        engines.reference.delete_adapters(name)


def test_hidream_routed_expert_lora_rows_share_a_batch_with_plain_rows(
    engines_of: Callable[[str], Engines], tmp_path: Path
) -> None:
    """A request with a routed-expert adapter and one without, in one DiT batch (their tokens routed to
    the same experts together): each equals its own run alone within one uint8 level, so the adapter
    reaches its own request's tokens only."""
    engines = engines_of("hidream")
    path = _routed_experts_lora(engines.root, tmp_path / "experts.safetensors", "diffusers")
    engines.ours.load_lora("experts-mixed", path)
    try:
        request = {**engines.family.request, "prompt": PROMPT, "seed": SEED}
        params = [
            SamplingParams(**request, loras=[LoraChoice("experts-mixed", 0.9)]),
            SamplingParams(**request),
        ]
        together = engines.ours.generate_many([dataclasses.replace(p) for p in params])
        alone = [engines.ours.generate_many([p])[0] for p in params]
    finally:
        engines.ours.unload_lora("experts-mixed")
    for label, got, expected in zip(("with the adapter", "plain"), together, alone, strict=True):
        difference = int(np.abs(stack_uint8(got.images).astype(int) - stack_uint8(expected.images)).max())
        print(f"{label}: batched vs alone, max uint8 difference {difference}")
        assert difference <= 1
    assert np.array_equal(stack_uint8(alone[1].images), engines.ours_base)
    assert psnr(stack_uint8(alone[0].images), engines.ours_base) < CHANGED_BAR_DB


def _routed_experts_lora(root: Path, out: Path, layout: str) -> Path:
    """A random LoRA on the routed experts only, in Diffusers' layout or as a `diffusion_model.` file."""
    if layout == "diffusers":
        return _write_lora(root, out, ROUTED_EXPERTS, rank=RANK, seed=5, std=1.5 * STD)
    return _diffusion_model_file(root, out, ROUTED_EXPERTS)


@pytest.mark.parametrize("prefix", ["diffusion_model.", "transformer.", ""])
def test_hunyuan_video_original_names_are_refused(
    engines_of: Callable[[str], Engines], tmp_path: Path, prefix: str
) -> None:
    """Original-checkpoint names (diffusion-pipe's files), which Diffusers converts, are refused with
    that reason rather than as another family's file."""
    engines = engines_of("hunyuan-video")
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"{prefix}double_blocks.0.img_attn_qkv.lora_A.weight": torch.randn(RANK, 64, generator=g),
        f"{prefix}double_blocks.0.img_attn_qkv.lora_B.weight": torch.randn(192, RANK, generator=g),
    }
    path = tmp_path / "original.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(LoraError, match=r"original checkpoint's names .*img_attn_qkv"):
        engines.ours.load_lora("original", path)
