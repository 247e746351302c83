"""Native HunyuanImage 2.1 DiT against Diffusers' `HunyuanImageTransformer2DModel` on the same tiny random
weights: two rows per forward at different timesteps on a non-square grid, Qwen and ByT5 texts of different
(odd) valid lengths (a row without glyphs too), and the guidance-distilled / MeanFlow variant."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.hunyuan_image import HunyuanImageTransformer2DModel, HunyuanImageTransformerConfig
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0
TEXT_LEN, GLYPH_LEN = 11, 7
TINY: dict[str, Any] = {
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 1,
    "num_single_layers": 1,
    "num_refiner_layers": 1,
    "patch_size": (1, 1),
    "text_embed_dim": 24,
    "text_embed_2_dim": 20,
    "rope_axes_dim": (8, 8),
}


def test_config_defaults_are_diffusers() -> None:
    defaults = diffusers_init_defaults(diffusers.HunyuanImageTransformer2DModel)
    ours = HunyuanImageTransformerConfig()
    assert {k: getattr(ours, k) for k in defaults} == {
        k: tuple(v) if isinstance(v, list) else v for k, v in defaults.items()
    }


def _inputs(g: torch.Generator, text_valid: tuple[int, int], glyph_valid: tuple[int, int]) -> dict:
    return {
        "hidden_states": torch.randn(2, 8, 4, 6, generator=g),
        "timestep": torch.tensor([37.0, 912.5]),
        "encoder_hidden_states": torch.randn(2, TEXT_LEN, 24, generator=g),
        "encoder_attention_mask": torch.stack([torch.arange(TEXT_LEN) < n for n in text_valid]).long(),
        "encoder_hidden_states_2": torch.randn(2, GLYPH_LEN, 20, generator=g),
        "encoder_attention_mask_2": torch.stack([torch.arange(GLYPH_LEN) < n for n in glyph_valid]).long(),
    }


@pytest.mark.parametrize(("text_valid", "glyph_valid"), [((9, 3), (5, 0)), ((5, 5), (0, 0))])
def test_forward_matches(text_valid: tuple[int, int], glyph_valid: tuple[int, int]) -> None:
    reference, native = parity_pair(
        diffusers.HunyuanImageTransformer2DModel, HunyuanImageTransformer2DModel, TINY
    )
    assert_same_state_dict_layout(native, reference)
    inputs = _inputs(torch.Generator().manual_seed(3), text_valid, glyph_valid)
    with torch.no_grad():
        want = reference(**inputs, return_dict=False)[0]
        got = native(**inputs)
        other = native(**{**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"].flip(0)})
    assert got.shape == want.shape == (2, 8, 4, 6)
    assert_parity(got, want, f"HunyuanImage DiT text {text_valid} glyphs {glyph_valid}", min_db=MIN_DB)
    assert (other - want).abs().max() > 1e-3  # the text reaches the output


def test_distilled_meanflow_forward_matches() -> None:
    config = {**TINY, "guidance_embeds": True, "use_meanflow": True, "patch_size": (2, 2)}
    reference, native = parity_pair(
        diffusers.HunyuanImageTransformer2DModel, HunyuanImageTransformer2DModel, config
    )
    assert_same_state_dict_layout(native, reference)
    inputs = _inputs(torch.Generator().manual_seed(4), (7, 11), (3, 1))
    inputs["timestep_r"] = torch.tensor([0.0, 500.0])
    inputs["guidance"] = torch.tensor([3250.0, 4000.0])
    with torch.no_grad():
        want = reference(**inputs, return_dict=False)[0]
        got = native(**inputs)
    assert_parity(got, want, "HunyuanImage distilled MeanFlow DiT", min_db=MIN_DB)


def test_three_dimensional_patches_are_refused() -> None:
    with pytest.raises(ValueError, match="2-D patches"):
        HunyuanImageTransformerConfig(patch_size=(1, 1, 1), rope_axes_dim=(64, 64))
