"""Native DC-AE against Diffusers' `AutoencoderDC` on the same tiny random weights (fp32).

`sana` mirrors `dc-ae-f32c32-sana-1.x` at small width: ResBlock then EfficientViT stages (one with a
5x5 multi-scale branch), stride-2 conv down ("Conv", as the released config spells it) and
interpolate + conv up. `in_mix` mirrors the ImageNet/mix DC-AEs: no first-stage layers, BatchNorm/ReLU
decoder stages, pixel (un)shuffle resampling.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_vaes import DC_STAGES

from diffserve.models.vaes.autoencoder_dc import AutoencoderDC
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    parity_pair,
    perturb_parameters,
)

diffusers = pytest.importorskip("diffusers")

MAX_ABS = 1e-4
MIN_COS = 0.9999

SANA_STYLE: dict[str, Any] = {
    **DC_STAGES,
    "in_channels": 3,
    "encoder_layers_per_block": [1, 1, 2],
    "decoder_layers_per_block": [1, 2, 1],
    "scaling_factor": 0.41407,
}
IN_MIX_STYLE: dict[str, Any] = {
    **SANA_STYLE,
    "encoder_layers_per_block": [0, 1, 1],
    "decoder_layers_per_block": [0, 1, 1],
    "encoder_qkv_multiscales": [[], [], []],
    "decoder_qkv_multiscales": [[], [], []],
    "downsample_block_type": "pixel_unshuffle",
    "upsample_block_type": "pixel_shuffle",
    "decoder_norm_types": ["batch_norm", "batch_norm", "rms_norm"],
    "decoder_act_fns": ["relu", "relu", "silu"],
    "scaling_factor": 1.0,
}
CONFIGS = {"sana": SANA_STYLE, "in_mix": IN_MIX_STYLE}


def _perturb(ref: torch.nn.Module) -> None:
    """Norm weights start at one and biases at zero, BatchNorm statistics at 0/1: perturb them all."""
    perturb_parameters(ref, 0.1)
    for name, b in ref.named_buffers():
        if name.endswith("running_mean"):
            b.normal_(0.0, 0.2)
        elif name.endswith("running_var"):
            b.uniform_(0.5, 1.5)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, AutoencoderDC]:
    return parity_pair(diffusers.AutoencoderDC, AutoencoderDC, CONFIGS[request.param], perturb=_perturb)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_parity(got, want, f"dc-ae parity {name}", max_abs=MAX_ABS, min_cos=MIN_COS)


def test_state_dict_keys_and_config(pair: tuple[torch.nn.Module, AutoencoderDC]) -> None:
    ref, native = pair
    assert_same_state_dict_layout(native, ref)
    assert native.spatial_compression_ratio == ref.spatial_compression_ratio == 4
    assert native.config["scaling_factor"] == ref.config.scaling_factor
    assert set(native.config) == {k for k in ref.config if not k.startswith("_")}


@torch.no_grad()
@pytest.mark.parametrize("height,width", [(32, 48), (8, 16)])
def test_encode_matches(pair: tuple[torch.nn.Module, AutoencoderDC], height: int, width: int) -> None:
    """32x48 runs every EfficientViT stage with linear attention; 8x16 gives the deepest stage 2x4 = 8
    tokens <= head_dim, Diffusers' quadratic form."""
    ref, native = pair
    x = torch.rand(2, 3, height, width, generator=torch.Generator().manual_seed(1)) * 2 - 1
    want = ref.encode(x).latent
    got = native.encode(x)
    assert got.shape == (2, 8, height // 4, width // 4)
    _compare(f"encode {height}x{width}", got, want)


@torch.no_grad()
@pytest.mark.parametrize("height,width", [(8, 12), (2, 4)])
def test_decode_matches(pair: tuple[torch.nn.Module, AutoencoderDC], height: int, width: int) -> None:
    ref, native = pair
    z = torch.randn(2, 8, height, width, generator=torch.Generator().manual_seed(2))
    want = ref.decode(z).sample
    got = native.decode(z)
    assert got.shape == (2, 3, height * 4, width * 4)
    _compare(f"decode {height}x{width}", got, want)


#: `mit-han-lab/dc-ae-f32c32-sana-1.1-diffusers` (and 1.0): Diffusers' conversion script's config.
RELEASED_SANA_DC_AE: dict[str, Any] = {
    "latent_channels": 32,
    "encoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    "decoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    "encoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "decoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "encoder_layers_per_block": [2, 2, 2, 3, 3, 3],
    "decoder_layers_per_block": [3, 3, 3, 3, 3, 3],
    "encoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
    "decoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
    "downsample_block_type": "Conv",
    "upsample_block_type": "interpolate",
    "scaling_factor": 0.41407,
}


def test_released_sana_config_has_diffusers_keys() -> None:
    with torch.device("meta"):
        ref = diffusers.AutoencoderDC(**RELEASED_SANA_DC_AE)
        native = AutoencoderDC.from_config(dict(ref.config))
    assert_same_state_dict_layout(native, ref)
    assert native.spatial_compression_ratio == 32


def test_unsupported_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="block type 'AttnBlock'"), torch.device("meta"):
        AutoencoderDC(encoder_block_types="AttnBlock")
    with pytest.raises(ValueError, match="decoder_norm_types 'layer_norm'"), torch.device("meta"):
        AutoencoderDC(decoder_norm_types="layer_norm")
    with pytest.raises(ValueError, match="upsample_block_type 'bilinear'"), torch.device("meta"):
        AutoencoderDC(upsample_block_type="bilinear")
    with pytest.raises(ValueError, match="unknown keys.*not_a_key"):
        AutoencoderDC.from_config({"not_a_key": 1})
    with pytest.raises(ValueError, match="multiples of 32"), torch.device("meta"):
        AutoencoderDC().encode(torch.empty(1, 3, 48, 64))
