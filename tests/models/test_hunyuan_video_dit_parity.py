"""Native HunyuanVideo DiT against Diffusers' `HunyuanVideoTransformer3DModel` on the same tiny random
weights: two rows per forward at different timesteps and guidance, with text masks of different lengths
(the refiner's (txt, txt) mask and the blocks' count-based key mask), on non-square latent grids; with and
without the guidance embedding."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformer3DModel, HunyuanVideoTransformerConfig
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
)

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0
TEXT_LEN = 9
TINY: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "num_layers": 1,
    "num_single_layers": 2,
    "num_refiner_layers": 1,
    "patch_size": 2,
    "patch_size_t": 1,
    "text_embed_dim": 24,
    "pooled_projection_dim": 12,
    "rope_axes_dim": (4, 6, 6),
}


@pytest.fixture(scope="module", params=[True, False], ids=["guidance", "no-guidance"])
def pair(request):
    return parity_pair(
        diffusers.HunyuanVideoTransformer3DModel,
        HunyuanVideoTransformer3DModel,
        {**TINY, "guidance_embeds": request.param},
    )


def test_config_defaults_are_diffusers() -> None:
    defaults = diffusers_init_defaults(diffusers.HunyuanVideoTransformer3DModel)
    ours = HunyuanVideoTransformerConfig()
    assert {k: getattr(ours, k) for k in defaults} == {
        k: tuple(v) if isinstance(v, list) else v for k, v in defaults.items()
    }


def test_state_dict_layout(pair) -> None:
    reference, native = pair
    assert_same_state_dict_layout(native, reference)


@pytest.mark.parametrize(
    ("size", "valid"),
    [((2, 4, 6), (TEXT_LEN, 4)), ((3, 6, 4), (5, 2)), ((1, 4, 4), (TEXT_LEN, TEXT_LEN))],
)
def test_forward_matches(pair, size: tuple[int, int, int], valid: tuple[int, int]) -> None:
    reference, native = pair
    frames, height, width = size
    g = torch.Generator().manual_seed(sum(size))
    x = torch.randn(2, 4, frames, height, width, generator=g)
    text = torch.randn(2, TEXT_LEN, 24, generator=g)
    mask = torch.stack([torch.arange(TEXT_LEN) < n for n in valid]).float()
    pooled = torch.randn(2, 12, generator=g)
    t = torch.tensor([31.5, 870.0])
    guidance = torch.tensor([6000.0, 3500.0]) if native.config.guidance_embeds else None
    with torch.no_grad():
        want = reference(x, t, text, mask, pooled, guidance, return_dict=False)[0]
        got = native(x, t, text, mask, pooled, guidance)
    assert got.shape == want.shape == x.shape
    db = assert_parity(got, want, f"hunyuan video dit {size} {valid}", min_db=MIN_DB)
    print(f"hunyuan video dit {size} {valid}: {db}")
    # A control: another text moves the output well away.
    with torch.no_grad():
        other = native(x, t, torch.randn(2, TEXT_LEN, 24, generator=g), mask, pooled, guidance)
    assert (other - want).abs().max() > 1e-2


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        ref = diffusers.HunyuanVideoTransformer3DModel(num_layers=1, num_single_layers=1)
        ours = HunyuanVideoTransformer3DModel.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)


def test_image_condition_type_is_refused() -> None:
    with pytest.raises(ValueError, match="image_condition_type"):
        HunyuanVideoTransformerConfig(image_condition_type="token_replace")
