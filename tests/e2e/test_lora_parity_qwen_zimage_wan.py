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

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    QwenImagePipeline,
    SkyReelsV2Pipeline,
    WanImageToVideoPipeline,
    WanPipeline,
    ZImagePipeline,
)
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from diffserve import DiffGenerator
from diffserve.families.qwen_image.tiny import build_tiny_qwen_image
from diffserve.families.wan.skyreels_v2_tiny import build_tiny_skyreels_v2
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import assert_images_match, diffusers_uint8, gradient_image, stack_uint8
from diffserve.testing.tiny_lora import write_random_lora
from diffserve.testing.tiny_lora_original import (
    FileModule,
    Layout,
    Suffix,
    qwen_image_modules,
    wan_modules,
    write_original_lora,
    z_image_modules,
)

PSNR_BAR_DB = 40.0
#: A LoRA output must be further than this from the base output (and the second adapter's output from
#: the first's alone), so that matching Diffusers at PSNR_BAR_DB shows the adapter was applied right.
CHANGED_BAR_DB = 32.0
PROMPT = "a red fox in the snow"
SEED = 3
RANK = 4
#: The `.alpha` of the non-Diffusers files' modules, in turn: none equals RANK, and they differ per module.
ALPHAS = (2.0, 8.0, 3.0)
STD = 0.2  # of the random LoRA factors: large enough that every adapter visibly changes the output
ONE = (("a", 0.8),)
TWO = (("a", 0.8), ("b", 0.5))
OriginalFiles = Callable[[Path, Path], dict[str, Path]]


def _qwen_image_files(root: Path, out: Path) -> dict[str, Path]:
    modules = qwen_image_modules(root)
    return {
        "kohya": _write(modules, out / "kohya.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=11),
        "diffusion_model": _write(
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
        "kohya": _write(modules, out / "kohya.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=11),
        "diffusion_model": _write(
            modules, out / "dm.safetensors", Layout.DIFFUSION_MODEL, Suffix.A_B, seed=12
        ),
        # Z-Image's original tree: one fused `attention.qkv` and `attention.out` (the kohya form mold
        # documents; Diffusers' converter reads `lora_down` there as the dotted `lora.down`) ...
        "kohya_fused_qkv": _write(fused, out / "fused.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=13),
        # ... and under `diffusion_model.`, where Diffusers splits `qkv` only with the dotted spelling
        "diffusion_model_fused_qkv": _write(
            fused, out / "dm_fused.safetensors", Layout.DIFFUSION_MODEL, Suffix.DOTTED, seed=14
        ),
    }


def _wan_files(root: Path, out: Path) -> dict[str, Path]:
    return {
        # musubi-tuner: every Linear of the blocks (all of which Diffusers requires), each with an alpha
        "musubi": _write(
            wan_modules(root, blocks_only=True),
            out / "musubi.safetensors",
            Layout.KOHYA,
            Suffix.DOWN_UP,
            seed=11,
        ),
        # original names everywhere, alphas in the blocks (the only ones Diffusers' converter accepts)
        "diffusion_model": _write(
            wan_modules(root), out / "dm.safetensors", Layout.DIFFUSION_MODEL, Suffix.A_B, seed=12
        ),
    }


def _write(modules: list[FileModule], path: Path, layout: Layout, suffix: Suffix, seed: int) -> Path:
    return write_original_lora(modules, path, layout, suffix, rank=RANK, alphas=ALPHAS, seed=seed, std=STD)


@dataclass(frozen=True)
class Family:
    """How to build, run and LoRA-load one family; `request`: generation arguments both sides take."""

    build: Callable[[Path], Path]
    reference: Callable[[Path], DiffusionPipeline]
    original_files: OriginalFiles
    #: the names `original_files` gives its files (the test ids), in order
    originals: tuple[str, ...]
    request: dict[str, object]
    video: bool = False


FAMILIES: dict[str, Family] = {
    "qwen-image": Family(
        build_tiny_qwen_image,
        lambda root: QwenImagePipeline.from_pretrained(root, torch_dtype=torch.float32),
        _qwen_image_files,
        ("kohya", "diffusion_model"),
        dict(
            height=32, width=48, num_inference_steps=2, max_sequence_length=64,
            true_cfg_scale=4.0, negative_prompt="blurry",
        ),
    ),
    "z-image": Family(
        build_tiny_zimage,
        lambda root: ZImagePipeline.from_pretrained(root, torch_dtype=torch.float32),
        _z_image_files,
        ("kohya", "diffusion_model", "kohya_fused_qkv", "diffusion_model_fused_qkv"),
        dict(
            height=32, width=48, num_inference_steps=2, max_sequence_length=64,
            guidance_scale=4.0, negative_prompt="blurry",
        ),
    ),
    "wan-t2v": Family(
        build_tiny_wan,
        lambda root: WanPipeline.from_pretrained(root, torch_dtype=torch.float32),
        _wan_files,
        ("musubi", "diffusion_model"),
        dict(
            height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=64,
            guidance_scale=5.0, negative_prompt="blurry",
        ),
        video=True,
    ),
    # Diffusers' I2V attention finds the image tokens by assuming 512 text tokens: the default length.
    "wan-i2v": Family(
        lambda out: build_tiny_wan(out, TinyWanSpec(image_to_video=True)),
        lambda root: WanImageToVideoPipeline.from_pretrained(root, torch_dtype=torch.float32),
        _wan_files,
        ("musubi", "diffusion_model"),
        dict(
            height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=5.0,
            negative_prompt="static", image=gradient_image(width=60, height=40),
        ),
        video=True,
    ),
    # SkyReels-V2: Wan 2.1's module names over its own DiT class (float64 timestep sinusoids).
    "skyreels-v2": Family(
        build_tiny_skyreels_v2,
        lambda root: SkyReelsV2Pipeline.from_pretrained(root, torch_dtype=torch.float32),
        _wan_files,
        ("musubi", "diffusion_model"),
        dict(
            height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=64,
            guidance_scale=6.0, negative_prompt="blurry",
        ),
        video=True,
    ),
}  # fmt: skip

Loras = tuple[tuple[str, float], ...]


@dataclass
class Engines:
    """One family's two pipelines with every adapter loaded, and the base outputs of both taken before
    any adapter was; diffserve's LoRA outputs are kept per adapter set (each is generated once)."""

    family: Family
    root: Path
    ours: DiffGenerator
    reference: DiffusionPipeline
    ours_base: np.ndarray
    reference_base: np.ndarray
    _ours_outputs: dict[Loras, np.ndarray] = field(default_factory=dict)

    def run_ours(self, loras: Loras) -> np.ndarray:
        if loras not in self._ours_outputs:
            self._ours_outputs[loras] = _generate(self.ours, self.family, loras)
        return self._ours_outputs[loras]

    def run_reference(self, loras: Loras) -> np.ndarray:
        names = [name for name, _ in loras]
        self.reference.set_adapters(names, adapter_weights=[scale for _, scale in loras])
        return _reference_output(self.reference, self.family)


def _generate(ours: DiffGenerator, family: Family, loras: Loras) -> np.ndarray:
    out = ours.generate(
        prompt=PROMPT, seed=SEED, loras=[{"name": n, "scale": s} for n, s in loras], **family.request
    )
    return stack_uint8(out.frames if family.video else out.images)


def _reference_output(pipe: DiffusionPipeline, family: Family) -> np.ndarray:
    return diffusers_uint8(pipe, seed=SEED, video=family.video, prompt=PROMPT, **family.request)


def _start(name: str, directory: Path) -> Engines:
    """Build `name`'s folder and LoRA files under `directory`, both pipelines, their base outputs, then
    load every adapter into both."""
    family = FAMILIES[name]
    root = family.build(directory / "model")
    loras = directory / "loras"
    files = {
        # PEFT layout, alpha 8 != rank 4 in `lora_adapter_metadata` (scaling 2)
        "a": write_random_lora(root, loras / "a.safetensors", rank=RANK, alpha=8.0, seed=1, std=STD),
        # rank 2, no metadata: alpha = rank (larger factors, so that its share of TWO is large too)
        "b": write_random_lora(root, loras / "b.safetensors", rank=2, seed=2, std=1.5 * STD),
        **family.original_files(root, loras),
    }
    assert tuple(files)[2:] == family.originals
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = family.reference(root)
    reference.set_progress_bar_config(disable=True)
    engines = Engines(
        family, root, ours, reference, _generate(ours, family, ()), _reference_output(reference, family)
    )
    for adapter, path in files.items():
        ours.load_lora(adapter, path)
        reference.load_lora_weights(str(path), adapter_name=adapter)
    return engines


@pytest.fixture(scope="module")
def engines_of(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Engines]]:
    """A family's `Engines`, started on first use and kept for the module: one fixture for every
    family (a parametrized module fixture would be rebuilt for each differently parametrized test)."""
    started: dict[str, Engines] = {}

    def get(name: str) -> Engines:
        if name not in started:
            started[name] = _start(name, tmp_path_factory.mktemp(name))
        return started[name]

    yield get
    for engines in started.values():
        engines.ours.close()


def _cases() -> list:
    cases = []
    for name, family in FAMILIES.items():
        cases.append(pytest.param(name, ONE, id=f"{name}-one"))
        cases.append(pytest.param(name, TWO, id=f"{name}-two"))
        cases.extend(pytest.param(name, ((o, 0.7),), id=f"{name}-{o}") for o in family.originals)
    return cases


@pytest.mark.parametrize(("family", "loras"), _cases())
def test_lora_generation_matches_diffusers(
    engines_of: Callable[[str], Engines], family: str, loras: Loras
) -> None:
    engines = engines_of(family)
    ours = engines.run_ours(loras)
    reference = engines.run_reference(loras)
    assert ours.shape == reference.shape == engines.ours_base.shape
    changed = psnr(ours, engines.ours_base)
    print(f"{loras}: {changed:.2f} dB against the base output")
    assert changed < CHANGED_BAR_DB, "the adapters barely change the output: the comparison proves nothing"
    assert_images_match(ours, reference, f"{loras} against Diffusers", min_db=PSNR_BAR_DB)
    if len(loras) > 1:
        alone = psnr(ours, engines.run_ours(loras[:1]))
        print(f"  against {loras[0][0]} alone: {alone:.2f} dB")
        assert alone < CHANGED_BAR_DB, "the second adapter barely changes the output"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_lora_after_loras_is_the_base_bit_for_bit(
    engines_of: Callable[[str], Engines], family: str
) -> None:
    engines = engines_of(family)
    engines.run_ours(TWO)
    engines.run_ours(((engines.family.originals[0], 0.7),))
    after = _generate(engines.ours, engines.family, ())
    assert np.array_equal(after, engines.ours_base)
    assert_images_match(after, engines.reference_base, "base after LoRA requests", min_db=PSNR_BAR_DB)


def test_z_image_lora_on_the_patch_embedder_matches_diffusers(
    engines_of: Callable[[str], Engines], tmp_path: Path
) -> None:
    """Diffusers applies a LoRA on `all_x_embedder` (kohya files over every Linear have one)."""
    engines = engines_of("z-image")
    modules = [m for m in z_image_modules(engines.root) if m.name.startswith("all_x_embedder")]
    assert modules
    path = _write(modules, tmp_path / "embedder.safetensors", Layout.KOHYA, Suffix.DOWN_UP, seed=15)
    engines.ours.load_lora("embedder", path)
    engines.reference.load_lora_weights(str(path), adapter_name="embedder")
    loras = (("embedder", 0.7),)
    reference = engines.run_reference(loras)
    ours = engines.run_ours(loras)
    assert psnr(ours, engines.ours_base) < CHANGED_BAR_DB
    assert_images_match(ours, reference, "z-image LoRA on the patch embedder", min_db=PSNR_BAR_DB)
