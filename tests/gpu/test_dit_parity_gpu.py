"""bf16 parity of the native DiTs and a VAE against Diffusers on a GPU, on tiny random weights: the same
modules the CPU parity tests (tests/models/) check in fp32, now in the dtype and on the device they serve
in (other kernels: cuBLAS, flash SDPA, fused norms), each within bf16's rounding of Diffusers' output."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.wan import WanTransformer3DModel
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.testing.parity import cosine, max_abs_diff, parity_pair, randomize_norms
from diffserve.testing.tiny_dits import FLUX, QWEN_IMAGE, TINY_CONFIGS, Z_IMAGE, tiny_dit_inputs

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.gpu

#: bf16 keeps 8 bits of mantissa; through a few tiny blocks the outputs stay this aligned with Diffusers'.
MIN_COSINE = 0.998
WAN_T2V: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
    "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None,
    "rope_max_seq_len": 32, "pos_embed_seq_len": None,
}  # fmt: skip
FLUX_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2, "block_out_channels": [32, 64], "layers_per_block": 1,
    "latent_channels": 16, "norm_num_groups": 32, "scaling_factor": 0.3611, "shift_factor": 0.1159,
    "use_quant_conv": False, "use_post_quant_conv": False,
}  # fmt: skip


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else output


def _flat(output: Any) -> torch.Tensor:
    if isinstance(output, list):
        return torch.cat([o.float().flatten() for o in output])
    return output.float().flatten()


def _check(name: str, got: Any, want: Any) -> None:
    got, want = _flat(got), _flat(want)
    assert torch.isfinite(got).all(), f"{name}: non-finite output"
    similarity = cosine(got.cpu(), want.cpu())
    assert similarity >= MIN_COSINE, (
        f"{name}: cosine {similarity:.5f}, max abs diff {max_abs_diff(got.cpu(), want.cpu()):.3g}"
    )


@pytest.mark.parametrize("name", [FLUX, QWEN_IMAGE, Z_IMAGE])
@pytest.mark.parametrize("batch", [1, 2])
def test_dit_matches_diffusers_in_bf16(device: torch.device, name: str, batch: int) -> None:
    native_cls, config = TINY_CONFIGS[name]
    reference, native = parity_pair(getattr(diffusers, name), native_cls, config)
    reference, native = reference.to(device, torch.bfloat16), native.to(device, torch.bfloat16)
    if hasattr(native, "fuse_for_inference"):
        native.fuse_for_inference()
    inputs = tiny_dit_inputs(
        name, batch, 7, ragged=batch > 1 and name != FLUX, device=device, dtype=torch.bfloat16
    )
    with torch.inference_mode():
        want = _first(reference(**inputs, return_dict=False))
        got = native(**inputs)
    _check(f"{name} batch {batch}", got, want)


def test_wan_dit_matches_diffusers_in_bf16(device: torch.device) -> None:
    reference, native = parity_pair(diffusers.WanTransformer3DModel, WanTransformer3DModel, WAN_T2V)
    reference, native = reference.to(device, torch.bfloat16), native.to(device, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 16, 3, 6, 4, generator=g).to(device, torch.bfloat16),
        "timestep": torch.tensor([250.0, 750.0], device=device),
        "encoder_hidden_states": torch.randn(2, 512, 32, generator=g).to(device, torch.bfloat16),
    }
    with torch.inference_mode():
        want = reference(**inputs, return_dict=False)[0]
        got = native(**inputs)
    _check("Wan 2.1 T2V", got, want)


def test_autoencoder_kl_decode_matches_diffusers_in_bf16(device: torch.device) -> None:
    reference, native = parity_pair(diffusers.AutoencoderKL, AutoencoderKL, FLUX_VAE, perturb=randomize_norms)
    reference, native = reference.to(device, torch.bfloat16), native.to(device, torch.bfloat16)
    z = torch.randn(2, 16, 16, 12, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    with torch.inference_mode():
        want = reference.decode(z).sample
        got = native.decode(z)
    _check("AutoencoderKL decode", got, want)
