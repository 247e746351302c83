"""Diffusers' `AutoencoderKLLTX2Audio`: LTX-2's audio VAE over (stereo) log-mel spectrograms.

A 2-D convolutional VAE whose first spatial axis is time and second the mel bins. Convolutions are
causal along `causality_axis` (LTX-2 checkpoints: "height", i.e. time), normalisation is a per-pixel
RMS norm ("pixel") or GroupNorm(32) ("group", only with `causality_axis="none"`), and the latents are
4x smaller than the mel spectrogram along both axes (LTX-2 hard-codes that factor: the decoder's output
is cropped / zero-padded to `4 * frames - 3` mel frames and `mel_bins` bins whatever `ch_mult` says).

    encode(mel (B, in_channels, T, mel_bins)) -> DiagonalGaussian over (B, latent_channels, t, m)
    decode(latents (B, latent_channels, t, m)) -> mel (B, output_channels, 4 t - 3, mel_bins)

`latents_mean` / `latents_std` (per packed feature: latent_channels * latent mel bins, stored with
`base_channels` entries) are checkpoint buffers; the pipeline normalises its packed latents with them
(`normalize_latents` / `denormalize_latents`). State-dict keys match Diffusers', so checkpoints load with
`strict=True` into a model built on the meta device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian

#: LTX-2's audio latents are this many times shorter (time) and narrower (mel bins) than the mel input.
LATENT_DOWNSAMPLE_FACTOR = 4

CAUSALITY_AXES: tuple[str, ...] = ("none", "width", "height", "width-compatibility")
NORM_TYPES: tuple[str, ...] = ("group", "pixel")

#: Diffusers' `AutoencoderKLLTX2Audio` config keys and defaults.
LTX2_AUDIO_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "base_channels": 128,
    "output_channels": 2,
    "ch_mult": (1, 2, 4),
    "num_res_blocks": 2,
    "attn_resolutions": None,
    "in_channels": 2,
    "resolution": 256,
    "latent_channels": 8,
    "norm_type": "pixel",
    "causality_axis": "height",
    "dropout": 0.0,
    "mid_block_add_attention": False,
    "sample_rate": 16000,
    "mel_hop_length": 160,
    "is_causal": True,
    "mel_bins": 64,
    "double_z": True,
}


def _causal_padding(kernel: tuple[int, int], dilation: tuple[int, int], axis: str) -> tuple[int, ...]:
    """F.pad amounts (left, right, top, bottom) that keep the size and put all of the causal axis's
    padding before the signal."""
    pad_h = (kernel[0] - 1) * dilation[0]
    pad_w = (kernel[1] - 1) * dilation[1]
    half_h, half_w = (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2)
    if axis == "none":
        return (*half_w, *half_h)
    if axis in ("width", "width-compatibility"):
        return (pad_w, 0, *half_h)
    if axis == "height":
        return (*half_w, pad_h, 0)
    raise ValueError(f"causality_axis must be one of {CAUSALITY_AXES}, got {axis!r}")


class CausalConv2d(nn.Module):
    """Stride-1 Conv2d with zero padding that is one-sided (past only) along the causal axis."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, causality_axis: str) -> None:
        super().__init__()
        self.padding = _causal_padding((kernel_size, kernel_size), (1, 1), causality_axis)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding))


class PixelNorm(nn.Module):
    """RMS normalisation over the channels at every (time, mel) position; no parameters."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(dim=1, keepdim=True) + self.eps)


def _norm(norm_type: str, channels: int) -> nn.Module:
    if norm_type == "group":
        return nn.GroupNorm(32, channels, eps=1e-6)
    if norm_type == "pixel":
        return PixelNorm(eps=1e-6)
    raise ValueError(f"norm_type must be one of {NORM_TYPES}, got {norm_type!r}")


class AttnBlock(nn.Module):
    """Single-head self-attention over all (time, mel) positions, with 1x1-conv projections and a residual."""

    def __init__(self, channels: int, norm_type: str) -> None:
        super().__init__()
        self.norm = _norm(norm_type, channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        h = self.norm(x)
        q, k, v = (proj(h).flatten(2).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(channels), one head
        out = out.transpose(1, 2).reshape(batch, channels, height, width)
        return x + self.proj_out(out)


class ResnetBlock(nn.Module):
    """norm -> SiLU -> causal conv3x3, twice, plus a (1x1 causal conv when the width changes) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, norm_type: str, causality_axis: str) -> None:
        super().__init__()
        if causality_axis != "none" and norm_type == "group":
            raise ValueError(
                f"norm_type 'group' needs causality_axis 'none' (got {causality_axis!r}); use norm_type 'pixel'"
            )
        self.norm1 = _norm(norm_type, in_channels)
        self.conv1 = CausalConv2d(in_channels, out_channels, 3, causality_axis)
        self.norm2 = _norm(norm_type, out_channels)
        self.conv2 = CausalConv2d(out_channels, out_channels, 3, causality_axis)
        self.nin_shortcut = (
            CausalConv2d(in_channels, out_channels, 1, causality_axis)
            if in_channels != out_channels
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        shortcut = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return shortcut + h


#: F.pad amounts (left, right, top, bottom) before the stride-2 conv of a downsampler, per causal axis.
_DOWNSAMPLE_PADDING: dict[str, tuple[int, int, int, int]] = {
    "none": (0, 1, 0, 1),
    "width": (2, 0, 0, 1),
    "height": (0, 1, 2, 0),
    "width-compatibility": (1, 0, 0, 1),
}


class Downsample(nn.Module):
    """Halves both axes with a 3x3 stride-2 conv after causal zero padding."""

    def __init__(self, channels: int, causality_axis: str) -> None:
        super().__init__()
        self.padding = _DOWNSAMPLE_PADDING[causality_axis]
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding))


class Upsample(nn.Module):
    """Doubles both axes (nearest) then a causal conv3x3; along a causal "height"/"width" axis the first
    row/column is dropped, so T steps become 2 T - 1 (the causal frame count)."""

    def __init__(self, channels: int, causality_axis: str) -> None:
        super().__init__()
        self.causality_axis = causality_axis
        self.conv = CausalConv2d(channels, channels, 3, causality_axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        if self.causality_axis == "height":
            return x[:, :, 1:, :]
        if self.causality_axis == "width":
            return x[:, :, :, 1:]
        return x


class _Level(nn.Module):
    """One resolution of the encoder or decoder: its resnets, their attention blocks (possibly none) and
    an optional resampler (`downsample` in the encoder, `upsample` in the decoder), under Diffusers' names."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.ModuleList()
        self.attn = nn.ModuleList()
        self.downsample: nn.Module | None = None
        self.upsample: nn.Module | None = None

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.block):
            x = block(x)
            if len(self.attn) > 0:
                x = self.attn[index](x)
        return x


class _Mid(nn.Module):
    """resnet -> (attention or identity) -> resnet at the lowest resolution."""

    def __init__(self, channels: int, norm_type: str, causality_axis: str, add_attention: bool) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, norm_type, causality_axis)
        self.attn_1: nn.Module = AttnBlock(channels, norm_type) if add_attention else nn.Identity()
        self.block_2 = ResnetBlock(channels, channels, norm_type, causality_axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class AudioEncoder(nn.Module):
    """Mel spectrogram (B, in_channels, T, mel_bins) -> posterior moments (B, 2 * latent_channels, ...)."""

    def __init__(
        self,
        *,
        base_channels: int,
        ch_mult: Sequence[int],
        num_res_blocks: int,
        attn_resolutions: frozenset[int],
        in_channels: int,
        resolution: int,
        latent_channels: int,
        norm_type: str,
        causality_axis: str,
        mid_block_add_attention: bool,
        double_z: bool,
    ) -> None:
        super().__init__()
        self.conv_in = CausalConv2d(in_channels, base_channels, 3, causality_axis)
        self.down = nn.ModuleList()
        width, res = base_channels, resolution
        for level, mult in enumerate(ch_mult):
            stage = _Level()
            for _ in range(num_res_blocks):
                stage.block.append(ResnetBlock(width, base_channels * mult, norm_type, causality_axis))
                width = base_channels * mult
                if res in attn_resolutions:
                    stage.attn.append(AttnBlock(width, norm_type))
            if level != len(ch_mult) - 1:
                stage.downsample = Downsample(width, causality_axis)
                res //= 2
            self.down.append(stage)
        self.mid = _Mid(width, norm_type, causality_axis, mid_block_add_attention)
        self.norm_out = _norm(norm_type, width)
        out = 2 * latent_channels if double_z else latent_channels
        self.conv_out = CausalConv2d(width, out, 3, causality_axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for stage in self.down:
            x = stage.run_blocks(x)
            if stage.downsample is not None:
                x = stage.downsample(x)
        x = self.mid(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class AudioDecoder(nn.Module):
    """Latents (B, latent_channels, t, m) -> mel spectrogram (B, output_channels, 4 t - 3, mel_bins)."""

    def __init__(
        self,
        *,
        base_channels: int,
        output_channels: int,
        ch_mult: Sequence[int],
        num_res_blocks: int,
        attn_resolutions: frozenset[int],
        resolution: int,
        latent_channels: int,
        norm_type: str,
        causality_axis: str,
        mid_block_add_attention: bool,
        mel_bins: int | None,
    ) -> None:
        super().__init__()
        self.output_channels = output_channels
        self.mel_bins = mel_bins
        width = base_channels * ch_mult[-1]
        res = resolution // 2 ** (len(ch_mult) - 1)
        self.conv_in = CausalConv2d(latent_channels, width, 3, causality_axis)
        self.mid = _Mid(width, norm_type, causality_axis, mid_block_add_attention)
        levels: list[_Level] = []
        for level in reversed(range(len(ch_mult))):
            stage = _Level()
            for _ in range(num_res_blocks + 1):
                stage.block.append(
                    ResnetBlock(width, base_channels * ch_mult[level], norm_type, causality_axis)
                )
                width = base_channels * ch_mult[level]
                if res in attn_resolutions:
                    stage.attn.append(AttnBlock(width, norm_type))
            if level != 0:
                stage.upsample = Upsample(width, causality_axis)
                res *= 2
            levels.append(stage)
        self.up = nn.ModuleList(reversed(levels))  # indexed by level, run from the deepest one
        self.norm_out = _norm(norm_type, width)
        self.conv_out = CausalConv2d(width, output_channels, 3, causality_axis)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        _, _, frames, latent_bins = z.shape
        # The axis-agnostic causal frame count: every causal decoder drops LATENT_DOWNSAMPLE_FACTOR - 1 frames.
        target_frames = max(frames * LATENT_DOWNSAMPLE_FACTOR - (LATENT_DOWNSAMPLE_FACTOR - 1), 1)
        target_bins = self.mel_bins if self.mel_bins is not None else latent_bins
        x = self.mid(self.conv_in(z))
        for stage in reversed(self.up):
            x = stage.run_blocks(x)
            if stage.upsample is not None:
                x = stage.upsample(x)
        mel = self.conv_out(F.silu(self.norm_out(x)))
        mel = mel[:, : self.output_channels, :target_frames, :target_bins]
        missing_frames, missing_bins = target_frames - mel.shape[2], target_bins - mel.shape[3]
        if missing_frames > 0 or missing_bins > 0:
            mel = F.pad(mel, (0, max(missing_bins, 0), 0, max(missing_frames, 0)))
        return mel


class AutoencoderKLLTX2Audio(DiffusersConfigured, nn.Module):
    """LTX-2's audio VAE with Diffusers' `AutoencoderKLLTX2Audio` config keys and weight names.

    `dropout` is accepted for config compatibility and has no effect at inference; `is_causal` and
    `resolution` (only through `attn_resolutions`) are kept in `config` as Diffusers keeps them.
    """

    diffusers_class_name: ClassVar[str] = "AutoencoderKLLTX2Audio"
    config_defaults = LTX2_AUDIO_VAE_CONFIG_DEFAULTS
    #: Mel frames / mel bins per latent step (Diffusers' `temporal_compression_ratio`,
    #: `mel_compression_ratio`; fixed by LTX-2, not derived from `ch_mult`).
    temporal_compression_ratio: ClassVar[int] = LATENT_DOWNSAMPLE_FACTOR
    mel_compression_ratio: ClassVar[int] = LATENT_DOWNSAMPLE_FACTOR

    latents_mean: torch.Tensor
    latents_std: torch.Tensor

    def __init__(
        self,
        base_channels: int = 128,
        output_channels: int = 2,
        ch_mult: Sequence[int] = (1, 2, 4),
        num_res_blocks: int = 2,
        attn_resolutions: Sequence[int] | None = None,
        in_channels: int = 2,
        resolution: int = 256,
        latent_channels: int = 8,
        norm_type: str = "pixel",
        causality_axis: str = "height",
        dropout: float = 0.0,
        mid_block_add_attention: bool = False,
        sample_rate: int = 16000,
        mel_hop_length: int = 160,
        is_causal: bool = True,
        mel_bins: int | None = 64,
        double_z: bool = True,
    ) -> None:
        super().__init__()
        if causality_axis not in CAUSALITY_AXES:
            raise ValueError(
                f"AutoencoderKLLTX2Audio: causality_axis must be one of {CAUSALITY_AXES}, got {causality_axis!r}"
            )
        if norm_type not in NORM_TYPES:
            raise ValueError(
                f"AutoencoderKLLTX2Audio: norm_type must be one of {NORM_TYPES}, got {norm_type!r}"
            )
        if len(ch_mult) < 1:
            raise ValueError("AutoencoderKLLTX2Audio: ch_mult must name at least one level")
        self.config: dict[str, Any] = {
            "base_channels": base_channels,
            "output_channels": output_channels,
            "ch_mult": tuple(ch_mult),
            "num_res_blocks": num_res_blocks,
            "attn_resolutions": None if attn_resolutions is None else tuple(attn_resolutions),
            "in_channels": in_channels,
            "resolution": resolution,
            "latent_channels": latent_channels,
            "norm_type": norm_type,
            "causality_axis": causality_axis,
            "dropout": dropout,
            "mid_block_add_attention": mid_block_add_attention,
            "sample_rate": sample_rate,
            "mel_hop_length": mel_hop_length,
            "is_causal": is_causal,
            "mel_bins": mel_bins,
            "double_z": double_z,
        }
        shared: dict[str, Any] = {
            "base_channels": base_channels,
            "ch_mult": tuple(ch_mult),
            "num_res_blocks": num_res_blocks,
            "attn_resolutions": frozenset(attn_resolutions or ()),
            "resolution": resolution,
            "latent_channels": latent_channels,
            "norm_type": norm_type,
            "causality_axis": causality_axis,
            "mid_block_add_attention": mid_block_add_attention,
        }
        self.encoder = AudioEncoder(in_channels=in_channels, double_z=double_z, **shared)
        self.decoder = AudioDecoder(output_channels=output_channels, mel_bins=mel_bins, **shared)
        # Dataset statistics of the packed latents; the checkpoint's values replace these.
        self.register_buffer("latents_mean", torch.zeros(base_channels))
        self.register_buffer("latents_std", torch.ones(base_channels))

    @property
    def latents_per_second(self) -> float:
        """Audio latent steps per second of audio: sample_rate / mel_hop_length / temporal compression
        (25 for LTX-2's 16 kHz, hop-160 mels)."""
        return self.config["sample_rate"] / self.config["mel_hop_length"] / self.temporal_compression_ratio

    @property
    def latent_mel_bins(self) -> int:
        """Mel bins per latent step (the pipeline's `mel_bins // mel_compression_ratio`)."""
        if self.config["mel_bins"] is None:
            raise ValueError("AutoencoderKLLTX2Audio: latent_mel_bins needs mel_bins in the config, got None")
        return self.config["mel_bins"] // self.mel_compression_ratio

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents (..., latent_channels * latent_mel_bins) -> (latents - mean) / std, in their dtype."""
        mean = self.latents_mean.to(latents.device, latents.dtype)
        std = self.latents_std.to(latents.device, latents.dtype)
        return (latents - mean) / std

    def denormalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Inverse of `normalize_latents`: latents * std + mean."""
        mean = self.latents_mean.to(latents.device, latents.dtype)
        std = self.latents_std.to(latents.device, latents.dtype)
        return latents * std + mean

    def encode(self, mel: torch.Tensor) -> DiagonalGaussian:
        """Mel spectrogram (B, in_channels, T, mel_bins) -> posterior over (unnormalised) latents."""
        return DiagonalGaussian.from_moments(self.encoder(mel))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Unnormalised latents (B, latent_channels, t, m) -> mel spectrogram (B, output_channels, 4 t - 3, mel_bins)."""
        return self.decoder(latents)
