"""Native FLUX.2 VAE against Diffusers' `AutoencoderKLFlux2` on the same tiny random weights (fp32), and
its latent (un)normalisation against `Flux2Pipeline`'s formulas."""

from __future__ import annotations

import pytest
import torch
from tiny_vaes import FLUX2_TINY

from diffserve.models.vaes.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    parity_pair,
    randomize_norms,
)

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline  # noqa: E402

MAX_ABS = 1e-4
MIN_COS = 0.9999


def _perturb(ref: torch.nn.Module) -> None:
    """GroupNorms start as the identity and the bn statistics at (0, 1): perturb them so a misrouted
    tensor shows."""
    randomize_norms(ref)
    ref.bn.running_mean.copy_(torch.randn_like(ref.bn.running_mean))
    ref.bn.running_var.copy_(torch.rand_like(ref.bn.running_var) * 2 + 0.1)
    ref.bn.num_batches_tracked.fill_(7)


def _pair(**overrides: object) -> tuple[torch.nn.Module, AutoencoderKLFlux2]:
    # The released config.json carries force_upcast, which Diffusers' class does not declare.
    return parity_pair(
        diffusers.AutoencoderKLFlux2,
        AutoencoderKLFlux2,
        {**FLUX2_TINY, **overrides},
        perturb=_perturb,
        force_upcast=True,
    )


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, max_abs: float = MAX_ABS) -> None:
    assert_parity(got, want, f"flux2 vae {name}", max_abs=max_abs, min_cos=MIN_COS)


def test_state_dict_keys_shapes_and_config() -> None:
    ref, native = _pair()
    assert_same_state_dict_layout(native, ref, dtypes=True)
    got = native.state_dict()
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= got.keys()
    assert int(native.bn.num_batches_tracked) == 7
    for key, value in native.config.items():
        if key == "force_upcast":
            continue
        expected = ref.config[key]
        assert value == (tuple(expected) if isinstance(expected, list) else expected), key
    assert native.spatial_compression_ratio == 2
    with pytest.raises(ValueError, match="unknown keys.*scaling_factor"):
        AutoencoderKLFlux2.from_config({"scaling_factor": 0.3})


@torch.no_grad()
def test_encode_mode_and_sample_match_non_square() -> None:
    ref, native = _pair()
    x = torch.rand(2, 3, 24, 40, generator=torch.Generator().manual_seed(1)) * 2 - 1
    want = ref.encode(x).latent_dist
    got = native.encode(x)
    _compare("encode.mode", got.mode(), want.mode())
    _compare("encode.logvar", got.logvar, want.logvar)
    _compare(
        "encode.sample",
        got.sample(torch.Generator().manual_seed(0)),
        want.sample(generator=torch.Generator().manual_seed(0)),
    )


@torch.no_grad()
def test_decode_matches_non_square() -> None:
    ref, native = _pair()
    z = torch.randn(2, FLUX2_TINY["latent_channels"], 6, 10, generator=torch.Generator().manual_seed(2))
    want = ref.decode(z).sample
    got = native.decode(z)
    assert got.shape == (2, 3, 12, 20)
    _compare("decode", got, want)


@torch.no_grad()
def test_decoder_block_out_channels() -> None:
    ref, native = _pair(decoder_block_out_channels=[16, 48])
    assert native.decoder.conv_in.out_channels == 48
    z = torch.randn(1, FLUX2_TINY["latent_channels"], 4, 6, generator=torch.Generator().manual_seed(3))
    _compare("decode (own decoder widths)", native.decode(z), ref.decode(z).sample)


@torch.no_grad()
def test_patchify_and_bn_normalisation_follow_the_pipeline() -> None:
    """`patchify` + `normalize_latents` is `Flux2Pipeline._encode_vae_image`'s tail, and
    `denormalize_latents` + `unpatchify` the head of its decode, bit for bit, in fp32 and bf16."""
    ref, native = _pair()
    z = torch.randn(2, FLUX2_TINY["latent_channels"], 6, 10, generator=torch.Generator().manual_seed(4))
    patched = Flux2Pipeline._patchify_latents(z)
    torch.testing.assert_close(native.patchify(z), patched, rtol=0, atol=0)
    torch.testing.assert_close(native.unpatchify(patched), z, rtol=0, atol=0)

    for dtype in (torch.float32, torch.bfloat16):
        latents = patched.to(dtype)
        mean = ref.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(ref.bn.running_var.view(1, -1, 1, 1) + ref.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        normed = native.normalize_latents(latents)
        torch.testing.assert_close(normed, (latents - mean) / std, rtol=0, atol=0)
        torch.testing.assert_close(native.denormalize_latents(normed), normed * std + mean, rtol=0, atol=0)
        assert normed.dtype == dtype
    # Round trip in fp32 recovers the latents; the statistics are really used.
    normed = native.normalize_latents(patched)
    torch.testing.assert_close(native.denormalize_latents(normed), patched, rtol=1e-5, atol=1e-5)
    assert (normed - patched).abs().max() > 0.1
    with pytest.raises(ValueError, match="patchified latents"):
        native.normalize_latents(z)


def test_loader_reads_a_diffusers_folder(tmp_path) -> None:
    """Through the native loader: floating tensors (the bn statistics too) take the load dtype, the
    integer `num_batches_tracked` keeps int64, and the released config's extra `force_upcast` is read."""
    import json

    from diffserve.loader.component_loader import load_native_model
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.platforms import CpuPlatform

    ref, _ = _pair()
    ref.save_pretrained(tmp_path / "vae")
    config_path = tmp_path / "vae" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "force_upcast": True}))
    spec = ComponentSpec("vae", "diffusers", "AutoencoderKLFlux2", tmp_path / "vae")
    model, _ = load_native_model(spec, AutoencoderKLFlux2, CpuPlatform(), torch.bfloat16)
    assert model.bn.running_var.dtype == torch.bfloat16
    assert model.bn.num_batches_tracked.dtype == torch.int64
    assert model.config["force_upcast"] is True
    torch.testing.assert_close(model.bn.running_mean.float(), ref.bn.running_mean.bfloat16().float())
