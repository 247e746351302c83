"""Native HunyuanVideo-1.5 VAE against Diffusers' `AutoencoderKLHunyuanVideo15` on the same tiny random weights:
encode / decode (video and single image), tiled encode / decode with the same small tile parameters, slicing,
config handling, and the released layout's state-dict keys on the meta device."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_hunyuan_video15 import (
    HUNYUAN_VIDEO15_VAE_CONFIG_DEFAULTS,
    AutoencoderKLHunyuanVideo15,
)
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
    perturb_parameters,
)

diffusers = pytest.importorskip("diffusers")

MIN_DB = 80.0
#: Tiled against untiled decode of a model whose residual branches are damped (see that test).
MIN_TILED_VS_UNTILED_DB = 35.0
DAMPING = 1e-4

#: The released layout (five levels: 16x spatial, the 3rd and 4th downsamplings also temporal, 4x; channel-
#: matched resamplers; 2-channel group-mean shortcuts) at a tiny width.
TINY: dict[str, Any] = {
    "latent_channels": 4,
    "block_out_channels": [4, 8, 16, 16, 16],
    "layers_per_block": 1,
    "spatial_compression_ratio": 16,
    "temporal_compression_ratio": 4,
    "scaling_factor": 0.7,
}
#: Tiles of 3 latents (48 pixels) starting every 2 latents (32 pixels): one latent / 16 pixels blended.
TILES: dict[str, Any] = {
    "tile_sample_min_height": 48,
    "tile_sample_min_width": 48,
    "tile_latent_min_height": 3,
    "tile_latent_min_width": 3,
    "tile_overlap_factor": 1 / 3,
}


def _perturb(model: torch.nn.Module) -> None:
    """Diffusers starts the RMS-norm gains at one; move every tensor so a misrouted weight shows."""
    perturb_parameters(model, 0.02, gain_suffix="gamma")


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]:
    return parity_pair(
        diffusers.AutoencoderKLHunyuanVideo15, AutoencoderKLHunyuanVideo15, TINY, perturb=_perturb
    )


def _compare(label: str, got: torch.Tensor, want: torch.Tensor, min_db: float = MIN_DB) -> None:
    """Signal-to-error ratio of `got` against `want` (inf when equal) of at least `min_db`."""
    assert_parity(got, want, f"hunyuan-video-1.5 vae {label}", min_db=min_db)


def test_state_dict_keys_and_shapes_match_diffusers(
    pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15],
) -> None:
    ref, ours = pair
    assert_same_state_dict_layout(ours, ref)


def test_released_layout_builds_on_meta_with_diffusers_keys() -> None:
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLHunyuanVideo15()
        ours = AutoencoderKLHunyuanVideo15.from_config(dict(ref.config))
    assert_same_state_dict_layout(ours, ref)


def test_video_and_image_encode(pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]) -> None:
    """9 frames of 32x48 (3 latent frames of 2x3) and one 32x48 image: mean, logvar and a seeded sample."""
    ref, ours = pair
    g = torch.Generator().manual_seed(1)
    for frames, latent_frames in ((9, 3), (1, 1)):
        x = torch.rand(1, 3, frames, 32, 48, generator=g) * 2 - 1
        with torch.no_grad():
            want = ref.encode(x).latent_dist
            got = ours.encode(x)
        assert got.mean.shape == (1, 4, latent_frames, 2, 3)
        _compare(f"encode T={frames} mean", got.mean, want.mean)
        _compare(f"encode T={frames} logvar", got.logvar, want.logvar)
        _compare(
            f"encode T={frames} sample",
            got.sample(torch.Generator().manual_seed(7)),
            want.sample(torch.Generator().manual_seed(7)),
        )


def test_video_and_image_decode(pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]) -> None:
    """3 latent frames of 2x3 -> 9 frames of 32x48, and a single latent frame -> one image."""
    ref, ours = pair
    g = torch.Generator().manual_seed(2)
    for latent_frames, frames in ((3, 9), (1, 1)):
        z = torch.randn(1, 4, latent_frames, 2, 3, generator=g)
        with torch.no_grad():
            want, got = ref.decode(z).sample, ours.decode(z)
        assert got.shape == (1, 3, frames, 32, 48)
        _compare(f"decode t={latent_frames}", got, want)


def test_batch_decode_whole_and_sliced(pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]) -> None:
    """A batch of 2 (2 latent frames -> 5 frames), decoded whole and sliced.

    Diffusers' causal attention mask does not broadcast over a batch of more than one, so the reference
    decodes the batch sliced; ours gives the same whole and sliced.
    """
    ref, ours = pair
    z = torch.randn(2, 4, 2, 2, 3, generator=torch.Generator().manual_seed(6))
    ref.enable_slicing()
    try:
        with torch.no_grad():
            want, got = ref.decode(z).sample, ours.decode(z)
            ours.enable_slicing()
            sliced = ours.decode(z)
    finally:
        ref.disable_slicing()
        ours.disable_slicing()
    assert got.shape == (2, 3, 5, 32, 48)
    _compare("decode batch 2", got, want)
    _compare("decode batch 2 sliced", sliced, want)


def test_tiled_decode_and_encode_match_diffusers(
    pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15],
) -> None:
    """3x4 latents (5 frames of 48x64 pixels) in 2x2 tiles of up to 3 latents, both ways."""
    ref, ours = pair
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, 4, 2, 3, 4, generator=g)
    x = torch.rand(1, 3, 5, 48, 64, generator=g) * 2 - 1
    ref.enable_tiling(**TILES)
    ours.enable_tiling(**TILES)
    try:
        with torch.no_grad():
            want, got = ref.decode(z).sample, ours.decode(z)
            want_moments, got_posterior = ref.encode(x).latent_dist, ours.encode(x)
    finally:
        ref.disable_tiling()
        ours.disable_tiling()
    assert got.shape == (1, 3, 5, 48, 64)
    _compare("tiled decode", got, want)
    assert got_posterior.mean.shape == (1, 4, 2, 3, 4)
    _compare("tiled encode mean", got_posterior.mean, want_moments.mean)
    _compare("tiled encode logvar", got_posterior.logvar, want_moments.logvar)


def test_tiled_decode_is_close_to_untiled(pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]) -> None:
    """Tiles placed and blended right give (nearly) the untiled video.

    A random decoder is not local (the mid-block attention sees the whole clip, and ten 3x3 convs run at
    latent resolution), so with 3-latent tiles its tiled output differs from the untiled one everywhere.
    Here the convs that feed a residual sum (resnet `conv2`, attention `proj_out`, the upsamplers, `conv_in`
    with its channel-repeat shortcut) are damped, which leaves a nearly local decoder: a misplaced tile or
    wrong blend weights would still show at full size.
    """
    _, ours = pair
    local = copy.deepcopy(ours)
    with torch.no_grad():
        for name, module in local.decoder.named_modules():
            if name.endswith(("conv2", "proj_out", "upsamplers.0.conv")) or name == "conv_in":
                for p in module.parameters():
                    p.mul_(DAMPING)
    z = torch.randn(1, 4, 2, 3, 4, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        untiled = local.decode(z)
        local.enable_tiling(**TILES)
        tiled = local.decode(z)
    _compare("tiled vs untiled decode (damped residual branches)", tiled, untiled, MIN_TILED_VS_UNTILED_DB)


def test_one_tile_covering_the_frame_is_the_untiled_path(
    pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15],
) -> None:
    _, ours = pair
    g = torch.Generator().manual_seed(5)
    z = torch.randn(1, 4, 2, 3, 3, generator=g)
    x = torch.rand(1, 3, 5, 48, 48, generator=g) * 2 - 1
    try:
        with torch.no_grad():
            untiled, untiled_mean = ours.decode(z), ours.encode(x).mean
            ours.enable_tiling(**TILES)  # the frame is exactly one 3x3-latent / 48x48-pixel tile
            assert torch.equal(ours.decode(z), untiled)
            assert torch.equal(ours.encode(x).mean, untiled_mean)
    finally:
        ours.disable_tiling()


def test_tiling_parameters_and_defaults() -> None:
    with torch.device("meta"):
        ref = diffusers.AutoencoderKLHunyuanVideo15(**TINY)
        ours = AutoencoderKLHunyuanVideo15.from_config(dict(ref.config))
    names = (*TILES, "use_tiling", "use_slicing")
    assert {n: getattr(ours, n) for n in names} == {n: getattr(ref, n) for n in names}
    assert ours.tile_latent_min_height == 256 // 16
    ours.enable_tiling(tile_sample_min_width=128)  # the others keep their values, as in Diffusers
    assert (ours.use_tiling, ours.tile_sample_min_width, ours.tile_latent_min_width) == (True, 128, 16)
    ours.disable_tiling()
    assert not ours.use_tiling
    with pytest.raises(ValueError, match="tile_overlap_factor"):
        ours.enable_tiling(tile_overlap_factor=1.0)
    with pytest.raises(ValueError, match="tile_latent_min_height"):
        ours.enable_tiling(tile_latent_min_height=0)


def test_config_and_ratios(pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]) -> None:
    ref, ours = pair
    assert AutoencoderKLHunyuanVideo15.diffusers_class_name == "AutoencoderKLHunyuanVideo15"
    assert ours.spatial_compression_ratio == ref.spatial_compression_ratio == 16
    assert ours.temporal_compression_ratio == ref.temporal_compression_ratio == 4
    assert ours.config["scaling_factor"] == ref.config.scaling_factor == 0.7
    diffusers_defaults = diffusers_init_defaults(diffusers.AutoencoderKLHunyuanVideo15)
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in diffusers_defaults.items()} == (
        HUNYUAN_VIDEO15_VAE_CONFIG_DEFAULTS
    )


def test_bad_config_and_input_are_rejected(pair: tuple[torch.nn.Module, AutoencoderKLHunyuanVideo15]) -> None:
    _, ours = pair
    with pytest.raises(ValueError, match="AutoencoderKLHunyuanVideo15 config has unknown keys"):
        AutoencoderKLHunyuanVideo15.from_config({**TINY, "latents_mean": [0.0] * 4})
    with pytest.raises(ValueError, match="spatial_compression_ratio must be a power of two"):
        AutoencoderKLHunyuanVideo15.from_config({**TINY, "spatial_compression_ratio": 12})
    with pytest.raises(ValueError, match="frames must be 1 \\+ 4k"):
        ours.encode(torch.zeros(1, 3, 4, 32, 32))
