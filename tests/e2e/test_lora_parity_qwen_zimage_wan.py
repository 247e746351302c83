"""LoRA parity with Diffusers for Qwen-Image, Z-Image and Wan 2.1 (text- and image-to-video): whole
generations of diffserve (`load_lora` + per-request `loras=[...]`) against Diffusers' pipeline
(`load_lora_weights` + `set_adapters(names, weights)`), same tiny folder, seed and size, float32.

Per family: one Diffusers/PEFT-format LoRA at scale 0.8 whose metadata sets alpha != rank; two LoRAs at
different scales; the family's non-Diffusers layouts (kohya / musubi-tuner `lora_unet_` keys and
original-checkpoint `diffusion_model.` keys, per-module `.alpha` != rank), each at PSNR >= 40 dB and
each changing the output far more than that (else the comparison would prove nothing); and after all
that, a request without LoRA equals diffserve's own output from before any adapter was loaded, bit for
bit, and Diffusers' base output. Every generation uses CFG, so the adapters run on two-row batches.
A LoRA on Z-Image's patch embedder (`all_x_embedder`, which embeds every sample's patches at once) has
its own test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from diffusers import (
    QwenImagePipeline,
    SkyReelsV2Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    ZImagePipeline,
)
from lora_suite_tests import engines_fixture, generation_test

from diffserve import DiffGenerator
from diffserve.families.qwen_image.tiny import build_tiny_qwen_image
from diffserve.families.wan.skyreels_v2_tiny import build_tiny_skyreels_v2
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.testing.lora_parity import (
    TWO,
    Engines,
    Family,
    Suite,
    check_adapter_matches,
    check_no_lora_after_loras,
    float32_pipeline,
    write_original,
)
from diffserve.testing.parity import gradient_image
from diffserve.testing.tiny_lora_original import (
    FileModule,
    Layout,
    Suffix,
    qwen_image_modules,
    wan_modules,
    z_image_modules,
)


def _qwen_image_files(root: Path, out: Path) -> dict[str, Path]:
    modules = qwen_image_modules(root)
    return {
        "kohya": write_original(modules, out / "kohya.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=11),
        "diffusion_model": write_original(
            modules, out / "dm.safetensors", Layout.DIFFUSION_MODEL, Suffix.A_B, seed=12
        ),
    }


def _z_image_modules(root: Path, fused_attention: bool) -> list[FileModule]:
    """Every Z-Image Linear."""
    return z_image_modules(root, fused_attention)


def _z_image_files(root: Path, out: Path) -> dict[str, Path]:
    modules = _z_image_modules(root, fused_attention=False)
    fused = _z_image_modules(root, fused_attention=True)
    return {
        "kohya": write_original(modules, out / "kohya.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=11),
        "diffusion_model": write_original(
            modules, out / "dm.safetensors", Layout.DIFFUSION_MODEL, Suffix.A_B, seed=12
        ),
        # Z-Image's original tree: one fused `attention.qkv` and `attention.out` (the kohya form mold
        # documents; Diffusers' converter reads `lora_down` there as the dotted `lora.down`) ...
        "kohya_fused_qkv": write_original(
            fused, out / "fused.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=13
        ),
        # ... and under `diffusion_model.`, where Diffusers splits `qkv` only with the dotted spelling
        "diffusion_model_fused_qkv": write_original(
            fused, out / "dm_fused.safetensors", Layout.DIFFUSION_MODEL, Suffix.DOTTED, seed=14
        ),
    }


def _wan_files(root: Path, out: Path) -> dict[str, Path]:
    return {
        # musubi-tuner: every Linear of the blocks (all of which Diffusers requires), each with an alpha
        "musubi": write_original(
            wan_modules(root, blocks_only=True),
            out / "musubi.safetensors",
            Layout.KOHYA,
            Suffix.DOWN_UP,
            seed=11,
        ),
        # original names everywhere, alphas in the blocks (the only ones Diffusers' converter accepts)
        "diffusion_model": write_original(
            wan_modules(root), out / "dm.safetensors", Layout.DIFFUSION_MODEL, Suffix.A_B, seed=12
        ),
    }


FAMILIES: dict[str, Family] = {
    "qwen-image": Family(
        build_tiny_qwen_image,
        float32_pipeline(QwenImagePipeline),
        dict(
            height=32, width=48, num_inference_steps=2, max_sequence_length=64,
            true_cfg_scale=4.0, negative_prompt="blurry",
        ),
        original_files=_qwen_image_files,
        originals=("kohya", "diffusion_model"),
    ),
    "z-image": Family(
        build_tiny_zimage,
        float32_pipeline(ZImagePipeline),
        dict(
            height=32, width=48, num_inference_steps=2, max_sequence_length=64,
            guidance_scale=4.0, negative_prompt="blurry",
        ),
        original_files=_z_image_files,
        originals=("kohya", "diffusion_model", "kohya_fused_qkv", "diffusion_model_fused_qkv"),
    ),
    "wan-t2v": Family(
        build_tiny_wan,
        float32_pipeline(WanPipeline),
        dict(
            height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=64,
            guidance_scale=5.0, negative_prompt="blurry",
        ),
        original_files=_wan_files,
        originals=("musubi", "diffusion_model"),
        video=True,
    ),
    # Diffusers' I2V attention finds the image tokens by assuming 512 text tokens: the default length.
    "wan-i2v": Family(
        lambda out: build_tiny_wan(out, TinyWanSpec(image_to_video=True)),
        float32_pipeline(WanImageToVideoPipeline),
        dict(
            height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=5.0,
            negative_prompt="static", image=gradient_image(width=60, height=40),
        ),
        original_files=_wan_files,
        originals=("musubi", "diffusion_model"),
        video=True,
    ),
    # SkyReels-V2: Wan 2.1's module names over its own DiT class (float64 timestep sinusoids).
    "skyreels-v2": Family(
        build_tiny_skyreels_v2,
        float32_pipeline(SkyReelsV2Pipeline),
        dict(
            height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=64,
            guidance_scale=6.0, negative_prompt="blurry",
        ),
        original_files=_wan_files,
        originals=("musubi", "diffusion_model"),
        video=True,
    ),
}  # fmt: skip

SUITE = Suite(DiffGenerator, FAMILIES)


engines_of = engines_fixture(SUITE)
test_lora_generation_matches_diffusers = generation_test(SUITE)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_lora_after_loras_is_the_base_bit_for_bit(
    engines_of: Callable[[str], Engines], family: str
) -> None:
    engines = engines_of(family)
    check_no_lora_after_loras(engines, [TWO, ((engines.family.originals[0], 0.7),)])


def test_z_image_lora_on_the_patch_embedder_matches_diffusers(
    engines_of: Callable[[str], Engines], tmp_path: Path
) -> None:
    """Diffusers applies a LoRA on `all_x_embedder` (kohya files over every Linear have one)."""
    engines = engines_of("z-image")
    modules = [m for m in z_image_modules(engines.root) if m.name.startswith("all_x_embedder")]
    assert modules
    path = write_original(modules, tmp_path / "embedder.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=15)
    engines.ours.load_lora("embedder", path)
    engines.reference.load_lora_weights(str(path), adapter_name="embedder")
    loras = (("embedder", 0.7),)
    reference = engines.run_reference(loras)
    ours = engines.run_ours(loras)
    check_adapter_matches(engines, ours, reference, "z-image LoRA on the patch embedder")
