"""Native SANA DiT against Diffusers' `SanaTransformer2DModel` on the same tiny random weights (fp32).

Covers SANA 1.0 (no QK-norm), SANA 1.5 (`rms_norm_across_heads`), SANA-Sprint (guidance embedding +
QK-norm) and the 2K/4K checkpoints' sincos positions, on non-square latents, batch 2 with the text
padding of one row masked.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sana_dit_checks import (
    assert_embedded_context_is_exact,
    assert_unsupported_options_refused,
    half_precision_outputs,
    masked_batch_inputs,
    second_row_unpadded,
)

from diffserve.models.dits.sana import SanaTransformer2DModel, SanaTransformerConfig
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")
from diffusers import SanaTransformer2DModel as DiffusersSana  # noqa: E402

MAX_ABS = 1e-4
MIN_COS = 0.9999

TINY_CONFIG: dict[str, Any] = {
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 2,
    "num_cross_attention_heads": 2,
    "cross_attention_head_dim": 16,
    "cross_attention_dim": 32,
    "caption_channels": 24,
    "mlp_ratio": 2.5,
    "sample_size": 8,
    "patch_size": 1,
}

VARIANTS: dict[str, dict[str, Any]] = {
    "sana_1.0": {},
    "sana_1.5": {"qk_norm": "rms_norm_across_heads"},
    "sprint": {"qk_norm": "rms_norm_across_heads", "guidance_embeds": True},
    "sincos_patch2": {"interpolation_scale": 1.0, "patch_size": 2, "attention_bias": True},
    "affine_norm": {"norm_elementwise_affine": True, "out_channels": 16},
}


def _pair(variant: str) -> tuple[torch.nn.Module, SanaTransformer2DModel]:
    """A seeded Diffusers model and the native model loaded from its state dict through the meta device,
    every tensor perturbed (norm weights start at one, biases at zero) so a misrouted weight shows."""
    return parity_pair(
        DiffusersSana, SanaTransformer2DModel, {**TINY_CONFIG, **VARIANTS[variant]}, perturb=0.1
    )


def _inputs(guidance: bool, height: int = 6, width: int = 10, text_len: int = 7) -> dict[str, torch.Tensor]:
    latent_shape = (TINY_CONFIG["in_channels"], height, width)
    return masked_batch_inputs(latent_shape, TINY_CONFIG["caption_channels"], guidance, text_len)


def _compare(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_parity(got, want, f"sana dit parity {label}", max_abs=MAX_ABS, min_cos=MIN_COS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_forward_matches_diffusers(variant: str) -> None:
    ref, ours = _pair(variant)
    assert_same_state_dict_layout(ours, ref)
    inputs = _inputs(guidance=bool(ours.config.guidance_embeds))
    want = ref(**inputs, return_dict=False)[0]
    got = ours(**inputs)
    _compare(variant, got, want)
    assert ours.hidden_width == 32

    # Text embedded once per request gives the same output.
    assert_embedded_context_is_exact(ours, inputs, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["sprint", "sincos_patch2"])
@torch.no_grad()
def test_half_precision_close_to_diffusers(variant: str, dtype: torch.dtype) -> None:
    """Same weights in bf16/fp16: the dtype handling (fp32 linear attention, fp32 sincos add, mask bias
    dtype) is Diffusers'. Not bit-exact: Diffusers' residual stream keeps the patch embedding's
    transposed layout, and CPU half-precision matmuls round a strided input differently."""
    ref, ours = _pair(variant)
    got, want = half_precision_outputs(ref, ours, _inputs(guidance=bool(ours.config.guidance_embeds)), dtype)
    assert_parity(got, want, f"sana dit parity {variant} {dtype}", max_abs=0.1, min_cos=MIN_COS)


RELEASED: dict[str, dict[str, Any]] = {
    "sana_1.0_600m_1024": {
        "num_attention_heads": 36,
        "num_cross_attention_heads": 16,
        "cross_attention_head_dim": 72,
        "cross_attention_dim": 1152,
        "num_layers": 28,
    },
    "sana_1.0_1600m_4k": {"interpolation_scale": 2.0, "sample_size": 128},
    "sana_1.5_4800m": {"num_layers": 60, "qk_norm": "rms_norm_across_heads"},
    "sana_sprint_1600m": {"qk_norm": "rms_norm_across_heads", "guidance_embeds": True},
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_configs_have_diffusers_keys(name: str) -> None:
    """The released checkpoints' configs (Diffusers' conversion script) build, on meta, with exactly
    Diffusers' state-dict keys and shapes."""
    config = {"caption_channels": 2304, "sample_size": 32, "attention_bias": False, **RELEASED[name]}
    with torch.device("meta"):
        ref = DiffusersSana(**config)
        ours = SanaTransformer2DModel.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)


@torch.no_grad()
def test_mask_changes_only_the_masked_row_and_matches_unpadded() -> None:
    """Masked padding contributes nothing (up to exp(-10000) = 0): the masked row equals its unpadded run."""
    ref, ours = _pair("sana_1.5")
    inputs = _inputs(guidance=False)
    full = ours(**inputs)
    unpadded = second_row_unpadded(ours, inputs)
    _compare("masked row vs unpadded", full[1:], unpadded)
    unmasked = ours(**{**inputs, "encoder_attention_mask": None})
    torch.testing.assert_close(unmasked[0], full[0], rtol=0, atol=0)
    assert (unmasked[1] - full[1]).abs().max() > 1e-3


@torch.no_grad()
def test_timestep_of_length_one_broadcasts() -> None:
    ref, ours = _pair("sana_1.0")
    inputs = _inputs(guidance=False)
    one = ours(**{**inputs, "timestep": torch.tensor([500.0])})
    both = ours(**{**inputs, "timestep": torch.tensor([500.0, 500.0])})
    torch.testing.assert_close(one, both, rtol=0, atol=0)


def test_guidance_must_match_the_config() -> None:
    _, plain = _pair("sana_1.0")
    _, sprint = _pair("sprint")
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        plain(**_inputs(guidance=True))
    with pytest.raises(ValueError, match="guidance_embeds=True"):
        sprint(**_inputs(guidance=False))


def test_unsupported_options_are_clear_errors() -> None:
    assert_unsupported_options_refused(SanaTransformerConfig, SanaTransformer2DModel)
    with torch.device("meta"):
        model = SanaTransformer2DModel.from_config({"_class_name": "SanaTransformer2DModel", "num_layers": 1})
    assert model.hidden_width == 2240
