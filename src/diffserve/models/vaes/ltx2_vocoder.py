"""Diffusers' LTX-2 vocoders: `LTX2Vocoder` (LTX-2, mel -> 24 kHz) and `LTX2VocoderWithBWE` (LTX-2.3,
mel -> 16 kHz -> bandwidth-extended 48 kHz).

`LTX2Vocoder` is a HiFi-GAN/BigVGAN-style generator: a conv over (channels x mel bins) features, then per
stage a transposed-conv upsampler followed by the mean of parallel dilated resnets, then an output conv.
LTX-2 uses LeakyReLU activations; LTX-2.3 uses SnakeBeta ones wrapped in anti-aliasing (2x Kaiser-sinc
up-sample, activation, down-sample).

`LTX2VocoderWithBWE` runs one such generator at `input_sampling_rate`, recomputes a causal log-mel
spectrogram of its output (STFT bases and mel filterbank are checkpoint buffers), runs a second generator
(the BWE) on it and adds the result to a Hann-sinc resampled copy of the first waveform.

Both take the audio VAE's mel output (B, channels, frames, mel_bins) and return a waveform
(B, out_channels, samples) at `sample_rate`. State-dict keys match Diffusers', so checkpoints load with
`strict=True` into a model built on the meta device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured

ACT_FNS: tuple[str, ...] = ("snakebeta", "snake", "leaky_relu")
FINAL_ACT_FNS: tuple[str | None, ...] = ("tanh", "clamp", None)

#: Diffusers' `LTX2Vocoder` config keys and defaults (LTX-2's vocoder).
LTX2_VOCODER_CONFIG_DEFAULTS: dict[str, Any] = {
    "in_channels": 128,
    "hidden_channels": 1024,
    "out_channels": 2,
    "upsample_kernel_sizes": (16, 15, 8, 4, 4),
    "upsample_factors": (6, 5, 2, 2, 2),
    "resnet_kernel_sizes": (3, 7, 11),
    "resnet_dilations": ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
    "act_fn": "leaky_relu",
    "leaky_relu_negative_slope": 0.1,
    "antialias": False,
    "antialias_ratio": 2,
    "antialias_kernel_size": 12,
    "final_act_fn": "tanh",
    "final_bias": True,
    "output_sampling_rate": 24000,
}

#: Diffusers' `LTX2VocoderWithBWE` config keys and defaults (LTX-2.3's vocoder): the first generator's
#: keys, the BWE generator's under `bwe_`, and the mel / resampling settings between them.
LTX2_VOCODER_BWE_CONFIG_DEFAULTS: dict[str, Any] = {
    "in_channels": 128,
    "hidden_channels": 1536,
    "out_channels": 2,
    "upsample_kernel_sizes": (11, 4, 4, 4, 4, 4),
    "upsample_factors": (5, 2, 2, 2, 2, 2),
    "resnet_kernel_sizes": (3, 7, 11),
    "resnet_dilations": ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
    "act_fn": "snakebeta",
    "leaky_relu_negative_slope": 0.1,
    "antialias": True,
    "antialias_ratio": 2,
    "antialias_kernel_size": 12,
    "final_act_fn": None,
    "final_bias": False,
    "bwe_in_channels": 128,
    "bwe_hidden_channels": 512,
    "bwe_out_channels": 2,
    "bwe_upsample_kernel_sizes": (12, 11, 4, 4, 4),
    "bwe_upsample_factors": (6, 5, 2, 2, 2),
    "bwe_resnet_kernel_sizes": (3, 7, 11),
    "bwe_resnet_dilations": ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
    "bwe_act_fn": "snakebeta",
    "bwe_leaky_relu_negative_slope": 0.1,
    "bwe_antialias": True,
    "bwe_antialias_ratio": 2,
    "bwe_antialias_kernel_size": 12,
    "bwe_final_act_fn": None,
    "bwe_final_bias": False,
    "filter_length": 512,
    "hop_length": 80,
    "window_length": 512,
    "num_mel_channels": 64,
    "input_sampling_rate": 16000,
    "output_sampling_rate": 48000,
}

#: The generator keys of `LTX2VocoderWithBWE` that take a `bwe_` prefix for its second generator.
_GENERATOR_KEYS: tuple[str, ...] = tuple(
    k for k in LTX2_VOCODER_CONFIG_DEFAULTS if k != "output_sampling_rate"
)


# ------------------------------------------------------------------------------------------------ filters


def kaiser_sinc_lowpass(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """A unit-DC-gain windowed-sinc low-pass of `kernel_size` taps (BigVGAN's), in float32 on the CPU.

    `cutoff` is relative to the sample rate (0 .. 0.5); the Kaiser beta follows from the transition width
    `half_width` by Kaiser's empirical attenuation formula. Built explicitly on the CPU so that a model
    constructed under `torch.device("meta")` still gets real taps where it needs them.
    """
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    cpu = torch.device("cpu")
    window = torch.kaiser_window(kernel_size, periodic=False, beta=beta, device=cpu)
    if kernel_size % 2 == 0:
        t = torch.arange(-half, half, device=cpu) + 0.5
    else:
        t = torch.arange(kernel_size, device=cpu) - half
    if cutoff == 0.0:
        return torch.zeros_like(t, dtype=torch.float32)
    t = 2 * cutoff * t
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(math.pi * t) / math.pi / t)
    taps = 2 * cutoff * window * sinc
    return taps / taps.sum()


def hann_sinc_interpolator(ratio: int, zero_crossings: int = 6, rolloff: float = 0.99) -> torch.Tensor:
    """Taps of a Hann-windowed sinc interpolation filter for `ratio`x upsampling (torchaudio-style
    resampling kernel: `zero_crossings` lobes per side, passband `rolloff` of Nyquist), float32 on the CPU."""
    width = math.ceil(zero_crossings / rolloff)
    cpu = torch.device("cpu")
    t = (torch.arange(2 * width * ratio + 1, device=cpu) / ratio - width) * rolloff
    window = torch.cos(t.clamp(-zero_crossings, zero_crossings) * math.pi / zero_crossings / 2) ** 2
    return torch.sinc(t) * window * rolloff / ratio


class KaiserUpsample1d(nn.Module):
    """`ratio`x upsampling of (B, C, T) by zero-stuffing and Kaiser-sinc low-pass (replicate-padded edges);
    `filter` is a checkpoint buffer."""

    filter: torch.Tensor

    def __init__(self, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.pad = kernel_size // ratio - 1
        self.crop_left = self.pad * ratio + (kernel_size - ratio) // 2
        self.crop_right = self.pad * ratio + (kernel_size - ratio + 1) // 2
        taps = kaiser_sinc_lowpass(0.5 / ratio, 0.6 / ratio, kernel_size)
        self.register_buffer("filter", taps.view(1, 1, kernel_size).to(torch.get_default_device()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        taps = self.filter.to(x.device, x.dtype).expand(channels, -1, -1)
        x = self.ratio * F.conv_transpose1d(x, taps, stride=self.ratio, groups=channels)
        return x[..., self.crop_left : -self.crop_right]


class KaiserDownsample1d(nn.Module):
    """Kaiser-sinc low-pass then keep every `ratio`-th sample of (B, C, T); `filter` is a checkpoint buffer."""

    filter: torch.Tensor

    def __init__(self, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.padding = (kernel_size // 2 + kernel_size % 2 - 1, kernel_size // 2)
        taps = kaiser_sinc_lowpass(0.5 / ratio, 0.6 / ratio, kernel_size)
        self.register_buffer("filter", taps.view(1, 1, kernel_size).to(torch.get_default_device()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, self.padding, mode="replicate")
        taps = self.filter.to(x.dtype).expand(channels, -1, -1)
        return F.conv1d(x, taps, stride=self.ratio, groups=channels)


class HannUpsample1d(nn.Module):
    """`ratio`x sinc-interpolation resampler of (B, C, T) (the BWE skip path). Its taps are not in
    checkpoints, so they are kept as a CPU tensor computed here and moved to the input on each call,
    never as a buffer that a meta-device build would leave empty."""

    def __init__(self, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.taps = hann_sinc_interpolator(ratio).view(1, 1, -1)
        kernel_size = self.taps.shape[-1]
        self.pad = (kernel_size - 1) // (2 * ratio)  # the filter's width in input samples
        self.crop_left = 2 * self.pad * ratio
        self.crop_right = kernel_size - ratio

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        taps = self.taps.to(x.device, x.dtype).expand(channels, -1, -1)
        x = self.ratio * F.conv_transpose1d(x, taps, stride=self.ratio, groups=channels)
        return x[..., self.crop_left : -self.crop_right]


# ------------------------------------------------------------------------------------------------ generator


class SnakeBeta(nn.Module):
    """x + sin(a x)^2 / b per channel, with a = exp(alpha) and b = exp(beta) (or b = a without `beta`)."""

    def __init__(self, channels: int, use_beta: bool) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels)) if use_beta else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.view(1, -1, 1).exp()
        amplitude = alpha if self.beta is None else self.beta.view(1, -1, 1).exp()
        return x + (1.0 / (amplitude + 1e-9)) * torch.sin(x * alpha).pow(2)


class AntiAliasAct1d(nn.Module):
    """An activation run at `ratio`x the sample rate (Kaiser-sinc up, activate, down) to limit aliasing."""

    def __init__(self, act: nn.Module, ratio: int, kernel_size: int) -> None:
        super().__init__()
        self.upsample = KaiserUpsample1d(ratio, kernel_size)
        self.act = act
        self.downsample = KaiserDownsample1d(ratio, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


def _activation(
    channels: int, act_fn: str, slope: float, antialias: bool, ratio: int, kernel: int
) -> nn.Module:
    """A resnet activation: SnakeBeta ("snakebeta"), Snake ("snake") or LeakyReLU, optionally anti-aliased."""
    if act_fn in ("snakebeta", "snake"):
        act: nn.Module = SnakeBeta(channels, use_beta=act_fn == "snakebeta")
    else:
        act = nn.LeakyReLU(negative_slope=slope)
    return AntiAliasAct1d(act, ratio, kernel) if antialias else act


class ResBlock(nn.Module):
    """`len(dilations)` residual units, each act -> dilated conv -> act -> conv (odd kernels keep length)."""

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        dilations: Sequence[int],
        act_fn: str,
        slope: float,
        antialias: bool,
        antialias_ratio: int,
        antialias_kernel_size: int,
    ) -> None:
        super().__init__()

        def acts() -> nn.ModuleList:
            return nn.ModuleList(
                _activation(channels, act_fn, slope, antialias, antialias_ratio, antialias_kernel_size)
                for _ in dilations
            )

        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding="same") for d in dilations
        )
        self.acts1 = acts()
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding="same") for _ in dilations
        )
        self.acts2 = acts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.acts1, self.convs1, self.acts2, self.convs2, strict=True):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class LTX2Vocoder(DiffusersConfigured, nn.Module):
    """Mel spectrogram -> waveform generator with Diffusers' `LTX2Vocoder` config keys and weight names.

    Input (B, C, frames, mel_bins) with C * mel_bins == in_channels (or (B, C, mel_bins, frames) with
    `time_last`); output (B, out_channels, num_samples(frames)) at `output_sampling_rate`.
    """

    diffusers_class_name: ClassVar[str] = "LTX2Vocoder"
    config_defaults = LTX2_VOCODER_CONFIG_DEFAULTS

    def __init__(
        self,
        in_channels: int = 128,
        hidden_channels: int = 1024,
        out_channels: int = 2,
        upsample_kernel_sizes: Sequence[int] = (16, 15, 8, 4, 4),
        upsample_factors: Sequence[int] = (6, 5, 2, 2, 2),
        resnet_kernel_sizes: Sequence[int] = (3, 7, 11),
        resnet_dilations: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        act_fn: str = "leaky_relu",
        leaky_relu_negative_slope: float = 0.1,
        antialias: bool = False,
        antialias_ratio: int = 2,
        antialias_kernel_size: int = 12,
        final_act_fn: str | None = "tanh",
        final_bias: bool = True,
        output_sampling_rate: int = 24000,
    ) -> None:
        super().__init__()
        name = self.diffusers_class_name
        if len(upsample_kernel_sizes) != len(upsample_factors):
            raise ValueError(
                f"{name}: upsample_kernel_sizes and upsample_factors must have the same length, got "
                f"{len(upsample_kernel_sizes)} and {len(upsample_factors)}"
            )
        if len(resnet_kernel_sizes) != len(resnet_dilations):
            raise ValueError(
                f"{name}: resnet_kernel_sizes and resnet_dilations must have the same length, got "
                f"{len(resnet_kernel_sizes)} and {len(resnet_dilations)}"
            )
        if act_fn not in ACT_FNS:
            raise ValueError(f"{name}: act_fn must be one of {ACT_FNS}, got {act_fn!r}")
        if act_fn == "leaky_relu" and antialias:
            # Diffusers' ResBlock re-wraps one shared anti-aliased LeakyReLU inside itself in this case (a
            # nesting no checkpoint was trained with); refuse it rather than guess.
            raise ValueError(f"{name}: antialias=True needs act_fn 'snakebeta' or 'snake', got 'leaky_relu'")
        if final_act_fn not in FINAL_ACT_FNS:
            raise ValueError(f"{name}: final_act_fn must be one of {FINAL_ACT_FNS}, got {final_act_fn!r}")
        self.config: dict[str, Any] = {
            "in_channels": in_channels,
            "hidden_channels": hidden_channels,
            "out_channels": out_channels,
            "upsample_kernel_sizes": tuple(upsample_kernel_sizes),
            "upsample_factors": tuple(upsample_factors),
            "resnet_kernel_sizes": tuple(resnet_kernel_sizes),
            "resnet_dilations": tuple(tuple(d) for d in resnet_dilations),
            "act_fn": act_fn,
            "leaky_relu_negative_slope": leaky_relu_negative_slope,
            "antialias": antialias,
            "antialias_ratio": antialias_ratio,
            "antialias_kernel_size": antialias_kernel_size,
            "final_act_fn": final_act_fn,
            "final_bias": final_bias,
            "output_sampling_rate": output_sampling_rate,
        }
        self.resnets_per_upsample = len(resnet_kernel_sizes)

        self.conv_in = nn.Conv1d(in_channels, hidden_channels, 7, padding=3)
        self.upsamplers = nn.ModuleList()
        self.resnets = nn.ModuleList()
        width = hidden_channels
        for factor, kernel in zip(upsample_factors, upsample_kernel_sizes, strict=True):
            self.upsamplers.append(
                nn.ConvTranspose1d(width, width // 2, kernel, stride=factor, padding=(kernel - factor) // 2)
            )
            width //= 2
            for res_kernel, dilations in zip(resnet_kernel_sizes, resnet_dilations, strict=True):
                self.resnets.append(
                    ResBlock(
                        width,
                        res_kernel,
                        dilations,
                        act_fn,
                        leaky_relu_negative_slope,
                        antialias,
                        antialias_ratio,
                        antialias_kernel_size,
                    )
                )
        if act_fn == "leaky_relu":
            # The original model's output activation uses LeakyReLU's default slope, not the configured one.
            self.act_out: nn.Module = nn.LeakyReLU()
        else:
            # Snake variants always end in an anti-aliased SnakeBeta (with beta), whatever `antialias` says.
            self.act_out = AntiAliasAct1d(
                SnakeBeta(width, use_beta=True), antialias_ratio, antialias_kernel_size
            )
        self.conv_out = nn.Conv1d(width, out_channels, 7, padding=3, bias=final_bias)

    @property
    def sample_rate(self) -> int:
        """Sample rate of the waveform `forward` returns (Diffusers' `config.output_sampling_rate`)."""
        return int(self.config["output_sampling_rate"])

    def num_samples(self, num_frames: int) -> int:
        """Length of the waveform `forward` makes from `num_frames` mel frames: num_frames times the product
        of the upsample factors when each kernel size minus its factor is even (every LTX-2 config)."""
        length = num_frames
        for factor, kernel in zip(
            self.config["upsample_factors"], self.config["upsample_kernel_sizes"], strict=True
        ):
            length = (length - 1) * factor - 2 * ((kernel - factor) // 2) + kernel
        return length

    def forward(self, mel: torch.Tensor, time_last: bool = False) -> torch.Tensor:
        """Mel (B, C, frames, mel_bins), or (B, C, mel_bins, frames) with `time_last` -> (B, out_channels, samples)."""
        if not time_last:
            mel = mel.transpose(2, 3)
        x = self.conv_in(mel.flatten(1, 2))
        leaky = self.config["act_fn"] == "leaky_relu"
        slope = self.config["leaky_relu_negative_slope"]
        per_stage = self.resnets_per_upsample
        for stage, upsampler in enumerate(self.upsamplers):
            if leaky:  # snake variants activate inside their resnets only
                x = F.leaky_relu(x, slope)
            x = upsampler(x)
            resnets = self.resnets[stage * per_stage : (stage + 1) * per_stage]
            x = torch.stack([resnet(x) for resnet in resnets]).mean(dim=0)
        x = self.conv_out(self.act_out(x))
        if self.config["final_act_fn"] == "tanh":
            return torch.tanh(x)
        if self.config["final_act_fn"] == "clamp":
            return x.clamp(-1, 1)
        return x


# ------------------------------------------------------------------------------------------------ BWE


class CausalSTFT(nn.Module):
    """Magnitude STFT with left-only padding, as a strided conv with the checkpoint's windowed DFT basis
    (`forward_basis`: real rows then imaginary rows). `inverse_basis` is carried for the state dict only."""

    forward_basis: torch.Tensor
    inverse_basis: torch.Tensor

    def __init__(self, filter_length: int, hop_length: int, window_length: int) -> None:
        super().__init__()
        self.hop_length = hop_length
        self.left_pad = max(0, window_length - hop_length)
        n_freqs = filter_length // 2 + 1
        self.register_buffer("forward_basis", torch.zeros(2 * n_freqs, 1, filter_length))
        self.register_buffer("inverse_basis", torch.zeros(2 * n_freqs, 1, filter_length))

    def magnitude(self, waveform: torch.Tensor) -> torch.Tensor:
        """(N, samples) or (N, 1, samples) -> (N, n_freqs, frames)."""
        if waveform.ndim == 2:
            waveform = waveform.unsqueeze(1)
        spec = F.conv1d(F.pad(waveform, (self.left_pad, 0)), self.forward_basis, stride=self.hop_length)
        real, imag = spec.chunk(2, dim=1)
        return torch.sqrt(real**2 + imag**2)


class MelSTFT(nn.Module):
    """Causal log-mel spectrogram with the checkpoint's mel filterbank (`mel_basis`), floored at 1e-5."""

    mel_basis: torch.Tensor

    def __init__(
        self, filter_length: int, hop_length: int, window_length: int, num_mel_channels: int
    ) -> None:
        super().__init__()
        self.stft_fn = CausalSTFT(filter_length, hop_length, window_length)
        self.register_buffer("mel_basis", torch.zeros(num_mel_channels, filter_length // 2 + 1))

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        """(N, samples) -> log-mel (N, num_mel_channels, frames)."""
        magnitude = self.stft_fn.magnitude(waveform)
        mel = torch.matmul(self.mel_basis.to(magnitude.dtype), magnitude)
        return torch.log(mel.clamp(min=1e-5))


class LTX2VocoderWithBWE(DiffusersConfigured, nn.Module):
    """LTX-2.3's vocoder: a mel -> `input_sampling_rate` generator (`vocoder`), then bandwidth extension
    to `output_sampling_rate` (`bwe_generator` on the first waveform's causal log-mel, plus a resampled
    skip), clamped to [-1, 1]; Diffusers' `LTX2VocoderWithBWE` config keys and weight names."""

    diffusers_class_name: ClassVar[str] = "LTX2VocoderWithBWE"
    config_defaults = LTX2_VOCODER_BWE_CONFIG_DEFAULTS

    def __init__(
        self,
        in_channels: int = 128,
        hidden_channels: int = 1536,
        out_channels: int = 2,
        upsample_kernel_sizes: Sequence[int] = (11, 4, 4, 4, 4, 4),
        upsample_factors: Sequence[int] = (5, 2, 2, 2, 2, 2),
        resnet_kernel_sizes: Sequence[int] = (3, 7, 11),
        resnet_dilations: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        act_fn: str = "snakebeta",
        leaky_relu_negative_slope: float = 0.1,
        antialias: bool = True,
        antialias_ratio: int = 2,
        antialias_kernel_size: int = 12,
        final_act_fn: str | None = None,
        final_bias: bool = False,
        bwe_in_channels: int = 128,
        bwe_hidden_channels: int = 512,
        bwe_out_channels: int = 2,
        bwe_upsample_kernel_sizes: Sequence[int] = (12, 11, 4, 4, 4),
        bwe_upsample_factors: Sequence[int] = (6, 5, 2, 2, 2),
        bwe_resnet_kernel_sizes: Sequence[int] = (3, 7, 11),
        bwe_resnet_dilations: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        bwe_act_fn: str = "snakebeta",
        bwe_leaky_relu_negative_slope: float = 0.1,
        bwe_antialias: bool = True,
        bwe_antialias_ratio: int = 2,
        bwe_antialias_kernel_size: int = 12,
        bwe_final_act_fn: str | None = None,
        bwe_final_bias: bool = False,
        filter_length: int = 512,
        hop_length: int = 80,
        window_length: int = 512,
        num_mel_channels: int = 64,
        input_sampling_rate: int = 16000,
        output_sampling_rate: int = 48000,
    ) -> None:
        super().__init__()
        name = self.diffusers_class_name
        # The constructor's arguments by Diffusers' key names (the signature spells them out for typing).
        cfg: dict[str, Any] = {
            key: value for key, value in locals().items() if key in LTX2_VOCODER_BWE_CONFIG_DEFAULTS
        }
        for key in ("upsample_kernel_sizes", "upsample_factors", "resnet_kernel_sizes"):
            for prefix in ("", "bwe_"):
                cfg[prefix + key] = tuple(cfg[prefix + key])
        for prefix in ("", "bwe_"):
            cfg[prefix + "resnet_dilations"] = tuple(tuple(d) for d in cfg[prefix + "resnet_dilations"])
        input_rate, output_rate = cfg["input_sampling_rate"], cfg["output_sampling_rate"]
        if input_rate <= 0 or output_rate % input_rate != 0:
            raise ValueError(
                f"{name}: output_sampling_rate ({output_rate}) must be a whole multiple of "
                f"input_sampling_rate ({input_rate})"
            )
        self.config: dict[str, Any] = cfg

        self.vocoder = LTX2Vocoder(
            **{key: cfg[key] for key in _GENERATOR_KEYS}, output_sampling_rate=input_rate
        )
        self.bwe_generator = LTX2Vocoder(
            **{key: cfg["bwe_" + key] for key in _GENERATOR_KEYS}, output_sampling_rate=output_rate
        )
        self.mel_stft = MelSTFT(
            cfg["filter_length"], cfg["hop_length"], cfg["window_length"], cfg["num_mel_channels"]
        )
        self.resampler = HannUpsample1d(output_rate // input_rate)

    @property
    def sample_rate(self) -> int:
        """Sample rate of the waveform `forward` returns (Diffusers' `config.output_sampling_rate`)."""
        return int(self.config["output_sampling_rate"])

    def num_samples(self, num_frames: int) -> int:
        """Length of the waveform `forward` makes from `num_frames` mel frames."""
        ratio = self.config["output_sampling_rate"] // self.config["input_sampling_rate"]
        return self.vocoder.num_samples(num_frames) * ratio

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Mel (B, C, frames, mel_bins) -> waveform (B, bwe_out_channels, num_samples(frames))."""
        low = self.vocoder(mel)
        batch, channels, num_samples = low.shape
        hop = self.config["hop_length"]
        if num_samples % hop:  # whole mel frames only
            low = F.pad(low, (0, hop - num_samples % hop))
        low_mel = self.mel_stft(low.flatten(0, 1)).unflatten(0, (batch, channels))
        residual = self.bwe_generator(low_mel, time_last=True)
        waveform = (residual + self.resampler(low)).clamp(-1, 1)
        ratio = self.config["output_sampling_rate"] // self.config["input_sampling_rate"]
        return waveform[..., : num_samples * ratio]
