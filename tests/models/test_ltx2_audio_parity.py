"""Native LTX-2 audio VAE and vocoders against Diffusers' `AutoencoderKLLTX2Audio`, `LTX2Vocoder` and
`LTX2VocoderWithBWE` on the same tiny random weights (fp32, CPU, fixed seeds).

The native models are built on the meta device from the Diffusers config and filled with the reference's
state dict (`strict=True`), exactly as a checkpoint is loaded. Each comparison prints the SNR of the
native output against the reference (in dB; "exact" when bit-identical) and the max abs difference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diffserve.models.vaes.autoencoder_kl_ltx2_audio import (
    LTX2_AUDIO_VAE_CONFIG_DEFAULTS,
    AutoencoderKLLTX2Audio,
)
from diffserve.models.vaes.ltx2_vocoder import (
    LTX2_VOCODER_BWE_CONFIG_DEFAULTS,
    LTX2_VOCODER_CONFIG_DEFAULTS,
    LTX2Vocoder,
    LTX2VocoderWithBWE,
)
from diffserve.testing.parity import (
    assert_parity,
    assert_same_state_dict_layout,
    diffusers_init_defaults,
    parity_pair,
    perturb_parameters,
)

diffusers = pytest.importorskip("diffusers")
ref_vocoders = pytest.importorskip("diffusers.pipelines.ltx2.vocoder")

MAX_ABS = 1e-5
MIN_SNR_DB = 100.0

#: LTX-2's audio VAE layout (pixel norm, causal in time, three levels so the decoder's own 4x - 3 causal
#: length is exercised) at a tiny width: 16 mel bins -> 4 latent bins, 4 latent channels.
VAE_LTX2: dict[str, Any] = {
    "base_channels": 8,
    "ch_mult": [1, 2, 2],
    "num_res_blocks": 1,
    "latent_channels": 4,
    "mel_bins": 16,
    "resolution": 16,
}
#: Branches real checkpoints do not take but the config allows: causal along mel bins, attention in a
#: level and in the middle.
VAE_WIDTH_ATTN: dict[str, Any] = {
    **VAE_LTX2,
    "causality_axis": "width",
    "attn_resolutions": [8],
    "mid_block_add_attention": True,
}
#: GroupNorm (non-causal only) and two levels: the decoder's 2x output is zero-padded to 4x - 3 frames.
VAE_GROUP_TWO_LEVELS: dict[str, Any] = {
    "base_channels": 32,
    "ch_mult": [1, 2],
    "num_res_blocks": 1,
    "latent_channels": 4,
    "mel_bins": 16,
    "norm_type": "group",
    "causality_axis": "none",
}
VAE_CONFIGS = {"ltx2": VAE_LTX2, "width-attn": VAE_WIDTH_ATTN, "group-2-levels": VAE_GROUP_TWO_LEVELS}

#: LTX-2's vocoder (LeakyReLU, tanh) at a tiny width: 2 channels x 16 mel bins in, 12 samples per frame.
VOCODER_LTX2: dict[str, Any] = {
    "in_channels": 32,
    "hidden_channels": 32,
    "upsample_kernel_sizes": [12, 4],
    "upsample_factors": [6, 2],
    "resnet_kernel_sizes": [3, 7],
    "resnet_dilations": [[1, 3, 5], [1, 3, 5]],
}
#: LTX-2.3's generator type (anti-aliased SnakeBeta, no final activation or bias).
VOCODER_SNAKEBETA: dict[str, Any] = {
    **VOCODER_LTX2,
    "resnet_kernel_sizes": [3, 5],
    "resnet_dilations": [[1, 3], [1, 2]],
    "act_fn": "snakebeta",
    "antialias": True,
    "final_act_fn": None,
    "final_bias": False,
}
#: Snake without beta, not anti-aliased in the resnets, clamped output.
VOCODER_SNAKE_CLAMP: dict[str, Any] = {
    **VOCODER_LTX2,
    "resnet_kernel_sizes": [3],
    "resnet_dilations": [[1, 3]],
    "act_fn": "snake",
    "final_act_fn": "clamp",
}
VOCODER_CONFIGS = {"ltx2": VOCODER_LTX2, "snakebeta": VOCODER_SNAKEBETA, "snake-clamp": VOCODER_SNAKE_CLAMP}

#: LTX-2.3's vocoder with bandwidth extension at a tiny size: 8 kHz generator (10 samples per frame,
#: not a multiple of the 4-sample mel hop, so the hop padding runs) -> 2x Hann resampler + BWE to 16 kHz.
VOCODER_BWE: dict[str, Any] = {
    "in_channels": 32,
    "hidden_channels": 32,
    "upsample_kernel_sizes": [11, 4],
    "upsample_factors": [5, 2],
    "resnet_kernel_sizes": [3, 5],
    "resnet_dilations": [[1, 3], [1, 2]],
    "bwe_in_channels": 32,
    "bwe_hidden_channels": 16,
    "bwe_upsample_kernel_sizes": [8, 4],
    "bwe_upsample_factors": [4, 2],
    "bwe_resnet_kernel_sizes": [3],
    "bwe_resnet_dilations": [[1, 2]],
    "filter_length": 32,
    "hop_length": 4,
    "window_length": 32,
    "num_mel_channels": 16,
    "input_sampling_rate": 8000,
    "output_sampling_rate": 16000,
}


def _perturb(model: torch.nn.Module) -> None:
    """Move every parameter off its init (SnakeBeta's zeros included) so a misrouted weight shows."""
    perturb_parameters(model, 0.05)


def _compare(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert want.abs().max().item() > 0, f"{label}: the reference is all zeros"
    assert_parity(got, want, f"ltx2 audio parity {label}", min_db=MIN_SNR_DB, max_abs=MAX_ABS)


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# ------------------------------------------------------------------------------------------------ audio VAE


@pytest.fixture(scope="module", params=sorted(VAE_CONFIGS))
def vae_pair(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, AutoencoderKLLTX2Audio]:
    def perturb(ref: torch.nn.Module) -> None:
        _perturb(ref)
        ref.latents_mean.normal_()
        ref.latents_std.uniform_(0.5, 2.0)

    config = VAE_CONFIGS[request.param]
    return request.param, *parity_pair(
        diffusers.AutoencoderKLLTX2Audio, AutoencoderKLLTX2Audio, config, perturb=perturb
    )


def test_vae_state_dict_matches(vae_pair: tuple[str, torch.nn.Module, AutoencoderKLLTX2Audio]) -> None:
    _, ref, ours = vae_pair
    assert_same_state_dict_layout(ours, ref)


def test_vae_decode(vae_pair: tuple[str, torch.nn.Module, AutoencoderKLLTX2Audio]) -> None:
    """Batch 2 of 5 latent steps -> 4 * 5 - 3 = 17 mel frames of 16 bins; and a single latent step."""
    name, ref, ours = vae_pair
    g = torch.Generator().manual_seed(1)
    for shape, frames in (((2, 4, 5, 4), 17), ((1, 4, 1, 4), 1)):
        z = torch.randn(shape, generator=g)
        with torch.no_grad():
            want = ref.decode(z).sample
            got = ours.decode(z)
        assert got.shape == (shape[0], 2, frames, 16)
        _compare(f"{name} decode {tuple(shape)}", got, want)


def test_vae_encode(vae_pair: tuple[str, torch.nn.Module, AutoencoderKLLTX2Audio]) -> None:
    name, ref, ours = vae_pair
    mel = torch.randn(2, 2, 17, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.encode(mel).latent_dist
        got = ours.encode(mel)
    _compare(f"{name} encode mean", got.mean, want.mean)
    _compare(f"{name} encode logvar", got.logvar, want.logvar)
    _compare(
        f"{name} encode sample",
        got.sample(torch.Generator().manual_seed(7)),
        want.sample(torch.Generator().manual_seed(7)),
    )


def test_vae_latent_statistics_and_helpers(
    vae_pair: tuple[str, torch.nn.Module, AutoencoderKLLTX2Audio],
) -> None:
    """What LTX2Pipeline reads: the (de)normalisation of packed latents, compression ratios, mel sizes."""
    _, ref, ours = vae_pair
    packed = torch.randn(2, 5, ref.latents_mean.numel(), generator=torch.Generator().manual_seed(3))
    mean, std = ref.latents_mean, ref.latents_std
    torch.testing.assert_close(ours.normalize_latents(packed), (packed - mean) / std, rtol=0, atol=0)
    torch.testing.assert_close(ours.denormalize_latents(packed), packed * std + mean, rtol=0, atol=0)
    assert ours.temporal_compression_ratio == ref.temporal_compression_ratio == 4
    assert ours.mel_compression_ratio == ref.mel_compression_ratio == 4
    assert ours.latent_mel_bins == ref.config.mel_bins // ref.mel_compression_ratio
    for key in ("sample_rate", "mel_hop_length", "mel_bins", "latent_channels"):
        assert ours.config[key] == ref.config[key]
    assert ours.latents_per_second == pytest.approx(16000 / 160 / 4)


def test_vae_config_defaults_match_diffusers() -> None:
    want = {k: _as_tuples(v) for k, v in diffusers_init_defaults(diffusers.AutoencoderKLLTX2Audio).items()}
    assert {k: _as_tuples(v) for k, v in LTX2_AUDIO_VAE_CONFIG_DEFAULTS.items()} == want
    assert AutoencoderKLLTX2Audio.diffusers_class_name == "AutoencoderKLLTX2Audio"
    with torch.device("meta"):
        model = AutoencoderKLLTX2Audio.from_config({"_class_name": "AutoencoderKLLTX2Audio"})
    assert model.config == {k: _as_tuples(v) for k, v in LTX2_AUDIO_VAE_CONFIG_DEFAULTS.items()}


def test_vae_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        AutoencoderKLLTX2Audio.from_config({**VAE_LTX2, "tanh_out": True})
    with pytest.raises(ValueError, match="causality_axis"):
        AutoencoderKLLTX2Audio.from_config({**VAE_LTX2, "causality_axis": "time"})
    with pytest.raises(ValueError, match="norm_type"):
        AutoencoderKLLTX2Audio.from_config({**VAE_LTX2, "norm_type": "layer"})
    with pytest.raises(ValueError, match="group"):  # GroupNorm only without causality, as in Diffusers
        AutoencoderKLLTX2Audio.from_config({**VAE_GROUP_TWO_LEVELS, "causality_axis": "height"})


# ------------------------------------------------------------------------------------------------ vocoders


@pytest.mark.parametrize("name", sorted(VOCODER_CONFIGS))
def test_vocoder_parity(name: str) -> None:
    ref, ours = parity_pair(ref_vocoders.LTX2Vocoder, LTX2Vocoder, VOCODER_CONFIGS[name], perturb=_perturb)
    assert_same_state_dict_layout(ours, ref)
    mel = torch.randn(2, 2, 6, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(mel)
        got = ours(mel)
        got_time_last = ours(mel.transpose(2, 3), time_last=True)
    assert got.shape == (2, 2, ours.num_samples(6)) == (2, 2, 6 * 12)
    _compare(f"vocoder {name}", got, want)
    torch.testing.assert_close(got_time_last, got, rtol=0, atol=0)
    assert ours.sample_rate == ref.config.output_sampling_rate


def test_vocoder_with_bwe_parity() -> None:
    def perturb(ref: torch.nn.Module) -> None:
        _perturb(ref)
        # checkpoint buffers (DFT bases, mel filterbank) start at zero in Diffusers
        ref.mel_stft.stft_fn.forward_basis.normal_(std=0.1)
        ref.mel_stft.stft_fn.inverse_basis.normal_(std=0.1)
        ref.mel_stft.mel_basis.uniform_(0.0, 0.2)

    ref, ours = parity_pair(ref_vocoders.LTX2VocoderWithBWE, LTX2VocoderWithBWE, VOCODER_BWE, perturb=perturb)
    assert_same_state_dict_layout(ours, ref)
    mel = torch.randn(2, 2, 7, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(mel)
        got = ours(mel)
    assert got.shape == (2, 2, ours.num_samples(7)) == (2, 2, 7 * 10 * 2)
    clipped = (want.abs() >= 1).float().mean().item()
    print(f"[ltx2 audio parity bwe] {clipped:.0%} of reference samples at the +-1 clamp")
    assert clipped < 0.5, "the test signal saturates; it would hide differences"
    _compare("vocoder with BWE", got, want)
    assert ours.sample_rate == 16000


def test_vocoder_config_defaults_match_diffusers() -> None:
    for ours_cls, defaults, ref_cls in (
        (LTX2Vocoder, LTX2_VOCODER_CONFIG_DEFAULTS, ref_vocoders.LTX2Vocoder),
        (LTX2VocoderWithBWE, LTX2_VOCODER_BWE_CONFIG_DEFAULTS, ref_vocoders.LTX2VocoderWithBWE),
    ):
        want = {k: _as_tuples(v) for k, v in diffusers_init_defaults(ref_cls).items()}
        assert {k: _as_tuples(v) for k, v in defaults.items()} == want
        assert ours_cls.diffusers_class_name == ref_cls.__name__
        with torch.device("meta"):
            model = ours_cls.from_config({})
        assert model.config == {k: _as_tuples(v) for k, v in defaults.items()}


def test_vocoder_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        LTX2Vocoder.from_config({**VOCODER_LTX2, "stereo": True})
    with pytest.raises(ValueError, match="unknown keys"):
        LTX2VocoderWithBWE.from_config({**VOCODER_BWE, "resblock": "AMP1"})
    with pytest.raises(ValueError, match="act_fn"):
        LTX2Vocoder.from_config({**VOCODER_LTX2, "act_fn": "gelu"})
    with pytest.raises(ValueError, match="final_act_fn"):
        LTX2Vocoder.from_config({**VOCODER_LTX2, "final_act_fn": "sigmoid"})
    with pytest.raises(ValueError, match="antialias"):
        LTX2Vocoder.from_config({**VOCODER_LTX2, "antialias": True})
    with pytest.raises(ValueError, match="same length"):
        LTX2Vocoder.from_config({**VOCODER_LTX2, "upsample_factors": [6]})
    with pytest.raises(ValueError, match="multiple"):
        LTX2VocoderWithBWE.from_config({**VOCODER_BWE, "output_sampling_rate": 12000})
