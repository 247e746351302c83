"""Parity of the native KL autoencoder against diffusers' `AutoencoderKL` on the same tiny random weights."""

from __future__ import annotations

import pytest
import torch
from tiny_vaes import KL_LEVELS

from diffserve.models.vaes.autoencoder_kl import AutoencoderKL, DiagonalGaussian
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    parity_pair,
    randomize_norms,
)

diffusers = pytest.importorskip("diffusers")

MAX_ABS = 1e-4
MIN_COS = 0.9999

FLUX_STYLE = {
    **KL_LEVELS,
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
SD_STYLE = {
    "down_block_types": ["DownEncoderBlock2D"] * 3,
    "up_block_types": ["UpDecoderBlock2D"] * 3,
    "block_out_channels": [32, 32, 64],
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 16,
    "scaling_factor": 0.18215,
}
NO_ATTENTION = {**FLUX_STYLE, "mid_block_add_attention": False, "act_fn": "mish"}
#: The released depth (four levels, f = 8) at a tiny width, with one of the two 1x1 convs only and another
#: activation: config values the fuzz against Diffusers covered, kept here at the real depth.
FOUR_LEVELS = {
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 8, 16, 16],
    "layers_per_block": 1,
    "latent_channels": 4,
    "norm_num_groups": 4,
    "act_fn": "gelu",
    "use_post_quant_conv": False,
}

CONFIGS = {"flux": FLUX_STYLE, "sd": SD_STYLE, "no_attention": NO_ATTENTION, "four_levels": FOUR_LEVELS}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, AutoencoderKL]:
    """diffusers initialises GroupNorm to the identity: the norms are randomised so a misrouted one shows."""
    return parity_pair(
        diffusers.AutoencoderKL, AutoencoderKL, CONFIGS[request.param], perturb=randomize_norms
    )


def _compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_parity(got, want, f"autoencoder-kl {name}", max_abs=MAX_ABS, min_cos=MIN_COS)


def test_state_dict_keys_and_shapes(pair: tuple[torch.nn.Module, AutoencoderKL]) -> None:
    ref, native = pair
    assert_same_state_dict_layout(native, ref)
    assert all(t.device.type == "cpu" for t in native.state_dict().values())


def test_config_resolved(pair: tuple[torch.nn.Module, AutoencoderKL]) -> None:
    ref, native = pair
    for key, value in native.config.items():
        want = ref.config[key]
        assert value == (tuple(want) if isinstance(want, list) else want), key
    assert native.spatial_compression_ratio == 2 ** (len(ref.config.block_out_channels) - 1)
    assert AutoencoderKL.diffusers_class_name == "AutoencoderKL"


@torch.no_grad()
@pytest.mark.parametrize("height,width", [(32, 32), (64, 48)])
def test_encode_matches(pair: tuple[torch.nn.Module, AutoencoderKL], height: int, width: int) -> None:
    ref, native = pair
    x = torch.rand(2, 3, height, width, generator=torch.Generator().manual_seed(1)) * 2 - 1
    want = ref.encode(x).latent_dist
    got = native.encode(x)
    _compare("encode.mean", got.mean, want.mean)
    _compare("encode.logvar", got.logvar, want.logvar)
    _compare("encode.std", got.std, want.std)
    assert torch.equal(got.mode(), got.mean)

    want_sample = want.sample(generator=torch.Generator("cpu").manual_seed(0))
    got_sample = got.sample(generator=torch.Generator("cpu").manual_seed(0))
    _compare("encode.sample", got_sample, want_sample)
    # The noise itself is drawn bit-identically; only the moments carry float drift.
    want_noise = (want_sample - want.mean) / want.std
    got_noise = (got_sample - got.mean) / got.std
    torch.testing.assert_close(got_noise, want_noise, rtol=1e-4, atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("height,width", [(8, 8), (16, 12)])
def test_decode_matches(pair: tuple[torch.nn.Module, AutoencoderKL], height: int, width: int) -> None:
    ref, native = pair
    z = torch.randn(
        2, native.config["latent_channels"], height, width, generator=torch.Generator().manual_seed(2)
    )
    want = ref.decode(z).sample
    got = native.decode(z)
    f = native.spatial_compression_ratio
    assert got.shape == (2, 3, height * f, width * f)
    _compare("decode", got, want)


def test_sample_draws_bit_identical_noise() -> None:
    """Same moments in, same seeded sample out: one generator, and one generator per batch item."""
    moments = torch.randn(2, 8, 4, 3)
    dist = DiagonalGaussian.from_moments(moments)
    ref = diffusers.models.autoencoders.vae.DiagonalGaussianDistribution(moments)

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(s) for s in (3, 4)]

    torch.testing.assert_close(dist.sample(gens()), ref.sample(gens()), rtol=0, atol=0)
    torch.testing.assert_close(
        dist.sample(torch.Generator().manual_seed(5)),
        ref.sample(torch.Generator().manual_seed(5)),
        rtol=0,
        atol=0,
    )


def test_from_config_rejects_unknown_keys_and_ignores_private_ones() -> None:
    with torch.device("meta"):
        model = AutoencoderKL.from_config({"_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0"})
    assert model.config["latent_channels"] == 4
    with pytest.raises(ValueError, match="unknown keys.*not_a_key"):
        AutoencoderKL.from_config({"not_a_key": 1})


def test_unsupported_block_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="AttnDownEncoderBlock2D.*not supported"), torch.device("meta"):
        AutoencoderKL(down_block_types=("AttnDownEncoderBlock2D",))
