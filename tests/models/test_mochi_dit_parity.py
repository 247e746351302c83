"""Native Mochi DiT against Diffusers' `MochiTransformer3DModel` on the same tiny random weights: two requests
per forward at different timesteps, with text masks of different lengths (T5's padding left out of the
attention and the pool), at several latent grids; the RoPE frequencies are random, not the zeros they start as."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.mochi import MochiTransformer3DModel, MochiTransformerConfig
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")

MIN_DB = 70.0
TEXT_LEN = 10
TINY: dict[str, Any] = {
    "patch_size": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 2,
    "pooled_projection_dim": 24,
    "in_channels": 4,
    "text_embed_dim": 32,
    "time_embed_dim": 16,
    "max_sequence_length": TEXT_LEN,
}
#: (latent frames, latent height, latent width)
SIZES = [(2, 4, 6), (3, 6, 4), (1, 8, 8)]


def test_config_defaults_are_diffusers() -> None:
    defaults = diffusers_init_defaults(diffusers.MochiTransformer3DModel)
    ours = MochiTransformerConfig()
    assert {k: getattr(ours, k) for k in defaults if k != "out_channels"} == {
        k: v for k, v in defaults.items() if k != "out_channels"
    }


def _pair(layers: int = 2):
    reference, native = parity_pair(
        diffusers.MochiTransformer3DModel, MochiTransformer3DModel, {**TINY, "num_layers": layers}
    )
    with torch.no_grad():
        reference.pos_frequencies.normal_(0, 0.5)
        native.pos_frequencies.copy_(reference.pos_frequencies)
    return reference, native


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("valid", [(TEXT_LEN, 4), (3, 0), (5, 5)])
def test_forward_matches(size: tuple[int, int, int], valid: tuple[int, int]) -> None:
    reference, native = _pair()
    assert_same_state_dict_layout(native, reference)
    frames, height, width = size
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, TINY["in_channels"], frames, height, width, generator=g)
    text = torch.randn(2, TEXT_LEN, TINY["text_embed_dim"], generator=g)
    mask = torch.stack([torch.arange(TEXT_LEN) < n for n in valid])
    t = torch.tensor([12.5, 731.0])
    with torch.no_grad():
        want = reference(x, text, t, mask, return_dict=False)[0]
        got = native(x, text, t, mask)
    assert got.shape == want.shape
    assert_parity(got, want, f"mochi dit {size} {valid}", min_db=MIN_DB)


def test_a_mask_with_holes_matches() -> None:
    """Diffusers takes a sample's valid tokens wherever they are (and writes their outputs first)."""
    reference, native = _pair()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 2, 4, 4, generator=g)
    text = torch.randn(3, TEXT_LEN, 32, generator=g)
    mask = torch.rand(3, TEXT_LEN, generator=g) > 0.4
    t = torch.tensor([10.0, 500.0, 990.0])
    with torch.no_grad():
        want = reference(x, text, t, mask, return_dict=False)[0]
        got = native(x, text, t, mask)
    assert_parity(got, want, "mochi dit, a mask with holes", min_db=MIN_DB)


@pytest.mark.parametrize("valid", [(6, 9), (TEXT_LEN, TEXT_LEN)])
def test_bf16_matches(valid: tuple[int, int]) -> None:
    """In bfloat16 too: the same roundings as Diffusers' (the pool's query, the projections on views of the
    joint output, each text length attended alone)."""
    reference, native = _pair()
    reference, native = reference.to(torch.bfloat16), native.to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, 2, 4, 4, generator=g).bfloat16()
    text = torch.randn(2, TEXT_LEN, 32, generator=g).bfloat16()
    mask = torch.stack([torch.arange(TEXT_LEN) < n for n in valid])
    t = torch.tensor([100.0, 900.0]).bfloat16()
    with torch.no_grad():
        want = reference(x, text, t, mask, return_dict=False)[0]
        got = native(x, text, t, mask)
    assert_parity(got.float(), want.float(), f"mochi dit bf16 {valid}", min_db=MIN_DB)


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        ref = diffusers.MochiTransformer3DModel(num_layers=2)
        ours = MochiTransformer3DModel.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)
