"""Tiled and sliced encode / decode of every native VAE against its untiled self and Diffusers' own tiling.

For each class, on tiny random weights shared with Diffusers' class, with small tile sizes so that a small
input needs several tiles:

- one tile covering the input: tiling on gives exactly the untiled output;
- several tiles: equal to Diffusers' tiled decode / encode with the same tile parameters (max abs diff as
  the VAE parity tests, PSNR printed), and within 35 dB of the untiled output (uint8 PSNR) for a decoder
  made local as trained ones are (`_localised`: random weights spread every latent over the whole frame);
- slicing: a batch of two decoded one element at a time equals the batched decode.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_vaes import DC_STAGES, FLUX2_TINY, KL_TINY, WAN21_TINY, wan22_tiny

from diffserve.models.vaes.autoencoder_dc import AutoencoderDC
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.models.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffserve.models.vaes.autoencoder_kl_qwen_image import AutoencoderKLQwenImage
from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
from diffserve.models.vaes.tiling import blend_h, blend_t, blend_v, stitch_tiles
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.parity import parity_pair
from diffserve.vae_tiling import SupportsTiling

diffusers = pytest.importorskip("diffusers")

MAX_ABS = 1e-5  # native vs Diffusers on the same weights (the VAE parity tests' bar)
MIN_TILED_PSNR = 35.0  # tiled vs untiled decode, uint8 dB

WAN22 = wan22_tiny(8, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
DC = {**DC_STAGES, "encoder_layers_per_block": [1, 1, 1], "decoder_layers_per_block": [1, 1, 1]}

Tensor = torch.Tensor


@dataclass(frozen=True)
class Case:
    """One VAE class: its tiny config, a latent input needing a few tiles with the small `tile_params`, and
    a larger (single-frame) input and tiles for the tiled-vs-untiled PSNR."""

    native: type[torch.nn.Module]
    diffusers_name: str
    config: dict[str, Any]
    latent_shape: tuple[int, ...]  # (C, [T,] h, w) of one batch element
    tile_params: dict[str, int | float]  # for the native enable_tiling (and Diffusers' attributes)
    psnr_shape: tuple[int, ...]
    psnr_tile_params: dict[str, int | float]

    @property
    def kl_style(self) -> bool:
        """AutoencoderKL's tile parameters (one square size and an overlap factor)."""
        return "tile_sample_min_size" in self.tile_params


def _kl_params(size: int, overlap: float = 0.25) -> dict[str, int | float]:
    return {"tile_sample_min_size": size, "tile_latent_min_size": size // 2, "tile_overlap_factor": overlap}


def _wh_params(size: int, stride: int) -> dict[str, int | float]:
    return {
        "tile_sample_min_height": size,
        "tile_sample_min_width": size,
        "tile_sample_stride_height": stride,
        "tile_sample_stride_width": stride,
    }


#: Wan 2.1 / Qwen-Image (f = 8): 32-pixel tiles every 24 -> 4-latent tiles every 3 latents.
WAN21_TILES: dict[str, Any] = dict(
    config=WAN21_TINY, latent_shape=(4, 2, 5, 5), tile_params=_wh_params(32, 24), psnr_shape=(4, 1, 8, 8),
    psnr_tile_params=_wh_params(48, 32),
)  # fmt: skip
#: KL and FLUX.2 (f = 2): 32-pixel / 16-latent tiles overlapping by a quarter.
KL_TILES: dict[str, Any] = dict(
    latent_shape=(8, 20, 20), tile_params=_kl_params(32), psnr_shape=(8, 24, 24),
    psnr_tile_params=_kl_params(40, 0.5),
)  # fmt: skip
CASES = {
    "wan2.1": Case(AutoencoderKLWan, "AutoencoderKLWan", **WAN21_TILES),
    "qwen-image": Case(AutoencoderKLQwenImage, "AutoencoderKLQwenImage", **WAN21_TILES),
    # Wan 2.2 (f = 16 with 2x2 patches; tile sizes count patchified pixels): 3-latent tiles every 2.
    "wan2.2": Case(
        AutoencoderKLWan, "AutoencoderKLWan", WAN22, (8, 2, 4, 4), _wh_params(48, 32), (8, 1, 8, 8),
        _wh_params(96, 64),
    ),
    "kl": Case(AutoencoderKL, "AutoencoderKL", KL_TINY, **KL_TILES),
    "flux2": Case(AutoencoderKLFlux2, "AutoencoderKLFlux2", FLUX2_TINY, **KL_TILES),
    # DC (f = 4): 64-pixel tiles every 48 -> 16-latent tiles every 12.
    "dc": Case(
        AutoencoderDC, "AutoencoderDC", DC, (8, 20, 20), _wh_params(64, 48), (8, 30, 40), _wh_params(64, 48)
    ),
}  # fmt: skip

#: Attention outputs (zeroed) and residual branches' last convs (damped) of the decoders: see `_localised`.
ATTENTION_OUT = re.compile(r"attentions\.\d+\.(proj|to_out)|attn\.norm_out")
RESIDUAL_LAST = re.compile(r"\.conv2\.|conv_out\.conv_point")


def _localised(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose decoder acts locally, as trained VAE decoders do: attention adds nothing and residual
    branches little. Random weights spread every latent over the whole frame, so no overlap hides the tile
    borders (about 20 dB on these tiny VAEs); the 35 dB bar is about tiling a decoder that behaves like a
    trained one, while the Diffusers-parity test covers the random weights."""
    local = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in local.decoder.named_parameters():
            if ATTENTION_OUT.search(name):
                p.zero_()
            elif RESIDUAL_LAST.search(name):
                p.mul_(0.05)
    return local


def _perturb(model: torch.nn.Module) -> None:
    """Move every weight off its init (norm gains off one, biases off zero) so a misrouted tensor shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma") or ("norm" in name and name.endswith("weight")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.add_(0.02 * torch.randn_like(p))


Pair = tuple[Case, torch.nn.Module, torch.nn.Module]
#: Qwen-Image's VAE is Wan 2.1's network (`CausalVideoVAE`) under other config keys: the tests of the
#: network alone (untiled vs tiled, slicing) run once, on Wan 2.1's.
NETWORK_CASES = sorted(set(CASES) - {"qwen-image"})


@functools.cache
def _pair(name: str) -> Pair:
    """Diffusers' class with perturbed random weights, and the native class loaded from its state dict."""
    spec = CASES[name]
    ref, ours = parity_pair(
        getattr(diffusers, spec.diffusers_name), spec.native, spec.config, perturb=_perturb
    )
    return spec, ref, ours


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Pair:
    return _pair(request.param)


@pytest.fixture(scope="module", params=NETWORK_CASES)
def network(request: pytest.FixtureRequest) -> Pair:
    return _pair(request.param)


def _ref_enable_tiling(spec: Case, ref: torch.nn.Module) -> None:
    """Diffusers' tiling with the case's parameters (AutoencoderKL's enable_tiling takes none: set them)."""
    if spec.kl_style:
        ref.enable_tiling()
        for name, value in spec.tile_params.items():
            setattr(ref, name, value)
    else:
        ref.enable_tiling(**spec.tile_params)


def _latents(spec: Case, batch: int = 1, seed: int = 1) -> Tensor:
    return torch.randn(batch, *spec.latent_shape, generator=torch.Generator().manual_seed(seed))


def _pixels(spec: Case, ours: torch.nn.Module, seed: int = 2) -> Tensor:
    """A smooth input image / clip (of the latent case's size) for the encoders: random noise upsampled."""
    f = ours.spatial_compression_ratio
    _, *time, h, w = spec.latent_shape
    channels = 3
    frames = [1 + 4 * (time[0] - 1)] if time else []
    coarse = torch.rand(1, channels, *frames, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    size = (*frames, h * f, w * f)
    return F.interpolate(coarse, size=size, mode="trilinear" if time else "bilinear")


def _first_frame(z: Tensor) -> Tensor:
    """A video latent's first frame (still a video); an image latent as it is."""
    return z[:, :, :1] if z.ndim == 5 else z


def _uint8(x: Tensor) -> Tensor:
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def _psnr(a: Tensor, b: Tensor) -> float:
    return psnr_uint8(_uint8(a).numpy(), _uint8(b).numpy())


def _decode(
    model: torch.nn.Module, z: Tensor, tiled: bool, params: dict[str, int | float] | None = None
) -> Tensor:
    model.disable_tiling()
    if tiled:
        model.enable_tiling(**(params or {}))
    with torch.no_grad():
        out = model.decode(z)
    model.disable_tiling()
    return out


def test_every_vae_class_has_the_switches(case: Pair) -> None:
    _, _, ours = case
    assert isinstance(ours, SupportsTiling)
    assert ours.use_tiling is False and ours.use_slicing is False
    ours.enable_slicing()
    assert ours.use_slicing
    ours.disable_slicing()
    assert not ours.use_slicing


def test_tile_defaults_match_diffusers(case: Pair) -> None:
    spec, _, ours = case
    fresh = getattr(diffusers, spec.diffusers_name)(**spec.config)
    names = [n for n in vars(fresh) if n.startswith("tile_")]
    assert names, "Diffusers' class has no tile attributes"
    mine = spec.native.from_config({**dict(fresh.config), "_class_name": spec.diffusers_name})
    for name in names:
        assert getattr(mine, name) == getattr(fresh, name), name


def test_one_tile_covering_the_frame_is_the_untiled_decode(network: Pair) -> None:
    """Diffusers' default tiles are larger than a small input, and an input of exactly one tile: tiling on
    changes nothing, bit for bit."""
    spec, _, ours = network
    one_tile = _first_frame(_latents(spec))[..., :4, :4]
    with torch.device("meta"):
        fresh = spec.native.from_config(spec.config)
    defaults = {name: getattr(fresh, name) for name in spec.tile_params}
    assert torch.equal(
        _decode(ours, one_tile, tiled=True, params=defaults), _decode(ours, one_tile, tiled=False)
    )
    f = ours.spatial_compression_ratio
    params = _kl_params(4 * f) if spec.kl_style else _wh_params(4 * f, 3 * f)
    assert torch.equal(
        _decode(ours, one_tile, tiled=True, params=params), _decode(ours, one_tile, tiled=False)
    )


def test_tiled_decode_matches_diffusers(case: Pair) -> None:
    """Several tiles (and two latent frames for the video VAEs, each tile with its own causal cache)."""
    spec, ref, ours = case
    z = _latents(spec)
    tiled = _decode(ours, z, tiled=True, params=spec.tile_params)
    _ref_enable_tiling(spec, ref)
    with torch.no_grad():
        want = ref.decode(z).sample
    ref.disable_tiling()
    if spec.diffusers_name == "AutoencoderKLQwenImage":
        want = want.clamp(-1, 1)  # Diffusers' Qwen-Image tiled decode alone skips the clamp
    assert tiled.shape == want.shape, (tiled.shape, want.shape)
    diff = (tiled - want).abs().max().item()
    print(
        f"[vae tiling {spec.diffusers_name}] vs Diffusers tiled: {_psnr(tiled, want):.1f} dB, max abs {diff:.2e}"
    )
    assert diff <= MAX_ABS
    assert not torch.equal(tiled, _decode(ours, z, tiled=False)), (
        "several tiles must differ from one somewhere"
    )


def test_tiled_decode_is_close_to_untiled(network: Pair) -> None:
    spec, _, ours = network
    local = _localised(ours)
    z = torch.randn(1, *spec.psnr_shape, generator=torch.Generator().manual_seed(5))
    untiled = _decode(local, z, tiled=False)
    tiled = _decode(local, z, tiled=True, params=spec.psnr_tile_params)
    assert tiled.shape == untiled.shape
    psnr = _psnr(tiled, untiled)
    print(f"[vae tiling {spec.diffusers_name}] tiled vs untiled {tuple(untiled.shape)}: {psnr:.1f} dB")
    assert MIN_TILED_PSNR <= psnr < float("inf")


def test_tiled_encode_matches_diffusers(case: Pair) -> None:
    spec, ref, ours = case
    x = _pixels(spec, ours)
    ours.enable_tiling(**spec.tile_params)
    _ref_enable_tiling(spec, ref)
    with torch.no_grad():
        got, want = ours.encode(x), ref.encode(x)
    ours.disable_tiling()
    ref.disable_tiling()
    if spec.diffusers_name == "AutoencoderDC":
        pairs = [(got, want.latent)]
    else:
        pairs = [(got.mean, want.latent_dist.mean), (got.logvar, want.latent_dist.logvar)]
    for mine, theirs in pairs:
        assert mine.shape == theirs.shape
        assert (mine - theirs).abs().max().item() <= MAX_ABS


def test_slicing_equals_the_batched_decode(network: Pair) -> None:
    spec, _, ours = network
    z = _first_frame(_latents(spec, batch=2, seed=3))[..., :3, :4]
    with torch.no_grad():
        batched = ours.decode(z)
        ours.enable_slicing()
        sliced = ours.decode(z)
        ours.disable_slicing()
        one_by_one = torch.cat([ours.decode(z[i : i + 1]) for i in range(2)])
    assert torch.equal(sliced, one_by_one)
    assert (sliced - batched).abs().max().item() <= MAX_ABS


def test_blends_match_diffusers_bit_for_bit() -> None:
    """The cross-fades equal Diffusers' per-row loops in float32 (rows, columns and LTX's frames)."""
    from diffusers.models.autoencoders.autoencoder_kl_ltx import AutoencoderKLLTXVideo
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan as RefWan

    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(1, 2, 6, 9, 10, generator=g), torch.randn(1, 2, 6, 7, 10, generator=g)
    assert torch.equal(blend_v(a, b.clone(), 5), RefWan.blend_v(None, a, b.clone(), 5))
    b = torch.randn(1, 2, 6, 9, 8, generator=g)
    assert torch.equal(blend_h(a, b.clone(), 3), RefWan.blend_h(None, a, b.clone(), 3))
    b = torch.randn(1, 2, 4, 9, 10, generator=g)
    assert torch.equal(blend_t(a, b.clone(), 3), AutoencoderKLLTXVideo.blend_t(None, a, b.clone(), 3))
    assert torch.equal(blend_v(a, b.clone(), 0), b)


def test_stitch_of_one_tile_is_that_tile() -> None:
    tile = torch.randn(1, 3, 8, 8)
    assert torch.equal(stitch_tiles([[tile]], 4, 4, 8, 8), tile)


def test_decode_split_tiles_inside_a_tiled_decode_scope() -> None:
    """Automatic tiling reaches the VAE through `decode_split` for one decode, and the switch is restored."""
    from diffserve.distributed.parallel_vae import decode_split
    from diffserve.vae_tiling import tiled_decode_scope

    torch.manual_seed(0)
    vae = AutoencoderKL(**KL_TINY).eval()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 16, 8  # the switch stays off: the scope turns it on
    z = torch.randn(1, 8, 12, 12, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        untiled = decode_split(vae, z)
        with tiled_decode_scope(True):
            scoped = decode_split(vae, z)
        assert not vae.use_tiling
        vae.enable_tiling()
        tiled = vae.decode(z)
    assert torch.equal(scoped, tiled) and not torch.equal(scoped, untiled)
