"""Native SANA-Video DiT against Diffusers' `SanaVideoTransformer3DModel` on the same tiny random weights.

fp32, non-square latents with several latent frames, batch 2 at different timesteps with one row's text
padding masked; with and without QK-norms, the guidance embedding, affine norms and a 1x1 spatial patch.
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

from diffserve.models.dits.sana_video import SanaVideoTransformer3DModel, SanaVideoTransformerConfig
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair

diffusers = pytest.importorskip("diffusers")
from diffusers import SanaVideoTransformer3DModel as DiffusersSanaVideo  # noqa: E402

MAX_ABS = 1e-4
MIN_COS = 0.9999

TINY_CONFIG: dict[str, Any] = {
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 12,  # RoPE: 4 / 4 / 4 over frames / rows / columns
    "num_layers": 2,
    "num_cross_attention_heads": 2,
    "cross_attention_head_dim": 12,
    "cross_attention_dim": 24,
    "caption_channels": 20,
    "mlp_ratio": 2.5,
    "sample_size": 30,
    "patch_size": (1, 2, 2),
}

VARIANTS: dict[str, dict[str, Any]] = {
    "released": {},  # qk_norm rms_norm_across_heads, as the 2B checkpoints
    "no_qk_norm": {"qk_norm": None, "attention_bias": True},
    "guidance": {"guidance_embeds": True},
    "affine_patch1": {"norm_elementwise_affine": True, "patch_size": (1, 1, 1), "out_channels": 16},
}


def _pair(variant: str) -> tuple[torch.nn.Module, SanaVideoTransformer3DModel]:
    return parity_pair(
        DiffusersSanaVideo, SanaVideoTransformer3DModel, {**TINY_CONFIG, **VARIANTS[variant]}, perturb=0.1
    )


def _inputs(guidance: bool, text_len: int = 7) -> dict[str, torch.Tensor]:
    latent_shape = (TINY_CONFIG["in_channels"], 3, 6, 10)
    return masked_batch_inputs(latent_shape, TINY_CONFIG["caption_channels"], guidance, text_len)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@torch.no_grad()
def test_forward_matches_diffusers(variant: str) -> None:
    ref, ours = _pair(variant)
    assert_same_state_dict_layout(ours, ref)
    inputs = _inputs(guidance=bool(ours.config.guidance_embeds))
    want = ref(**inputs, return_dict=False)[0]
    got = ours(**inputs)
    assert got.shape == want.shape
    assert_parity(got, want, f"SANA-Video DiT {variant}", max_abs=MAX_ABS, min_cos=MIN_COS)
    assert ours.hidden_width == 24

    # Text embedded once per request gives the same output.
    assert_embedded_context_is_exact(ours, inputs, got)


@torch.no_grad()
def test_bf16_close_to_diffusers() -> None:
    ref, ours = _pair("released")
    got, want = half_precision_outputs(ref, ours, _inputs(guidance=False), torch.bfloat16)
    assert_parity(got, want, "SANA-Video DiT bf16", max_abs=0.25, min_cos=0.999)


@torch.no_grad()
def test_rows_are_independent_and_the_mask_drops_padding() -> None:
    """A batch row equals its own run; the masked row equals its run on the unpadded text."""
    _, ours = _pair("released")
    inputs = _inputs(guidance=False)
    full = ours(**inputs)
    alone = second_row_unpadded(ours, inputs)
    assert_parity(full[1:], alone, "masked row vs unpadded", max_abs=MAX_ABS, min_cos=MIN_COS)


@pytest.mark.parametrize("name", ["2b_480p", "2b_720p"])
def test_released_configs_have_diffusers_keys(name: str) -> None:
    """The released 2B configs build, on meta, with exactly Diffusers' state-dict keys and shapes."""
    config = {"sample_size": 30 if name == "2b_480p" else 22}
    with torch.device("meta"):
        ref = DiffusersSanaVideo(**config)
        ours = SanaVideoTransformer3DModel.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)
    assert ours.hidden_width == 2240


def test_unsupported_options_are_clear_errors() -> None:
    assert_unsupported_options_refused(SanaVideoTransformerConfig, SanaVideoTransformer3DModel)
