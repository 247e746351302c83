"""Native HunyuanVideo DiT against Diffusers' `HunyuanVideoTransformer3DModel` on the same tiny random
weights: two rows per forward at different timesteps and guidance, with text masks of different lengths
(the refiner's (txt, txt) mask and the blocks' count-based key mask), on non-square latent grids; with and
without the guidance embedding, and the image-to-video DiTs ("latent_concat": 2C + 1 input channels;
"token_replace": the first frame's tokens modulated at timestep 0)."""

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


#: (guidance_embeds, image_condition_type, in_channels): text-to-video with and without the guidance
#: embedding, and both image-to-video DiTs (as released: token_replace guidance-distilled, latent_concat not).
VARIANTS = {
    "guidance": (True, None, 4),
    "no-guidance": (False, None, 4),
    "token-replace": (True, "token_replace", 4),
    "latent-concat": (False, "latent_concat", 9),
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    guidance_embeds, condition, in_channels = VARIANTS[request.param]
    return parity_pair(
        diffusers.HunyuanVideoTransformer3DModel,
        HunyuanVideoTransformer3DModel,
        {
            **TINY,
            "guidance_embeds": guidance_embeds,
            "image_condition_type": condition,
            "in_channels": in_channels,
        },
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
    x = torch.randn(2, native.config.in_channels, frames, height, width, generator=g)
    text = torch.randn(2, TEXT_LEN, 24, generator=g)
    mask = torch.stack([torch.arange(TEXT_LEN) < n for n in valid]).float()
    pooled = torch.randn(2, 12, generator=g)
    t = torch.tensor([31.5, 870.0])
    guidance = torch.tensor([6000.0, 3500.0]) if native.config.guidance_embeds else None
    with torch.no_grad():
        want = reference(x, t, text, mask, pooled, guidance, return_dict=False)[0]
        got = native(x, t, text, mask, pooled, guidance)
    assert got.shape == want.shape == (2, 4, frames, height, width)
    label = f"hunyuan video dit {native.config.image_condition_type} {size} {valid}"
    db = assert_parity(got, want, label, min_db=MIN_DB)
    print(f"{label}: {db}")
    # A control: another text moves the output well away.
    with torch.no_grad():
        other = native(x, t, torch.randn(2, TEXT_LEN, 24, generator=g), mask, pooled, guidance)
    assert (other - want).abs().max() > 1e-2


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        ref = diffusers.HunyuanVideoTransformer3DModel(num_layers=1, num_single_layers=1)
        ours = HunyuanVideoTransformer3DModel.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)


def test_token_replace_modulates_the_other_frames_by_the_timestep() -> None:
    """A control of the token-replace path: the row's timestep still moves the frames after the first."""
    native = HunyuanVideoTransformer3DModel.from_config({**TINY, "image_condition_type": "token_replace"})
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 4, 2, 4, 4, generator=g)
    text, mask, pooled = torch.randn(1, 5, 24, generator=g), torch.ones(1, 5), torch.randn(1, 12, generator=g)
    with torch.no_grad():
        a, b = (
            native(x, torch.tensor([t]), text, mask, pooled, torch.tensor([1000.0])) for t in (10.0, 900.0)
        )
    assert (a - b)[:, :, 1:].abs().max() > 1e-2


def test_unknown_image_condition_type_is_refused() -> None:
    with pytest.raises(ValueError, match="image_condition_type"):
        HunyuanVideoTransformerConfig(image_condition_type="channel_concat")
