"""Native LTX-2 video VAE against Diffusers' `AutoencoderKLLTX2Video` on the same tiny random weights (fp32):
encode/decode, the timestep-conditioned decoder, spatial and temporal tiling, slicing, config handling.
A second tiny config covers the branches the released one does not use (strided-conv and spatial-only
downsampling, non-causal encoder, causal decoder, width-changing up block, no-residual upsampler, noise
injection)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_ltx2 import (
    LTX2_VIDEO_VAE_CONFIG_DEFAULTS,
    TILE_DEFAULTS,
    AutoencoderKLLTX2Video,
)
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
    psnr_range_db,
)

diffusers = pytest.importorskip("diffusers")

PARITY_DB = 80.0
TILED_VS_UNTILED_DB = 35.0
LATENT = 8

#: The released LTX-2 layout (every level; spatial-only, temporal-only and two space-time downsamplings;
#: residual depth-to-space upsamplers, 4x4 patches: 32x spatial / 8x temporal) at tiny widths and one
#: resnet per level, with the optional timestep-conditioned decoder switched on.
LTX2_TINY: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": LATENT,
    "block_out_channels": [8, 16, 32, 32],
    "down_block_types": ["LTX2VideoDownBlock3D"] * 4,
    "decoder_block_out_channels": [8, 16, 32],
    "layers_per_block": [1, 1, 1, 1, 1],
    "decoder_layers_per_block": [1, 1, 1, 1],
    "spatio_temporal_scaling": [True, True, True, True],
    "decoder_spatio_temporal_scaling": [True, True, True],
    "decoder_inject_noise": [False, False, False, False],
    "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
    "upsample_residual": [True, True, True],
    "upsample_factor": [2, 2, 2],
    "timestep_conditioning": True,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-6,
    "encoder_causal": True,
    "decoder_causal": False,
    "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "reflect",
    "spatial_compression_ratio": 32,
    "temporal_compression_ratio": 8,
}

#: Branches outside the released layout (see the module docstring); compression ratios left to the formula.
VARIANT_TINY: dict[str, Any] = {
    "latent_channels": LATENT,
    "block_out_channels": [8, 16, 16],
    "down_block_types": ["LTX2VideoDownBlock3D"] * 3,
    "layers_per_block": [1, 1, 1, 1],
    "spatio_temporal_scaling": [True, True, False],
    "downsample_type": ["conv", "spatial", "spatiotemporal"],
    "decoder_block_out_channels": [4, 16, 32],
    "decoder_layers_per_block": [1, 1, 1, 1],
    "decoder_spatio_temporal_scaling": [False, True, True],
    "upsample_type": ["temporal", "spatial", "spatiotemporal"],
    "upsample_residual": [True, False, True],
    "upsample_factor": [1, 2, 2],
    "decoder_inject_noise": [False, True, False, True],
    "patch_size": 2,
    "encoder_causal": False,
    "decoder_causal": True,
    "decoder_spatial_padding_mode": "zeros",
}


def _perturb(ref: torch.nn.Module) -> None:
    """LayerNorms start at (1, 0), noise scales at 0 and latent stats at (0, 1): move every tensor so a
    misrouted one shows."""
    for name, p in ref.named_parameters():
        if name.endswith("timestep_scale_multiplier"):
            p.fill_(900.0)
        elif "per_channel_scale" in name:
            p.copy_(0.2 * torch.randn_like(p))
        else:
            p.add_(0.05 * torch.randn_like(p))
    ref.latents_mean.copy_(torch.randn(LATENT))
    ref.latents_std.copy_(torch.rand(LATENT) + 0.5)


def _build(config: dict[str, Any]) -> tuple[torch.nn.Module, AutoencoderKLLTX2Video]:
    return parity_pair(diffusers.AutoencoderKLLTX2Video, AutoencoderKLLTX2Video, config, perturb=_perturb)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, AutoencoderKLLTX2Video]:
    return _build(LTX2_TINY)


def _compare(label: str, got: torch.Tensor, want: torch.Tensor, min_db: float = PARITY_DB) -> float:
    """PSNR with the reference's peak-to-peak range as the peak (inf when identical) of at least `min_db`."""
    return assert_parity(got, want, f"ltx2 vae {label}", min_db=min_db, metric=psnr_range_db).db


def _video(frames: int, height: int, width: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, height, width, generator=g) * 2 - 1


def _latents(frames: int, height: int, width: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, LATENT, frames, height, width, generator=torch.Generator().manual_seed(seed))


def _reset_tiling(ref: torch.nn.Module, ours: AutoencoderKLLTX2Video) -> None:
    """Both models back to untiled, unsliced, with the default tile sizes (the fixture is shared)."""
    for model in (ref, ours):
        model.use_tiling = model.use_slicing = model.use_framewise_decoding = False
        for name, value in TILE_DEFAULTS.items():
            setattr(model, name, value)


def test_state_dict_and_config(pair: tuple[torch.nn.Module, AutoencoderKLLTX2Video]) -> None:
    ref, ours = pair
    assert_same_state_dict_layout(ours, ref)
    got = ours.state_dict()
    assert "latents_mean" in got and "decoder.timestep_scale_multiplier" in got
    assert torch.equal(ours.latents_std, ref.latents_std)
    assert (ours.spatial_compression_ratio, ours.temporal_compression_ratio) == (32, 8)
    for key, value in ref.config.items():
        if not key.startswith("_"):
            expected = tuple(value) if isinstance(value, list) else value
            assert ours.config[key] == expected, key
    with pytest.raises(ValueError, match="unknown keys"):
        AutoencoderKLLTX2Video.from_config({**LTX2_TINY, "bogus": 1})
    with pytest.raises(ValueError, match="downsample_type"):
        AutoencoderKLLTX2Video.from_config(
            {**LTX2_TINY, "downsample_type": ["spatial", "x", "spatial", "spatial"]}
        )


def test_default_config_matches_diffusers() -> None:
    """Keys and defaults of the constructor are Diffusers' (meta build: no memory)."""
    assert diffusers_init_defaults(diffusers.AutoencoderKLLTX2Video) == LTX2_VIDEO_VAE_CONFIG_DEFAULTS
    with torch.device("meta"):
        ours = AutoencoderKLLTX2Video()
        ref = diffusers.AutoencoderKLLTX2Video()
    assert_same_state_dict_layout(ours, ref)
    assert (ours.spatial_compression_ratio, ours.temporal_compression_ratio) == (
        ref.spatial_compression_ratio,
        ref.temporal_compression_ratio,
    )
    for name, value in TILE_DEFAULTS.items():
        assert getattr(ours, name) == getattr(ref, name) == value, name
    assert not (ours.use_tiling or ours.use_slicing or ours.use_framewise_decoding)
    ours.enable_tiling()
    assert ours.use_tiling and ours.tile_sample_stride_height == ref.tile_sample_stride_height


def test_encode_decode(pair: tuple[torch.nn.Module, AutoencoderKLLTX2Video]) -> None:
    """17 frames at non-square 64x96: posterior (mean, logvar, seeded sample); a batch-2 decode of 3
    latent frames with per-sample decode timesteps; an image each way; the causal decode."""
    ref, ours = pair
    _reset_tiling(ref, ours)
    x = _video(17, 64, 96, seed=1)
    z = _latents(3, 2, 3, seed=4, batch=2)
    temb = torch.tensor([0.05, 0.1])
    with torch.no_grad():
        want = ref.encode(x).latent_dist
        got = ours.encode(x)
        assert got.mean.shape == (1, LATENT, 3, 2, 3)
        _compare("encode mean", got.mean, want.mean)
        _compare("encode logvar", got.logvar, want.logvar)
        _compare(
            "encode sample",
            got.sample(torch.Generator().manual_seed(3)),
            want.sample(torch.Generator().manual_seed(3)),
        )
        video = ours.decode(z, temb)
        assert video.shape == (2, 3, 17, 64, 96)
        _compare("decode temb", video, ref.decode(z, temb).sample)
        image = _video(1, 64, 96, seed=5)
        _compare("encode image", ours.encode(image).mean, ref.encode(image).latent_dist.mean)
        _compare(
            "decode 1 frame", ours.decode(z[:1, :, :1], temb[:1]), ref.decode(z[:1, :, :1], temb[:1]).sample
        )
        # Diffusers' causal flag can only turn causality on: a causal decode differs, and matches too.
        causal = ours.decode(z[:1, :, :2], temb[:1], causal=True)
        _compare("decode causal", causal, ref.decode(z[:1, :, :2], temb[:1], causal=True).sample)
        assert psnr_range_db(causal, video[:1, :, :9]) < PARITY_DB
    with pytest.raises(ValueError, match="timestep-conditioned"):
        ours.decode(z)


def test_slicing(pair: tuple[torch.nn.Module, AutoencoderKLLTX2Video]) -> None:
    ref, ours = pair
    _reset_tiling(ref, ours)
    x = _video(1, 64, 64, seed=6, batch=2)
    z = _latents(1, 2, 2, seed=7, batch=2)
    temb = torch.tensor([0.0, 0.2])
    with torch.no_grad():
        whole_mean, whole_video = ours.encode(x).mean, ours.decode(z, temb)
        ours.enable_slicing()
        ref.enable_slicing()
        sliced_mean = ours.encode(x).mean
        _compare("sliced encode vs diffusers", sliced_mean, ref.encode(x).latent_dist.mean)
        _compare("sliced encode vs whole", sliced_mean, whole_mean)
        # Diffusers' sliced decode pairs latents with timesteps wrongly when temb is given; compare
        # each item with an unsliced Diffusers decode instead.
        sliced = ours.decode(z, temb)
        for i in range(2):
            _compare(
                f"sliced decode item {i}", sliced[i : i + 1], ref.decode(z[i : i + 1], temb[i : i + 1]).sample
            )
        _compare("sliced decode vs whole", sliced, whole_video)
    _reset_tiling(ref, ours)


def _localized(model: AutoencoderKLLTX2Video) -> AutoencoderKLLTX2Video:
    """A copy whose 3x3x3 convs read only their own pixel and frame (the last tap in time for the causal
    encoder, the centre one for the non-causal decoder). Its output at a pixel then depends on that
    pixel's cell alone, so a tiled run must give the untiled result up to rounding: a misplaced,
    misaligned or mis-cropped tile or a wrong blend shows. (With random 3x3x3 weights the tiles' borders
    change everything within a few latent pixels, far more than tiles this small can blend away.)"""
    local = AutoencoderKLLTX2Video.from_config(model.config)
    local.load_state_dict(model.state_dict())
    with torch.no_grad():
        for part, t_tap in ((local.encoder, 2), (local.decoder, 1)):
            for module in part.modules():
                if isinstance(module, torch.nn.Conv3d) and module.kernel_size == (3, 3, 3):
                    keep = module.weight[:, :, t_tap, 1, 1].clone()
                    module.weight.zero_()
                    module.weight[:, :, t_tap, 1, 1] = keep
    return local.eval()


def _local_untiled_then_tiling(
    ref: torch.nn.Module,
    ours: AutoencoderKLLTX2Video,
    tiles: dict[str, int],
    x: torch.Tensor,
    z: torch.Tensor,
    temb: torch.Tensor,
) -> tuple[AutoencoderKLLTX2Video, torch.Tensor, torch.Tensor]:
    """`_localized(ours)` and its untiled encode (mean) of `x` and decode of `z`, then tiling `tiles`
    enabled on the reference, ours and the local copy: (local copy, untiled encode, untiled decode)."""
    local = _localized(ours)
    with torch.no_grad():
        whole_enc, whole_dec = local.encode(x).mean, local.decode(z, temb)
    for model in (ref, ours, local):
        model.enable_tiling(**tiles)
    return local, whole_enc, whole_dec


def test_spatial_tiling(pair: tuple[torch.nn.Module, AutoencoderKLLTX2Video]) -> None:
    """Non-square 128x160 (latent 4x5) in 96x128-pixel tiles every 64x96: 2x2 blended tiles. An image
    and one latent frame each way (spatial tiling is per frame; the temporal test tiles multi-frame clips
    in space too)."""
    ref, ours = pair
    _reset_tiling(ref, ours)
    tiles = {
        "tile_sample_min_height": 96,
        "tile_sample_min_width": 128,
        "tile_sample_stride_height": 64,
        "tile_sample_stride_width": 96,
    }
    x = _video(1, 128, 160, seed=8)
    z = _latents(1, 4, 5, seed=9)
    temb = torch.tensor([0.05])
    local, whole_enc, whole_dec = _local_untiled_then_tiling(ref, ours, tiles, x, z, temb)
    with torch.no_grad():
        _compare("tiled encode vs diffusers", ours.encode(x).mean, ref.encode(x).latent_dist.mean)
        _compare("tiled decode vs diffusers", ours.decode(z, temb), ref.decode(z, temb).sample)
        _compare("tiled vs untiled encode (local)", local.encode(x).mean, whole_enc)
        _compare("tiled vs untiled decode (local)", local.decode(z, temb), whole_dec)
        # One tile covering everything: the untiled path, bit for bit.
        local.enable_tiling(tile_sample_min_height=128, tile_sample_min_width=160)
        assert torch.equal(local.encode(x).mean, whole_enc)
        assert torch.equal(local.decode(z, temb), whole_dec)
    _reset_tiling(ref, ours)


def _diffusers_temporal_layout(whole: torch.Tensor) -> torch.Tensor:
    """What Diffusers' temporal tiled decode (3 latent frames, 16-frame tiles every 8) makes of the
    untiled output of a decoder that is local in time: the first tile's 9 frames (untiled 0..8), then
    the second tile's first 8 frames (untiled 8..15) cross-faded with the first tile's last 8 (untiled
    9..16). Diffusers lines the two tiles up one frame apart; on real video, neighbouring frames are
    close, so the offset is a slight temporal blur over the overlap."""
    fade = [whole[:, :, 9 + k] * (1 - k / 8) + whole[:, :, 8 + k] * (k / 8) for k in range(8)]
    return torch.cat([whole[:, :, :9], torch.stack(fade, dim=2)], dim=2)


def test_temporal_tiling(pair: tuple[torch.nn.Module, AutoencoderKLLTX2Video]) -> None:
    """17 frames (3 latent frames) in 16-frame tiles every 8; the decode also with spatial tiles."""
    ref, ours = pair
    _reset_tiling(ref, ours)
    tiles = {"tile_sample_min_num_frames": 16, "tile_sample_stride_num_frames": 8}
    x = _video(17, 32, 64, seed=10)
    z = _latents(3, 2, 2, seed=11)
    temb = torch.tensor([0.05])
    local, whole_enc, whole_dec = _local_untiled_then_tiling(ref, ours, tiles, x, z, temb)
    for model in (ref, ours, local):
        model.use_tiling = False
        model.use_framewise_decoding = True
    with torch.no_grad():
        _compare("temporal tiled encode vs diffusers", ours.encode(x).mean, ref.encode(x).latent_dist.mean)
        _compare("temporal tiled decode vs diffusers", ours.decode(z, temb), ref.decode(z, temb).sample)
        enc, dec = local.encode(x).mean, local.decode(z, temb)
        assert dec.shape == whole_dec.shape and enc.shape == whole_enc.shape
        _compare("temporal tiled vs untiled encode (local)", enc, whole_enc)
        print(f"[ltx2 vae temporal tiled vs untiled decode (local)] {psnr_range_db(dec, whole_dec):.1f} dB")
        _compare(
            "temporal tiled decode vs Diffusers' layout (local)", dec, _diffusers_temporal_layout(whole_dec)
        )
        # A clip within one temporal tile takes the untiled path.
        local.tile_sample_min_num_frames = 24
        assert torch.equal(local.decode(z, temb), whole_dec)
        # Space and time together: 64x96-pixel tiles every 64 (latent 2x3 every 2 across width 4).
        both = {"tile_sample_min_height": 64, "tile_sample_min_width": 96, "tile_sample_stride_width": 64}
        for model in (ref, ours):
            model.enable_tiling(**both)
        z_wide = _latents(3, 2, 4, seed=12)
        _compare(
            "space+time tiled decode vs diffusers", ours.decode(z_wide, temb), ref.decode(z_wide, temb).sample
        )
    _reset_tiling(ref, ours)


def test_variant_config() -> None:
    """The branches the released layout does not use, including seeded noise injection in the decoder."""
    ref, ours = _build(VARIANT_TINY)
    assert (ours.spatial_compression_ratio, ours.temporal_compression_ratio) == (
        ref.spatial_compression_ratio,
        ref.temporal_compression_ratio,
    )
    x = _video(9, 32, 48, seed=12)
    z = _latents(3, 4, 3, seed=13)
    with torch.no_grad():
        _compare("variant encode mean", ours.encode(x).mean, ref.encode(x).latent_dist.mean)
        torch.manual_seed(14)
        want = ref.decode(z).sample
        torch.manual_seed(14)
        got = ours.decode(z)
        _compare("variant decode (noise)", got, want)
    with pytest.raises(ValueError, match="not timestep-conditioned"):
        ours.decode(z, torch.tensor([0.1]))


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="patch_size_t"):
        AutoencoderKLLTX2Video.from_config({**LTX2_TINY, "patch_size_t": 2})
    with pytest.raises(ValueError, match="decoder_spatial_padding_mode"):
        AutoencoderKLLTX2Video.from_config({**LTX2_TINY, "decoder_spatial_padding_mode": "mirror"})
    with pytest.raises(ValueError, match="layers_per_block"):
        AutoencoderKLLTX2Video.from_config({**LTX2_TINY, "layers_per_block": [1, 1, 1, 1]})
    with torch.device("meta"):
        vae = AutoencoderKLLTX2Video.from_config(LTX2_TINY)
    with pytest.raises(ValueError, match="tile_sample_stride_width"):
        vae.enable_tiling(tile_sample_stride_width=-8)
    # Latent width 3 in 2-wide tiles every 1 leaves a 1-wide edge tile, which reflect padding cannot pad.
    vae.enable_tiling(tile_sample_min_width=64, tile_sample_stride_width=32)
    with pytest.raises(ValueError, match="reflect padding"):
        vae.decode(torch.zeros(1, LATENT, 1, 2, 3, device="meta"), torch.zeros(1, device="meta"))
