"""Diffusers' `AutoencoderKLQwenImage21`: Qwen-Image 2.1's image VAE (16x spatial compression, 64 latent
channels, RGBA pixels by default).

It is Wan 2.2's residual network (parameter-free space-time/channel shortcuts around each level) made for
single images: every "causal 3-D" convolution is a 2-D one over the only frame (Diffusers stores 4-D
weights), and the temporal convolutions of the time-resampling layers exist in the checkpoint but never
run on a one-frame input (the first chunk of a causal clip skips them). Tensors keep Diffusers' 5-D
layout (batch, channels, 1, height, width) at the interface and inside (the norms' gains are shaped for it).
State-dict keys match Diffusers', so checkpoints load with `strict=True` into a model built on meta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.attention import attention
from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.causal3d_blocks import (
    ChannelRMSNorm,
    ChannelsToSpaceTime,
    RMSResidualLayers,
    SpaceTimeToChannels,
)
from diffserve.models.vaes.coder_layout import CoderLayout

#: The released per-channel latent statistics (Diffusers' defaults of `AutoencoderKLQwenImage21`).
LATENTS_MEAN: tuple[float, ...] = (
    0.5126,
    0.7721,
    -0.0631,
    1.3506,
    -0.7855,
    -2.1025,
    -0.3458,
    1.3722,
    1.8873,
    -1.7177,
    -0.651,
    0.2732,
    0.7562,
    -0.6163,
    -1.0277,
    3.8363,
    2.021,
    0.0472,
    0.932,
    2.0087,
    2.4954,
    -0.1391,
    -1.4249,
    1.8464,
    -0.5236,
    1.2826,
    3.7046,
    -1.3035,
    2.7286,
    -1.4518,
    -1.9036,
    -1.9955,
    -0.0342,
    -1.0265,
    -0.7636,
    3.0555,
    0.0746,
    -3.0751,
    -0.1076,
    1.7376,
    -1.0914,
    -1.9435,
    -0.2784,
    -1.368,
    0.4809,
    -0.4433,
    0.3764,
    0.5729,
    -2.0595,
    1.096,
    -1.326,
    -2.0211,
    -5.0179,
    0.5275,
    4.0162,
    1.8505,
    0.3026,
    1.9373,
    1.4937,
    0.2632,
    0.5547,
    -1.7121,
    -0.1562,
    0.0304,
)
LATENTS_STD: tuple[float, ...] = (
    3.2001,
    3.2936,
    3.4321,
    3.0091,
    3.1061,
    4.0379,
    4.0705,
    3.791,
    3.0785,
    3.65,
    3.9308,
    3.0904,
    2.8778,
    3.7675,
    3.732,
    5.0756,
    3.2864,
    4.0397,
    3.1317,
    4.0443,
    2.9249,
    3.9454,
    3.0988,
    4.2489,
    3.4896,
    3.8513,
    3.9323,
    3.4719,
    3.7498,
    4.283,
    3.5694,
    4.2467,
    3.9037,
    3.2947,
    5.077,
    3.5075,
    3.27,
    3.4767,
    2.8063,
    5.1125,
    3.5327,
    4.7833,
    3.1286,
    4.1819,
    3.8527,
    3.8312,
    3.5605,
    4.3875,
    3.9624,
    4.0168,
    3.5643,
    4.055,
    5.5614,
    4.2963,
    4.408,
    3.4959,
    3.8747,
    3.7608,
    3.5735,
    3.149,
    3.7662,
    3.6746,
    3.4563,
    3.8161,
)

#: Diffusers' config keys and defaults (`latents_mean` / `latents_std` are Diffusers' 64 released values).
QWEN_IMAGE21_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "base_dim": 96,
    "decoder_base_dim": 144,
    "z_dim": 64,
    "dim_mult": (1, 2, 4, 8, 8),
    "num_res_blocks": 2,
    "attn_scales": (),
    "temperal_downsample": (False, True, True, True),
    "dropout": 0.0,
    "latents_mean": LATENTS_MEAN,
    "latents_std": LATENTS_STD,
    "is_residual": True,
    "in_channels": 4,
    "out_channels": 4,
    "patch_size": None,
    "scale_factor_temporal": 8,
    "scale_factor_spatial": 16,
}


class FrameConv(nn.Conv2d):
    """A 2-D convolution of the single frame of a (B, C, 1, H, W) tensor (Diffusers' `QwenImage21CausalConv3d`,
    zero-padded on both sides of each spatial axis)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.squeeze(2)).unsqueeze(2)


def frames_2d(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module` (a 2-D layer) on the only frame of a (B, C, 1, H, W) tensor."""
    return module(x.squeeze(2)).unsqueeze(2)


class ResidualBlock(RMSResidualLayers):
    """(RMSNorm, SiLU, 3x3 conv) twice, plus a 1x1 shortcut when the width changes."""

    conv_cls = FrameConv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        h = self.conv1(F.silu(self.norm1(x)))
        return self.conv2(F.silu(self.norm2(h))) + shortcut


class AttentionBlock(nn.Module):
    """Single-head self-attention over the frame's pixels, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = ChannelRMSNorm(dim, spatial_dims=2)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frame = x.squeeze(2)
        n, c, h, w = frame.shape
        qkv = self.to_qkv(self.norm(frame)).flatten(2).transpose(1, 2).contiguous()  # (n, h*w, 3c)
        q, k, v = (part.unsqueeze(2) for part in qkv.chunk(3, dim=-1))
        out = attention(q, k, v).flatten(2)
        return self.proj(out.transpose(1, 2).reshape(n, c, h, w)).unsqueeze(2) + x


class MidBlock(nn.Module):
    """resnet -> attention -> resnet at the lowest resolution."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class NearestUpsample2x(nn.Module):
    """2x nearest-exact upsampling in float32, rounded back (as Diffusers does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)


class Resample(nn.Module):
    """2x spatial up- or downsampling (`resample`); `time_conv` (1x1) is the temporal half's weight, which a
    single frame never uses (it is loaded so the checkpoint's keys match)."""

    def __init__(self, dim: int, up: bool, temporal: bool, out_dim: int) -> None:
        super().__init__()
        if up:
            self.resample = nn.Sequential(NearestUpsample2x(), nn.Conv2d(dim, out_dim, 3, padding=1))
        else:
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        if temporal:
            self.time_conv = FrameConv(dim, dim * 2 if up else dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frames_2d(self.resample, x)


class ResidualDownBlock(nn.Module):
    """One encoder level: residual blocks and an optional 2x downsampling, plus the parameter-free
    space-time-to-channels shortcut of the level's input."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, down: bool) -> None:
        super().__init__()
        self.avg_shortcut = SpaceTimeToChannels(in_dim, out_dim, 2 if temporal else 1, 2 if down else 1)
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList([ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)])
        self.downsampler = Resample(out_dim, up=False, temporal=temporal, out_dim=out_dim) if down else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = self.avg_shortcut(x)
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsampler is not None:
            x = self.downsampler(x)
        return x + shortcut


class ResidualUpBlock(nn.Module):
    """One decoder level: residual blocks and an optional 2x upsampling, plus the parameter-free
    channels-to-space-time shortcut of the level's input (the first frame's cell only)."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, up: bool) -> None:
        super().__init__()
        self.avg_shortcut = ChannelsToSpaceTime(in_dim, out_dim, 2 if temporal else 1, 2) if up else None
        dims = [in_dim] + [out_dim] * (num_res_blocks + 1)
        self.resnets = nn.ModuleList([ResidualBlock(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)])
        self.upsampler = Resample(out_dim, up=True, temporal=temporal, out_dim=out_dim) if up else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        original = x
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsampler is not None:
            x = self.upsampler(x)
        if self.avg_shortcut is not None:
            x = x + self.avg_shortcut(original, first_chunk=True)
        return x


@dataclass(frozen=True)
class QwenImage21CoderLayout(CoderLayout):
    """A Qwen-Image 2.1 VAE half's layout: `block_out_channels` is `conv_in`'s width followed by each
    level's (the decoder's from the lowest resolution up), the encoder's `out_channels` its moments (twice
    the latent width), and `temporal` whether each resampling level's checkpoint holds a time convolution
    (the decoder's reversed)."""

    temporal: Sequence[bool]


def _levels(layout: QwenImage21CoderLayout) -> list[tuple[int, int, bool, bool]]:
    """(in width, out width, temporal, resamples) of each level: every level but the last resamples."""
    dims, temporal = layout.block_out_channels, layout.temporal
    last = len(dims) - 2
    return [
        (a, b, bool(temporal[i]) if i != last else False, i != last)
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True))
    ]


class Encoder(nn.Module):
    def __init__(self, layout: QwenImage21CoderLayout) -> None:
        super().__init__()
        dims, blocks = layout.block_out_channels, layout.layers_per_block
        self.conv_in = FrameConv(layout.in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            ResidualDownBlock(a, b, blocks, temporal, down) for a, b, temporal, down in _levels(layout)
        )
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = ChannelRMSNorm(dims[-1], spatial_dims=3)
        self.conv_out = FrameConv(dims[-1], layout.out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(self.mid_block(x))))


class Decoder(nn.Module):
    def __init__(self, layout: QwenImage21CoderLayout) -> None:
        super().__init__()
        dims, blocks = layout.block_out_channels, layout.layers_per_block
        self.conv_in = FrameConv(layout.in_channels, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList(
            ResidualUpBlock(a, b, blocks, temporal, up) for a, b, temporal, up in _levels(layout)
        )
        self.norm_out = ChannelRMSNorm(dims[-1], spatial_dims=3)
        self.conv_out = FrameConv(dims[-1], layout.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class AutoencoderKLQwenImage21(DiffusersConfigured, nn.Module):
    """Qwen-Image 2.1's VAE with Diffusers' config keys and state-dict names (see the module docstring).

    Images only: `encode` / `decode` take and give one frame, (B, C, 1, H, W). It has no tiled decode
    (`--vae-tiling` leaves it untiled: it lacks the `SupportsTiling` switches)."""

    diffusers_class_name: ClassVar[str] = "AutoencoderKLQwenImage21"
    config_defaults = QWEN_IMAGE21_VAE_CONFIG_DEFAULTS

    def __init__(
        self,
        base_dim: int = 96,
        decoder_base_dim: int | None = 144,
        z_dim: int = 64,
        dim_mult: Sequence[int] = (1, 2, 4, 8, 8),
        num_res_blocks: int = 2,
        attn_scales: Sequence[float] = (),
        temperal_downsample: Sequence[bool] = (False, True, True, True),
        dropout: float = 0.0,
        latents_mean: Sequence[float] = LATENTS_MEAN,
        latents_std: Sequence[float] = LATENTS_STD,
        is_residual: bool = True,
        in_channels: int = 4,
        out_channels: int = 4,
        patch_size: int | None = None,
        scale_factor_temporal: int | None = 8,
        scale_factor_spatial: int | None = 16,
    ) -> None:
        super().__init__()
        name = self.diffusers_class_name
        if not is_residual:
            raise ValueError(f"{name}: only the residual network (is_residual=True) is supported")
        if patch_size not in (None, 1):
            raise ValueError(f"{name}: patch_size must be None, got {patch_size}")
        if len(temperal_downsample) != len(dim_mult) - 1:
            raise ValueError(
                f"{name}: temperal_downsample needs {len(dim_mult) - 1} entries, got {temperal_downsample}"
            )
        if len(latents_mean) != z_dim or len(latents_std) != z_dim:
            raise ValueError(f"{name}: latents_mean and latents_std need {z_dim} entries (z_dim)")
        encoder_dims = [base_dim * m for m in (1, *dim_mult)]
        self.encoder = Encoder(
            QwenImage21CoderLayout(
                in_channels, 2 * z_dim, encoder_dims, num_res_blocks, tuple(temperal_downsample)
            )
        )
        self.quant_conv = FrameConv(2 * z_dim, 2 * z_dim, 1)
        self.post_quant_conv = FrameConv(z_dim, z_dim, 1)
        decoder_dim = base_dim if decoder_base_dim is None else decoder_base_dim
        decoder_dims = [decoder_dim * m for m in (dim_mult[-1], *reversed(dim_mult))]
        self.decoder = Decoder(
            QwenImage21CoderLayout(
                z_dim, out_channels, decoder_dims, num_res_blocks, tuple(reversed(temperal_downsample))
            )
        )
        self._downsamplings = len(temperal_downsample)
        self.config = {
            "base_dim": base_dim,
            "decoder_base_dim": decoder_base_dim,
            "z_dim": z_dim,
            "dim_mult": tuple(dim_mult),
            "num_res_blocks": num_res_blocks,
            "attn_scales": tuple(attn_scales),
            "temperal_downsample": tuple(bool(t) for t in temperal_downsample),
            "dropout": dropout,
            "latents_mean": tuple(float(v) for v in latents_mean),
            "latents_std": tuple(float(v) for v in latents_std),
            "is_residual": is_residual,
            "in_channels": in_channels,
            "out_channels": out_channels,
            "patch_size": patch_size,
            "scale_factor_temporal": scale_factor_temporal,
            "scale_factor_spatial": scale_factor_spatial,
        }

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side (16 for the released VAE)."""
        return 2**self._downsamplings

    @staticmethod
    def _one_frame(x: torch.Tensor, what: str) -> None:
        if x.ndim != 5 or x.shape[2] != 1:
            raise ValueError(f"{what} must be one frame (B, C, 1, H, W), got shape {tuple(x.shape)}")

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """(B, in_channels, 1, H, W) pixels in [-1, 1] -> the posterior over (B, z_dim, 1, H/16, W/16) latents."""
        self._one_frame(x, "encode's input")
        return DiagonalGaussian.from_moments(self.quant_conv(self.encoder(x)))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """(B, z_dim, 1, h, w) latents -> (B, out_channels, 1, 16h, 16w) pixels clamped to [-1, 1]."""
        self._one_frame(z, "decode's input")
        return self.decoder(self.post_quant_conv(z)).clamp(-1.0, 1.0)
