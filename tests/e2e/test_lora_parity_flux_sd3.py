"""LoRA parity with Diffusers for FLUX.1 and SD3 / SD3.5 (issue 19): whole generations of diffserve's
per-request adapters against Diffusers' `load_lora_weights` + `set_adapters(names, weights)` on the same
tiny folder and seed, PSNR >= 40 dB, for one LoRA, two LoRAs at different (one negative) scales and a
kohya-format file; each LoRA must visibly change the image, so the comparison proves something. After
the LoRA requests, a request without adapters is diffserve's base image bit for bit and Diffusers' base.

FLUX kohya files: Diffusers' converter hard-codes FLUX.1's single-block `linear1` widths (3 x 3072 +
12288), which no tiny model has, so its reference for those modules is Diffusers' own rule written out
here (a shared down factor times alpha / rank, up rows split as q, k, v, MLP); every other module goes
through Diffusers' converter. SD3: Diffusers has no kohya conversion and silently loads nothing from
such a file; diffserve refuses it with a clear error instead, which is what the SD3 kohya test checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from safetensors.torch import load_file, save_file

from diffserve import DiffGenerator
from diffserve.errors import LoraError
from diffserve.families.sd3.tiny import TinySD3Spec, build_tiny_sd3
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import assert_images_match, diffusers_uint8
from diffserve.testing.tiny_lora import write_random_lora
from diffserve.testing.tiny_lora_kohya import SINGLE_LINEAR1, KohyaNaming, write_random_kohya_flux_lora

PSNR_BAR_DB = 40.0
#: A LoRA must move the image at least this far from the base (mean absolute 8-bit difference).
MIN_LORA_EFFECT = 3.0
EVERY_LINEAR = re.compile(r"")
#: Diffusers' converter of `lora_transformer_` files maps only attention modules (it sends the others,
#: `ff_net_0_proj`, `proj_mlp`, `norm1_linear`, ..., to the block itself and then fails), so the file
#: holds only attention modules.
ATTENTION_ONLY = re.compile(r"_attn_")
PROMPT = "a red fox in the snow"
FLUX_KWARGS = dict(height=64, width=64, num_inference_steps=3, guidance_scale=3.5, max_sequence_length=32)
SD3_KWARGS = dict(height=64, width=64, num_inference_steps=3, guidance_scale=5.0, max_sequence_length=24)
SEED = 11

Adapters = list[tuple[str, float]]
Reference = FluxPipeline | StableDiffusion3Pipeline


class _Pair:
    """diffserve's generator and Diffusers' pipeline on one folder (`label` names it in messages), with
    the same adapters loaded, and each one's base image from before any adapter was loaded."""

    def __init__(self, label: str, ours: DiffGenerator, reference: Reference, kwargs: dict) -> None:
        self.label, self.ours, self.reference, self.kwargs = label, ours, reference, kwargs
        self.ours_base = self.run_ours([])
        self.reference_base = self.run_reference([])

    def run_ours(self, adapters: Adapters) -> np.ndarray:
        loras = [{"name": name, "scale": scale} for name, scale in adapters]
        out = self.ours.generate(prompt=PROMPT, seed=SEED, loras=loras, **self.kwargs)
        return np.asarray(out.images[0])

    def run_reference(self, adapters: Adapters) -> np.ndarray:
        if adapters:
            self.reference.enable_lora()
            self.reference.set_adapters([n for n, _ in adapters], adapter_weights=[s for _, s in adapters])
        elif self.reference.get_list_adapters():
            self.reference.disable_lora()
        return diffusers_uint8(self.reference, seed=SEED, prompt=PROMPT, **self.kwargs)[0]

    def check_parity(self, case: str, adapters: Adapters) -> None:
        ours, ref = self.run_ours(adapters), self.run_reference(adapters)
        assert ours.shape == ref.shape
        effect = float(np.abs(ours.astype(np.int16) - self.ours_base).mean())
        ref_effect = float(np.abs(ref.astype(np.int16) - self.reference_base).mean())
        print(
            f"{self.label} {case} {adapters}: mean change vs base {effect:.1f} (diffusers {ref_effect:.1f})"
        )
        assert effect >= MIN_LORA_EFFECT and ref_effect >= MIN_LORA_EFFECT, (
            "the LoRA barely changes the image"
        )
        assert_images_match(ours, ref, f"{self.label} {case} {adapters}", min_db=PSNR_BAR_DB)

    def check_base_untouched(self, some_adapter: str) -> None:
        self.run_ours([(some_adapter, 0.8)])  # a LoRA request right before, whatever ran earlier
        ours = self.run_ours([])
        assert np.array_equal(ours, self.ours_base), "a request without adapters must be the base image"
        ref = self.run_reference([])
        assert np.array_equal(ref, self.reference_base), "Diffusers' disabled adapters should give its base"
        assert_images_match(ours, ref, f"{self.label} base after LoRA requests", min_db=PSNR_BAR_DB)


# ---------------------------------------------------------------------------------------------- FLUX


def _kohya_reference_state_dict(reference: FluxPipeline, kohya_file: Path, tmp: Path) -> dict:
    """Diffusers' conversion of a kohya FLUX file, with the single blocks' `linear1` converted by
    Diffusers' rule for the tiny model's widths (its converter only knows FLUX.1's)."""
    state = load_file(str(kohya_file))
    linear1 = {k: v for k, v in state.items() if f"_{SINGLE_LINEAR1}." in k}
    rest = {k: v for k, v in state.items() if k not in linear1}
    save_file(rest, str(tmp / "kohya_without_linear1.safetensors"))
    converted = reference.lora_state_dict(str(tmp / "kohya_without_linear1.safetensors"))
    assert not any(k.startswith("lora_") for k in converted), "Diffusers left kohya keys unconverted"
    stems = {k.split(".", 1)[0] for k in linear1}
    for stem in stems:
        index = int(stem.removeprefix("lora_unet_single_blocks_").split("_")[0])
        block = reference.transformer.single_transformer_blocks[index]
        down, up = linear1[f"{stem}.lora_down.weight"], linear1[f"{stem}.lora_up.weight"]
        alpha = float(linear1[f"{stem}.alpha"])
        dims = [block.attn.to_q.out_features] * 3 + [block.proj_mlp.out_features]
        parts = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
        for part, rows in zip(parts, torch.split(up, dims, dim=0), strict=True):
            converted[f"transformer.single_transformer_blocks.{index}.{part}.lora_A.weight"] = (
                down * alpha / down.shape[0]
            )
            converted[f"transformer.single_transformer_blocks.{index}.{part}.lora_B.weight"] = rows
    return converted


@pytest.fixture(scope="module")
def flux(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Pair]:
    tmp = tmp_path_factory.mktemp("flux-loras")
    files = {
        # every Linear of the blocks: fused-in-BFL q/k/v, proj_mlp / proj_out, the adaLN norm Linears
        "style": write_random_lora(
            tiny_flux_dir, tmp / "style.safetensors", rank=4, alpha=8.0, seed=21, std=0.15
        ),
        # every Linear of the DiT, the embedders and final layer too; no metadata: alpha = rank
        "detail": write_random_lora(
            tiny_flux_dir, tmp / "detail.safetensors", rank=2, seed=22, std=0.15, pattern=EVERY_LINEAR
        ),
        "kohya": write_random_kohya_flux_lora(
            tiny_flux_dir,
            tmp / "kohya.safetensors",
            rank=6,
            alpha=3.0,
            seed=23,
            std=0.3,
            block_diagonal_qkv=True,
        ),
        "mixture": write_random_kohya_flux_lora(
            tiny_flux_dir,
            tmp / "mixture.safetensors",
            rank=4,
            alpha=10.0,
            seed=24,
            std=0.15,
            naming=KohyaNaming.DIFFUSERS,
            pattern=ATTENTION_ONLY,
        ),
    }
    pair = _Pair(
        "FLUX",
        DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False),
        FluxPipeline.from_pretrained(tiny_flux_dir, torch_dtype=torch.float32),
        FLUX_KWARGS,
    )
    for name, path in files.items():
        pair.ours.load_lora(name, path)
        source = _kohya_reference_state_dict(pair.reference, path, tmp) if name == "kohya" else str(path)
        pair.reference.load_lora_weights(source, adapter_name=name)
    yield pair
    pair.ours.close()


@pytest.mark.parametrize(
    ("label", "adapters"),
    [
        ("one LoRA", [("style", 0.8)]),
        ("two LoRAs", [("style", 0.8), ("detail", -0.5)]),
        ("kohya BFL names", [("kohya", 0.8)]),
        ("kohya Diffusers names", [("mixture", 0.7), ("style", 0.5)]),
    ],
)
def test_flux_lora_matches_diffusers(flux: _Pair, label: str, adapters: Adapters) -> None:
    flux.check_parity(label, adapters)


def test_flux_adapters_wrap_the_modules_diffusers_wraps(flux: _Pair) -> None:
    """Each file is read in its own format and lands on as many Linears as Diffusers gives it (the
    kohya file's fused q/k/v and `linear1` split into 3 and 4 targets)."""
    ours = {info.name: info for info in flux.ours.loras()}
    formats = {name: info.format for name, info in ours.items()}
    assert formats == {
        "style": "diffusers",
        "detail": "diffusers",
        "kohya": "flux-kohya",
        "mixture": "flux-kohya-diffusers-names",
    }
    for name, info in ours.items():
        wrapped = [
            path
            for path, module in flux.reference.transformer.named_modules()
            if name in getattr(module, "lora_A", {})
        ]
        assert info.targets == len(wrapped), name


def test_flux_kohya_comparison_sees_the_alpha(flux: _Pair, tmp_path: Path, tiny_flux_dir: Path) -> None:
    """The kohya parity is not blind to alpha: the same factors with alpha = rank (scale 1, not 0.5)
    are far from Diffusers' image of the real file."""
    same_factors = write_random_kohya_flux_lora(
        tiny_flux_dir,
        tmp_path / "k.safetensors",
        rank=6,
        alpha=6.0,
        seed=23,
        std=0.3,
        block_diagonal_qkv=True,
    )
    flux.ours.load_lora("kohya-alpha-is-rank", same_factors)
    try:
        ours = flux.run_ours([("kohya-alpha-is-rank", 0.8)])
    finally:
        flux.ours.unload_lora("kohya-alpha-is-rank")
    value = psnr(ours, flux.run_reference([("kohya", 0.8)]))
    print(f"FLUX kohya with alpha = rank vs Diffusers' alpha = rank / 2: PSNR {value:.2f} dB")
    assert value < PSNR_BAR_DB - 10


def test_flux_base_is_untouched_after_lora_requests(flux: _Pair) -> None:
    flux.check_base_untouched("kohya")


# ---------------------------------------------------------------------------------------------- SD3


def _write_sd3_kohya(out_file: Path, seed: int) -> Path:
    """A kohya sd-scripts style SD3 LoRA (`lora_unet_joint_blocks_0_x_block_attn_qkv`): a layout
    Diffusers' SD3 loader does not convert."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight": torch.randn(4, 32, generator=g),
        "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": torch.randn(96, 4, generator=g),
        "lora_unet_joint_blocks_0_x_block_attn_qkv.alpha": torch.tensor(2.0),
    }
    save_file(tensors, str(out_file))
    return out_file


@pytest.fixture(scope="module", params=["sd3", "sd35"])
def sd3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Pair]:
    spec = (
        TinySD3Spec()
        if request.param == "sd3"
        else TinySD3Spec(qk_norm="rms_norm", dual_attention_layers=(0,))
    )
    tmp = tmp_path_factory.mktemp(request.param)
    root = build_tiny_sd3(tmp / "model", spec)
    files = {
        "style": write_random_lora(root, tmp / "style.safetensors", rank=4, alpha=2.0, seed=31, std=0.3),
        "detail": write_random_lora(
            root, tmp / "detail.safetensors", rank=2, seed=32, std=0.15, pattern=EVERY_LINEAR
        ),
    }
    pair = _Pair(
        request.param,
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False),
        StableDiffusion3Pipeline.from_pretrained(root, torch_dtype=torch.float32),
        SD3_KWARGS,
    )
    for name, path in files.items():
        pair.ours.load_lora(name, path)
        pair.reference.load_lora_weights(str(path), adapter_name=name)
    yield pair
    pair.ours.close()


@pytest.mark.parametrize(
    ("label", "adapters"), [("one LoRA", [("style", 0.8)]), ("two LoRAs", [("style", 0.8), ("detail", -0.5)])]
)
def test_sd3_lora_matches_diffusers(sd3: _Pair, label: str, adapters: Adapters) -> None:
    sd3.check_parity(label, adapters)


def test_sd3_kohya_file_is_a_clear_error_where_diffusers_loads_nothing(sd3: _Pair, tmp_path: Path) -> None:
    kohya_file = _write_sd3_kohya(tmp_path / "kohya.safetensors", seed=33)
    sd3.reference.load_lora_weights(str(kohya_file), adapter_name="kohya")
    loaded = sd3.reference.get_list_adapters()
    assert all("kohya" not in names for names in loaded.values()), (
        f"Diffusers now loads kohya SD3 files ({loaded}): diffserve should convert them too"
    )
    with pytest.raises(
        LoraError, match=r"kohya-format LoRA files are not supported for SD3Transformer2DModel"
    ):
        sd3.ours.load_lora("kohya", kohya_file)
    assert "kohya" not in [info.name for info in sd3.ours.loras()]


def test_sd3_base_is_untouched_after_lora_requests(sd3: _Pair) -> None:
    sd3.check_base_untouched("style")
