"""Weight-only quantization (`--quantization int8|fp8`, loader/quantize.py): on every native family the
quantized generation stays close to the full-precision one of the same folder and repeats exactly; the
DiT's resident weight bytes drop to about a quarter of float32; bad modes are clear errors; the CLI flag
runs end to end; a LoRA on a quantized DiT is refused."""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from diffserve import DiffGenerator
from diffserve.cli.main import main
from diffserve.errors import LoraError, UserError
from diffserve.families.chroma.tiny import build_tiny_chroma
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.families.hidream.tiny import build_tiny_hidream
from diffserve.families.hunyuan_image.tiny import TinyHunyuanImageSpec, build_tiny_hunyuan_image
from diffserve.families.hunyuan_video.image_to_video_tiny import build_tiny_hunyuan_video_i2v
from diffserve.families.hunyuan_video.tiny import build_tiny_hunyuan_video
from diffserve.families.longcat_image.tiny import build_tiny_longcat_image
from diffserve.families.mochi.tiny import build_tiny_mochi
from diffserve.families.qwen_image.tiny import build_tiny_qwen_image
from diffserve.families.qwen_image21.tiny import TinyQwenImage21Spec, build_tiny_qwen_image21
from diffserve.families.sana_video.tiny import build_tiny_sana_video
from diffserve.families.sd3.tiny import build_tiny_sd3
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.families.wan.tiny import build_tiny_wan
from diffserve.families.z_image.tiny import build_tiny_zimage
from diffserve.layers.quantized_linear import QuantizedLinear
from diffserve.loader.quantize import quantizable_linears, quantize_dit, tensor_bytes
from diffserve.models.dits.chroma import ChromaTransformer2DModel
from diffserve.models.dits.cogvideox import CogVideoXTransformer3DModel
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.dits.hidream_image import HiDreamImageTransformer2DModel
from diffserve.models.dits.hunyuan_image import HunyuanImageTransformer2DModel
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformer3DModel
from diffserve.models.dits.mochi import MochiTransformer3DModel
from diffserve.models.dits.qwen_image import QwenImageTransformer2DModel
from diffserve.models.dits.qwen_image21 import QwenImage21Transformer2DModel
from diffserve.models.dits.sd3 import SD3Transformer2DModel
from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.models.dits.z_image import ZImageTransformer2DModel
from diffserve.registry import DIT_FACTS
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import gradient_image
from diffserve.testing.tiny_lora import write_random_lora

#: PSNR of the whole generation against full precision. int8: the issue's bar. fp8: measured 43-57 dB
#: on these tiny checkpoints (e4m3 keeps 3 mantissa bits against int8's ~7), asserted with a margin.
PSNR_BARS_DB = {"int8": 30.0, "fp8": 35.0}
#: The issue's bar for int8: the DiT's parameter + buffer bytes against the same DiT in float32.
MAX_INT8_BYTES_FRACTION = 0.30

BUILDERS = {
    "sd3": build_tiny_sd3,
    "qwen_image": build_tiny_qwen_image,
    "z_image": build_tiny_zimage,
    "wan": build_tiny_wan,
    # SkyReels-V2's diffusion-forcing DiT: Wan's with the fps embedding and projection kept in full precision.
    "skyreels_v2_df": lambda out: build_tiny_skyreels_v2(out, TinySkyReelsV2Spec(diffusion_forcing=True)),
    "chroma": build_tiny_chroma,
    "longcat_image": build_tiny_longcat_image,
    "sana_video": build_tiny_sana_video,
    # The tiny builders noise every DiT weight by N(0, 0.2), ten times a real checkpoint's ~0.02: that
    # amplifies e4m3's rounding to 31 dB (Qwen-Image 2.1) and 34 dB (CogVideoX 1.5) for fp8, int8 46-48 dB.
    # N(0, 0.15) / N(0, 0.1) still leave the text mattering and give 42 / 50 dB (int8 54 / 57 dB).
    "qwen_image21": lambda out: build_tiny_qwen_image21(out, TinyQwenImage21Spec(dit_weight_noise=0.15)),
    # CogVideoX 1.5: its patch embedder is a Linear (1.0's a Conv), kept in full precision
    "cogvideox": lambda out: build_tiny_cogvideox(
        out, TinyCogVideoXSpec(variant="1.5", dit_weight_noise=0.1)
    ),
    "mochi": build_tiny_mochi,
    "hunyuan_video": build_tiny_hunyuan_video,
    # its DiT with the image-to-video ("token_replace") blocks
    "hunyuan_video_i2v": build_tiny_hunyuan_video_i2v,
    # the MoE DiT: every routed and shared expert's Linears are quantized
    "hidream": build_tiny_hidream,
    # The tiny builder noises every DiT weight by N(0, 1), far above a real checkpoint's ~0.02: that
    # amplifies e4m3's rounding to 31-37 dB for fp8 (int8 44-47 dB); N(0, 0.5) still leaves the text
    # mattering and gives 53-54 dB.
    "hunyuan_image": lambda out: build_tiny_hunyuan_image(out, TinyHunyuanImageSpec(dit_weight_noise=0.5)),
}


@pytest.fixture(
    scope="module",
    params=[
        "flux",
        "sd3",
        "qwen_image",
        "z_image",
        "wan",
        "skyreels_v2_df",
        "chroma",
        "longcat_image",
        "sana_video",
        "qwen_image21",
        "cogvideox",
        "mochi",
        "hunyuan_video",
        "hunyuan_video_i2v",
        "hidream",
        "hunyuan_image",
    ],
)
def family_folder(request, tmp_path_factory) -> tuple[str, Path]:
    if request.param == "flux":
        return "flux", request.getfixturevalue("tiny_flux_dir")
    return request.param, BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def _generate(gen: DiffGenerator, family: str) -> np.ndarray:
    kwargs = dict(prompt="a red fox in the snow", seed=42, height=64, width=64, num_inference_steps=2)
    if family in ("wan", "skyreels_v2_df", "hunyuan_video", "cogvideox"):
        return np.stack(gen.generate(num_frames=5, **kwargs).frames)
    if family == "hunyuan_video_i2v":
        return np.stack(
            gen.generate(num_frames=5, image=gradient_image(width=64, height=64), **kwargs).frames
        )
    if family == "mochi":  # Mochi takes 6k + 1 frames
        return np.stack(gen.generate(num_frames=7, **kwargs).frames)
    if family == "sana_video":  # its 480p aspect-ratio bins are too large for a quick test
        extra = {"use_resolution_binning": False}
        return np.stack(gen.generate(num_frames=5, extra=extra, **kwargs).frames)
    return np.stack([np.asarray(image) for image in gen.generate(**kwargs).images])


def _load(folder: Path, quantization: str | None) -> DiffGenerator:
    return DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False, quantization=quantization)


def test_quantized_generation_is_close_to_full_precision_and_repeatable(family_folder) -> None:
    family, folder = family_folder
    full = _generate(_load(folder, None), family)
    assert full.std() > 5, "the full-precision output is flat; the comparison would prove nothing"
    for mode in ("int8", "fp8"):
        gen = _load(folder, mode)
        dit = gen.pipeline.context.get("transformer")
        dit_class = type(dit).diffusers_class_name
        quantized = [m for m in dit.modules() if isinstance(m, QuantizedLinear)]
        assert quantized and {m.mode for m in quantized} == {mode}
        assert quantizable_linears(dit, dit_class, DIT_FACTS) == [], (
            "a block Linear was left in full precision"
        )
        kept = [n for n, m in dit.named_modules() if type(m) is nn.Linear]
        assert all(n.split(".")[0] in DIT_FACTS.full_precision_modules(dit_class) for n in kept)
        out = _generate(gen, family)
        value = psnr(out, full)
        print(f"{family} {mode}: {len(quantized)} Linears quantized, {len(kept)} kept; PSNR {value:.2f} dB")
        assert not np.array_equal(out, full), "the quantized weights changed nothing: were they used?"
        assert value >= PSNR_BARS_DB[mode]
        assert np.array_equal(_generate(gen, family), out), "a second quantized generation differs"


#: Published DiT configs (the native classes' defaults are FLUX.1's, Qwen-Image's, Z-Image-Turbo's and
#: Wan 2.1 T2V 14B's; SD3.5-large overrides SD3-medium's).
PUBLISHED_DITS: dict[str, tuple[type[nn.Module], dict]] = {
    "FLUX.1-dev": (FluxTransformer2DModel, {"guidance_embeds": True}),
    "SD3.5-large": (
        SD3Transformer2DModel,
        {
            "num_layers": 38,
            "num_attention_heads": 38,
            "caption_projection_dim": 2432,
            "qk_norm": "rms_norm",
            "pos_embed_max_size": 192,
        },
    ),  # fmt: skip
    "Qwen-Image": (QwenImageTransformer2DModel, {}),
    "Z-Image-Turbo": (ZImageTransformer2DModel, {}),
    "Wan2.1-T2V-14B": (WanTransformer3DModel, {}),
    "Chroma1-HD": (ChromaTransformer2DModel, {}),
    # Diffusers' defaults: Qwen-Image 2.1's and Mochi 1's configs; CogVideoX-2B's, made 5B's here
    "Qwen-Image-2.1": (QwenImage21Transformer2DModel, {}),
    "CogVideoX-5B": (
        CogVideoXTransformer3DModel,
        {"num_attention_heads": 48, "num_layers": 42, "use_rotary_positional_embeddings": True},
    ),
    "Mochi-1": (MochiTransformer3DModel, {}),
    "HunyuanVideo": (HunyuanVideoTransformer3DModel, {}),
    "HunyuanImage-2.1": (HunyuanImageTransformer2DModel, {}),
    "HiDream-I1-Full": (
        HiDreamImageTransformer2DModel,
        {
            "patch_size": 2,
            "num_layers": 16,
            "num_single_layers": 32,
            "attention_head_dim": 128,
            "num_attention_heads": 20,
            "caption_channels": [4096, 4096],
            "text_emb_dim": 2048,
            "num_routed_experts": 4,
            "num_activated_experts": 2,
            "axes_dims_rope": [64, 32, 32],
            "max_resolution": [128, 128],
            "llama_layers": list(range(32)) + [31] * 16,
        },
    ),  # fmt: skip
}


def test_int8_weight_bytes_of_published_dits_are_under_30_percent_of_float32() -> None:
    """Each published DiT built on the meta device (shapes and dtypes, no memory), quantized by the same
    code as a loaded one; its parameter + buffer bytes counted before (float32) and after."""
    for name, (cls, config) in PUBLISHED_DITS.items():
        with torch.device("meta"):
            dit = cls.from_config(config)
        params = sum(p.numel() for p in dit.parameters())
        before = tensor_bytes(dit)
        quantize_dit(dit, "int8", cls.diffusers_class_name, DIT_FACTS)
        after = tensor_bytes(dit)
        print(
            f"{name}: {params / 1e9:.2f}B params, float32 {before / 2**30:.1f} GiB -> int8 "
            f"{after / 2**30:.2f} GiB ({after / before:.1%})"
        )
        assert after <= MAX_INT8_BYTES_FRACTION * before


def test_int8_frees_the_float32_weights_of_a_loaded_flux_dit() -> None:
    """Real tensors: a FLUX-architecture DiT of width 384 (6 heads x 64; 2 double-, 4 single-stream
    blocks), in float32, fused as the loader does, so that its blocks dominate its bytes as in FLUX.1 (the
    printed figures give the split). The replaced float32 weights must be freed, not merely unlisted."""
    torch.manual_seed(0)
    dit = FluxTransformer2DModel.from_config(
        {"num_layers": 2, "num_single_layers": 4, "attention_head_dim": 64, "num_attention_heads": 6,
         "joint_attention_dim": 64, "pooled_projection_dim": 64, "guidance_embeds": True,
         "axes_dims_rope": [8, 28, 28]}
    )  # fmt: skip
    dit.fuse_for_inference()
    targets = quantizable_linears(dit, "FluxTransformer2DModel", DIT_FACTS)
    freed = [weakref.ref(linear.weight) for _, linear in targets]
    target_bytes = sum(tensor_bytes(linear) for _, linear in targets)
    del targets
    before = tensor_bytes(dit)
    quantize_dit(dit, "int8", "FluxTransformer2DModel", DIT_FACTS)
    after = tensor_bytes(dit)
    gc.collect()
    assert all(ref() is None for ref in freed), "a replaced float32 weight is still referenced"
    quantized_bytes = sum(tensor_bytes(m) for m in dit.modules() if isinstance(m, QuantizedLinear))
    kept_bytes = before - target_bytes
    print(
        f"FLUX width 384: DiT {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({after / before:.1%}); "
        f"quantized Linears {target_bytes / 2**20:.1f} -> {quantized_bytes / 2**20:.1f} MiB "
        f"({quantized_bytes / target_bytes:.1%}), full precision kept {kept_bytes / 2**20:.1f} MiB"
    )
    assert after == kept_bytes + quantized_bytes
    assert after <= MAX_INT8_BYTES_FRACTION * before


def test_unsupported_modes_and_models_are_clear_errors(tiny_flux_dir) -> None:
    with pytest.raises(UserError, match="int8, fp8"):
        DiffGenerator.from_pretrained(tiny_flux_dir, device="cpu", show_progress=False, quantization="int4")
    layer = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(UserError, match="int8, fp8"):
        quantize_dit(layer, "nf4", "FluxTransformer2DModel", DIT_FACTS)
    with pytest.raises(UserError, match="not supported for MyTransformer"):
        quantize_dit(layer, "int8", "MyTransformer", DIT_FACTS)


@pytest.fixture
def cli_logging():
    """`main` reconfigures the root logger onto the captured stderr: put the previous handlers back after,
    so later tests do not log into a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_cli_generate_with_quantization(tiny_flux_dir, tmp_path, capfd, cli_logging) -> None:
    code = main(
        ["generate", "--model-path", str(tiny_flux_dir), "--quantization", "int8", "--prompt", "a red fox",
         "--height", "32", "--width", "32", "--num-inference-steps", "2", "--seed", "1",
         "--output-path", str(tmp_path)]
    )  # fmt: skip
    log = capfd.readouterr().err
    assert code == 0, log
    assert len(list(tmp_path.glob("*.png"))) == 1
    assert "int8 weight-only quantization of" in log


def test_lora_on_a_quantized_dit_is_a_lora_error(tiny_flux_dir, tmp_path) -> None:
    lora = write_random_lora(tiny_flux_dir, tmp_path / "style.safetensors")
    gen = _load(tiny_flux_dir, "int8")
    with pytest.raises(
        LoraError, match=r"computes with quantized weights \(int8 x \d+ layers: --quantization"
    ):
        gen.load_lora("style", lora)


def test_both_experts_of_a_wan22_a14b_folder_are_quantized(tmp_path) -> None:
    from diffserve.families.wan.tiny import TinyWanSpec

    folder = build_tiny_wan(tmp_path / "a14b", TinyWanSpec(variant="2.2-a14b"))
    context = _load(folder, "int8").pipeline.context
    for name in ("transformer", "transformer_2"):
        linears = [m for m in context.get(name).modules() if isinstance(m, QuantizedLinear)]
        assert linears, f"{name} has no quantized linear"
