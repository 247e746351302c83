"""Native CogVideoX VAE against Diffusers' `AutoencoderKLCogVideoX` on the same tiny random weights: decode
over several frame chunks (13 latent frames: a first chunk of 3, then chunks of 2), encode over several
chunks of 8 frames and of one image, tiled decode / encode with small tiles, and the released layout's
state-dict keys on the meta device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_cogvideox import (
    COGVIDEOX_VAE_CONFIG_DEFAULTS,
    AutoencoderKLCogVideoX,
)
from diffserve.testing.parity import assert_parity, assert_same_state_dict_layout, parity_pair
from diffserve.testing.vae_parity import assert_config_defaults_are_diffusers, weight_noise

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0

#: The released layout (four levels: 8x spatial, the first two downsamplings also temporal, 4x) at a tiny width.
TINY: dict[str, Any] = {
    "block_out_channels": [8, 8, 16, 16],
    "latent_channels": 4,
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_height": 64,
    "sample_width": 80,
    "scaling_factor": 0.7,
}


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, AutoencoderKLCogVideoX]:
    return parity_pair(
        diffusers.AutoencoderKLCogVideoX, AutoencoderKLCogVideoX, TINY, perturb=weight_noise(0.02)
    )


def test_config_defaults_are_diffusers() -> None:
    assert_config_defaults_are_diffusers(diffusers.AutoencoderKLCogVideoX, COGVIDEOX_VAE_CONFIG_DEFAULTS)


def test_state_dict_layout(pair) -> None:
    ref, ours = pair
    assert_same_state_dict_layout(ours, ref)


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLCogVideoX()
        ours = AutoencoderKLCogVideoX.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)


@pytest.mark.parametrize("frames", [1, 2, 13])
def test_decode_matches(pair, frames: int) -> None:
    ref, ours = pair
    z = torch.randn(1, 4, frames, 5, 6, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        want = ref.decode(z).sample
        got = ours.decode(z)
    assert got.shape == want.shape
    assert_parity(got, want, f"cogvideox vae decode {frames} latent frames", min_db=MIN_DB)


@pytest.mark.parametrize("frames", [1, 9, 17])
def test_encode_matches(pair, frames: int) -> None:
    ref, ours = pair
    x = torch.rand(1, 3, frames, 40, 48, generator=torch.Generator().manual_seed(frames)) * 2 - 1
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
    assert_parity(got.mean, want.mean, f"cogvideox vae encode mean {frames} frames", min_db=MIN_DB)
    assert_parity(got.std, want.std, f"cogvideox vae encode std {frames} frames", min_db=MIN_DB)


def test_tiled_decode_and_encode_match(pair) -> None:
    ref, ours = pair
    for model in (ref, ours):
        model.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32)
    try:
        z = torch.randn(1, 4, 3, 9, 11, generator=torch.Generator().manual_seed(3))
        x = torch.rand(1, 3, 5, 72, 88, generator=torch.Generator().manual_seed(4)) * 2 - 1
        with torch.no_grad():
            assert_parity(ours.decode(z), ref.decode(z).sample, "cogvideox vae tiled decode", min_db=MIN_DB)
            assert_parity(
                ours.encode(x).mean,
                ref.encode(x).latent_dist.mean,
                "cogvideox vae tiled encode",
                min_db=MIN_DB,
            )
    finally:
        for model in (ref, ours):
            model.disable_tiling()


def test_a_whole_clip_decode_hands_out_its_chunks_in_order(pair) -> None:
    """What a streamed video job publishes (`vae_tiling.decode_output_scope`): each frame chunk's final
    pixels as soon as it is decoded, together the whole clip (clamped to [-1, 1])."""
    from diffserve.vae_tiling import decode_output_scope

    _, ours = pair
    z = torch.randn(1, 4, 7, 5, 6, generator=torch.Generator().manual_seed(9))
    chunks: list[torch.Tensor] = []
    with torch.no_grad(), decode_output_scope(chunks.append):
        whole = ours.decode(z)
    assert [c.shape[2] for c in chunks] == [9, 8, 8]  # latent chunks of 3, 2, 2 frames
    torch.testing.assert_close(torch.cat(chunks, dim=2), whole.clamp(-1, 1), rtol=0, atol=0)


def test_quant_convs_over_other_channels_are_refused() -> None:
    """Diffusers builds `quant_conv` / `post_quant_conv` over `out_channels`, so with other latent channels
    both fail when they encode or decode: refused when the VAE is built."""
    with pytest.raises(ValueError, match="use_post_quant_conv with latent_channels 4"):
        AutoencoderKLCogVideoX(**{**TINY, "use_post_quant_conv": True})
