"""Building blocks of LTX-2's video VAE (Diffusers' `AutoencoderKLLTX2Video`): its encoder and decoder.

    encoder: video (B, 3, T, H, W)
        -> fold p x p pixel cells into channels (3 p^2)             -> conv_in
        -> down blocks: resnets, then a space-to-depth downsampler (spatial, temporal or both, x2)
        -> mid block -> RMS norm, SiLU, conv_out -> moments (B, 2 latent, t, h, w)
    decoder: latents (B, latent, t, h, w)
        -> conv_in -> mid block -> up blocks: depth-to-space upsampler (x2), then resnets
        -> RMS norm [+ timestep shift/scale], SiLU, conv_out -> unfold p x p cells -> video

Every 3-D conv pads time by repeating edge frames, either all in front (causal) or split between
both ends (non-causal); which one is chosen per call, not per layer. Spatial padding is the conv's
own (`zeros` or `reflect`, per config). Space-to-depth downsamplers add a channel-mean shortcut;
depth-to-space upsamplers optionally add a channel-repeat shortcut. A causal 2x temporal resampler
pads/drops one frame so that T = 1 + 8k frames map to 1 + k latent frames and back.

The optional decoder timestep conditioning (LTX-Video 0.9.1-style) embeds the decode timestep with
a sinusoid + MLP per block and turns it into per-channel shift/scale around each resnet norm.
The optional noise injection adds seeded spatial noise after each resnet conv; it draws from the
global torch RNG, exactly as Diffusers does (Diffusers' decode path passes no generator).

Module and parameter names follow Diffusers so checkpoints load with `strict=True`; inference only
(no dropout, no gradient checkpointing); nothing is computed from parameter values at construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.embeddings import TimestepEmbedding, timestep_sinusoids
from diffserve.models.vaes.tiling import decode_chunk_boundary

#: `padding_mode` values `nn.Conv3d` accepts.
SPATIAL_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
#: Per-block downsampler kinds of the encoder and their (t, h, w) strides; "conv" is a strided conv.
DOWNSAMPLE_STRIDES = {
    "conv": (2, 2, 2),
    "spatial": (1, 2, 2),
    "temporal": (2, 1, 1),
    "spatiotemporal": (2, 2, 2),
}
#: Per-block upsampler kinds of the decoder and their (t, h, w) strides.
UPSAMPLE_STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}
#: Width of the sinusoidal timestep features fed to each timestep MLP.
TIMESTEP_FEATURES = 256


def channel_rms_norm(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """x / sqrt(mean over channels of x^2 + eps), per location; no learned gain (Diffusers' `PerChannelRMSNorm`)."""
    return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + eps)


class TimestepEmbedder(nn.Module):
    """Sinusoids(t) -> two-layer SiLU MLP, under Diffusers' `PixArtAlphaCombinedTimestepSizeEmbeddings`
    names (size embedding disabled: only `timestep_embedder` exists)."""

    def __init__(self, embedding_dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIMESTEP_FEATURES, embedding_dim)

    def forward(self, timestep: torch.Tensor, batch_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Scaled timesteps (any shape holding one value per sample) -> (batch, dim, 1, 1, 1) in `dtype`."""
        features = timestep_sinusoids(timestep.flatten(), TIMESTEP_FEATURES).to(dtype)
        return self.timestep_embedder(features).view(batch_size, -1, 1, 1, 1)


class LTX2CausalConv3d(nn.Module):
    """3-D conv padding time with copies of the edge frames: all in front when causal, split otherwise.

    Spatial padding (kernel // 2 per side) is done by the conv itself with the configured mode.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int | tuple[int, int, int] = 1,
        spatial_padding_mode: str = "zeros",
    ) -> None:
        super().__init__()
        self.time_kernel = kernel_size
        stride = stride if isinstance(stride, tuple) else (stride,) * 3
        self.conv = nn.Conv3d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=(0, kernel_size // 2, kernel_size // 2),
            padding_mode=spatial_padding_mode,
        )

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        pad = self.time_kernel - 1
        if causal:
            x = torch.cat([x[:, :, :1].repeat(1, 1, pad, 1, 1), x], dim=2)
        else:
            half = pad // 2
            x = torch.cat(
                [x[:, :, :1].repeat(1, 1, half, 1, 1), x, x[:, :, -1:].repeat(1, 1, half, 1, 1)], dim=2
            )
        return self.conv(x)


class ResnetBlock3d(nn.Module):
    """RMS norm [+ timestep shift/scale] -> SiLU -> conv [+ noise], twice, plus a shortcut
    (LayerNorm + 1x1x1 conv when the width changes)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        eps: float,
        inject_noise: bool = False,
        timestep_conditioning: bool = False,
        spatial_padding_mode: str = "zeros",
    ) -> None:
        super().__init__()
        self.conv1 = LTX2CausalConv3d(in_channels, out_channels, spatial_padding_mode=spatial_padding_mode)
        self.conv2 = LTX2CausalConv3d(out_channels, out_channels, spatial_padding_mode=spatial_padding_mode)
        self.norm3: nn.LayerNorm | None = None
        self.conv_shortcut: nn.Conv3d | None = None
        if in_channels != out_channels:
            self.norm3 = nn.LayerNorm(in_channels, eps=eps, elementwise_affine=True, bias=True)
            self.conv_shortcut = nn.Conv3d(in_channels, out_channels, kernel_size=1)
        self.per_channel_scale1: nn.Parameter | None = None
        self.per_channel_scale2: nn.Parameter | None = None
        if inject_noise:
            # Diffusers sizes both by the input width (so noise only works where in == out, as in its configs).
            self.per_channel_scale1 = nn.Parameter(torch.zeros(in_channels, 1, 1))
            self.per_channel_scale2 = nn.Parameter(torch.zeros(in_channels, 1, 1))
        self.scale_shift_table: nn.Parameter | None = None
        if timestep_conditioning:
            self.scale_shift_table = nn.Parameter(torch.randn(4, in_channels) / in_channels**0.5)

    @staticmethod
    def _add_noise(x: torch.Tensor, scale: nn.Parameter | None) -> torch.Tensor:
        """x + scale[c] * n[h, w], one standard-normal map shared by every batch item, channel and frame."""
        if scale is None:
            return x
        noise = torch.randn(x.shape[-2:], device=x.device, dtype=x.dtype)[None]
        return x + (noise * scale)[None, :, None]

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None, causal: bool) -> torch.Tensor:
        h = channel_rms_norm(x)
        if self.scale_shift_table is not None:
            if temb is None or temb.ndim != 5:
                raise ValueError(
                    "a timestep-conditioned resnet needs the embedded timestep (batch, 4 C, 1, 1, 1)"
                )
            mods = temb.unflatten(1, (4, -1)) + self.scale_shift_table[None, :, :, None, None, None]
            shift1, scale1, shift2, scale2 = mods.unbind(dim=1)
            h = h * (1 + scale1) + shift1
        h = self.conv1(F.silu(h), causal)
        h = channel_rms_norm(self._add_noise(h, self.per_channel_scale1))
        if self.scale_shift_table is not None:
            h = h * (1 + scale2) + shift2
        h = self._add_noise(self.conv2(F.silu(h), causal), self.per_channel_scale2)
        if self.norm3 is not None:
            x = self.norm3(x.movedim(1, -1)).movedim(-1, 1)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return h + x


def _space_to_depth(x: torch.Tensor, stride: tuple[int, int, int]) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, C st sh sw, T/st, H/sh, W/sw), channel order (C, st, sh, sw)."""
    st, sh, sw = stride
    x = x.unflatten(4, (-1, sw)).unflatten(3, (-1, sh)).unflatten(2, (-1, st))
    return x.permute(0, 1, 3, 5, 7, 2, 4, 6).flatten(1, 4)


def _depth_to_space(x: torch.Tensor, stride: tuple[int, int, int]) -> torch.Tensor:
    """(B, C st sh sw, T, H, W) -> (B, C, T st, H sh, W sw), channels read in (C, st, sh, sw) order."""
    b, _, t, h, w = x.shape
    x = x.reshape(b, -1, *stride, t, h, w)
    return x.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)


class SpaceToDepthDownsampler(nn.Module):
    """Conv to out / (st sh sw) channels then space-to-depth, plus the space-to-depth input averaged
    over channel groups. A temporal stride first repeats the first frame (st - 1) times in front."""

    def __init__(
        self, in_channels: int, out_channels: int, stride: tuple[int, int, int], spatial_padding_mode: str
    ) -> None:
        super().__init__()
        self.stride = stride
        factor = stride[0] * stride[1] * stride[2]
        self.group_size = in_channels * factor // out_channels
        self.conv = LTX2CausalConv3d(
            in_channels, out_channels // factor, spatial_padding_mode=spatial_padding_mode
        )

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        x = torch.cat([x[:, :, : self.stride[0] - 1], x], dim=2)
        shortcut = _space_to_depth(x, self.stride).unflatten(1, (-1, self.group_size)).mean(dim=2)
        return _space_to_depth(self.conv(x, causal), self.stride) + shortcut


class DepthToSpaceUpsampler(nn.Module):
    """Conv then depth-to-space (x stride), dropping the first (st - 1) output frames; optionally plus
    the depth-to-space input with its channels repeated to the output width."""

    def __init__(
        self,
        in_channels: int,
        stride: tuple[int, int, int],
        residual: bool,
        upscale_factor: int,
        spatial_padding_mode: str,
    ) -> None:
        super().__init__()
        self.stride = stride
        self.residual = residual
        self.factor = stride[0] * stride[1] * stride[2]
        self.upscale_factor = upscale_factor
        self.conv = LTX2CausalConv3d(
            in_channels,
            in_channels * self.factor // upscale_factor,
            spatial_padding_mode=spatial_padding_mode,
        )

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        drop = self.stride[0] - 1
        out = _depth_to_space(self.conv(x, causal), self.stride)[:, :, drop:]
        if self.residual:
            shortcut = _depth_to_space(x, self.stride).repeat(1, self.factor // self.upscale_factor, 1, 1, 1)
            out = out + shortcut[:, :, drop:]
        return out


class DownBlock3d(nn.Module):
    """Resnets at the input width, then an optional downsampler to the block's output width."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        num_layers: int,
        eps: float,
        downsample: str | None,
        spatial_padding_mode: str,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock3d(in_channels, in_channels, eps, spatial_padding_mode=spatial_padding_mode)
            for _ in range(num_layers)
        )
        self.downsamplers: nn.ModuleList | None = None
        if downsample == "conv":
            # As in Diffusers, a strided conv keeps the input width (the block's out width is not used).
            self.downsamplers = nn.ModuleList(
                [
                    LTX2CausalConv3d(
                        in_channels, in_channels, stride=2, spatial_padding_mode=spatial_padding_mode
                    )
                ]
            )
        elif downsample is not None:
            stride = DOWNSAMPLE_STRIDES[downsample]
            self.downsamplers = nn.ModuleList(
                [SpaceToDepthDownsampler(in_channels, out_channels, stride, spatial_padding_mode)]
            )

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, None, causal)
        for downsampler in self.downsamplers or ():
            x = downsampler(x, causal)
        return x


class MidBlock3d(nn.Module):
    """Resnets at one width; with timestep conditioning, the block embeds the timestep for them."""

    def __init__(
        self,
        channels: int,
        num_layers: int,
        eps: float,
        inject_noise: bool = False,
        timestep_conditioning: bool = False,
        spatial_padding_mode: str = "zeros",
    ) -> None:
        super().__init__()
        self.time_embedder = TimestepEmbedder(channels * 4) if timestep_conditioning else None
        self.resnets = nn.ModuleList(
            ResnetBlock3d(channels, channels, eps, inject_noise, timestep_conditioning, spatial_padding_mode)
            for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor, timestep: torch.Tensor | None, causal: bool) -> torch.Tensor:
        temb = None
        if self.time_embedder is not None:
            temb = self.time_embedder(timestep, x.shape[0], x.dtype)
        for resnet in self.resnets:
            x = resnet(x, temb, causal)
        return x


class UpBlock3d(nn.Module):
    """[Width-changing resnet `conv_in`] -> optional depth-to-space upsampler -> resnets."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        num_layers: int,
        eps: float,
        upsample: str | None,
        inject_noise: bool,
        timestep_conditioning: bool,
        upsample_residual: bool,
        upscale_factor: int,
        spatial_padding_mode: str,
    ) -> None:
        super().__init__()
        self.time_embedder = TimestepEmbedder(in_channels * 4) if timestep_conditioning else None
        self.conv_in: ResnetBlock3d | None = None
        if in_channels != out_channels:
            self.conv_in = ResnetBlock3d(
                in_channels, out_channels, eps, inject_noise, timestep_conditioning, spatial_padding_mode
            )
        self.upsamplers: nn.ModuleList | None = None
        if upsample is not None:
            self.upsamplers = nn.ModuleList(
                [
                    DepthToSpaceUpsampler(
                        out_channels * upscale_factor,
                        UPSAMPLE_STRIDES[upsample],
                        upsample_residual,
                        upscale_factor,
                        spatial_padding_mode,
                    )
                ]
            )
        self.resnets = nn.ModuleList(
            ResnetBlock3d(
                out_channels, out_channels, eps, inject_noise, timestep_conditioning, spatial_padding_mode
            )
            for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor, timestep: torch.Tensor | None, causal: bool) -> torch.Tensor:
        if self.conv_in is not None:
            if self.conv_in.scale_shift_table is not None:
                # Diffusers hands this resnet the raw timestep, which it cannot use; fail clearly instead.
                raise NotImplementedError(
                    "a timestep-conditioned up block whose width changes (conv_in) cannot run (nor can it in Diffusers)"
                )
            x = self.conv_in(x, None, causal)
        temb = None
        if self.time_embedder is not None:
            temb = self.time_embedder(timestep, x.shape[0], x.dtype)
        for upsampler in self.upsamplers or ():
            x = upsampler(x, causal)
        for resnet in self.resnets:
            x = resnet(x, temb, causal)
        return x


class LTX2VideoEncoder3d(nn.Module):
    """Video (B, C, T, H, W) -> moments (B, 2 latent, t, h, w): the mean, then the single predicted
    log-variance channel repeated `latent` times (as Diffusers builds them)."""

    def __init__(
        self,
        in_channels: int,
        latent_channels: int,
        block_out_channels: Sequence[int],
        spatio_temporal_scaling: Sequence[bool],
        layers_per_block: Sequence[int],
        downsample_type: Sequence[str],
        patch_size: int,
        eps: float,
        is_causal: bool,
        spatial_padding_mode: str,
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.is_causal = is_causal
        width = latent_channels  # Diffusers' conv_in maps to the latent width first
        self.conv_in = LTX2CausalConv3d(
            in_channels * patch_size**2, width, spatial_padding_mode=spatial_padding_mode
        )
        self.down_blocks = nn.ModuleList()
        for i, out_width in enumerate(block_out_channels):
            downsample = downsample_type[i] if spatio_temporal_scaling[i] else None
            self.down_blocks.append(
                DownBlock3d(width, out_width, layers_per_block[i], eps, downsample, spatial_padding_mode)
            )
            width = out_width
        self.mid_block = MidBlock3d(
            width, layers_per_block[-1], eps, spatial_padding_mode=spatial_padding_mode
        )
        self.conv_out = LTX2CausalConv3d(
            width, latent_channels + 1, spatial_padding_mode=spatial_padding_mode
        )

    def forward(self, x: torch.Tensor, causal: bool | None = None) -> torch.Tensor:
        # Diffusers' rule: an explicit False cannot override a causal encoder.
        causal = bool(causal or self.is_causal)
        b, c, t, h, w = x.shape
        p = self.patch_size
        # Pixel cells folded into channels in (C, p_w, p_h) order, as Diffusers does.
        x = x.reshape(b, c, t, 1, h // p, p, w // p, p).permute(0, 1, 3, 7, 5, 2, 4, 6).flatten(1, 4)
        x = self.conv_in(x, causal)
        for block in self.down_blocks:
            x = block(x, causal)
        x = self.mid_block(x, None, causal)
        x = self.conv_out(F.silu(channel_rms_norm(x)), causal)
        logvar = x[:, -1:].repeat(1, x.shape[1] - 2, 1, 1, 1)
        return torch.cat([x, logvar], dim=1)


class LTX2VideoDecoder3d(nn.Module):
    """Latents (B, latent, t, h, w) [+ decode timestep per sample] -> video (B, C, T, H, W).

    Per-block sequences are given in encoder order (Diffusers' config) and reversed here.
    """

    def __init__(
        self,
        latent_channels: int,
        out_channels: int,
        block_out_channels: Sequence[int],
        spatio_temporal_scaling: Sequence[bool],
        layers_per_block: Sequence[int],
        upsample_type: Sequence[str],
        patch_size: int,
        eps: float,
        is_causal: bool,
        inject_noise: Sequence[bool],
        timestep_conditioning: bool,
        upsample_residual: Sequence[bool],
        upsample_factor: Sequence[int],
        spatial_padding_mode: str,
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.is_causal = is_causal
        widths = tuple(reversed(block_out_channels))
        scaling = tuple(reversed(spatio_temporal_scaling))
        layers = tuple(reversed(layers_per_block))
        noise = tuple(reversed(inject_noise))
        residual = tuple(reversed(upsample_residual))
        factors = tuple(reversed(upsample_factor))

        width = widths[0]
        self.conv_in = LTX2CausalConv3d(latent_channels, width, spatial_padding_mode=spatial_padding_mode)
        self.mid_block = MidBlock3d(
            width, layers[0], eps, noise[0], timestep_conditioning, spatial_padding_mode
        )
        self.up_blocks = nn.ModuleList()
        for i, block_width in enumerate(widths):
            in_width, width = width // factors[i], block_width // factors[i]
            self.up_blocks.append(
                UpBlock3d(
                    in_width,
                    width,
                    layers[i + 1],
                    eps,
                    upsample_type[i] if scaling[i] else None,
                    noise[i + 1],
                    timestep_conditioning,
                    residual[i],
                    factors[i],
                    spatial_padding_mode,
                )
            )
        self.conv_out = LTX2CausalConv3d(
            width, out_channels * patch_size**2, spatial_padding_mode=spatial_padding_mode
        )

        self.time_embedder: TimestepEmbedder | None = None
        self.scale_shift_table: nn.Parameter | None = None
        self.timestep_scale_multiplier: nn.Parameter | None = None
        if timestep_conditioning:
            self.timestep_scale_multiplier = nn.Parameter(torch.full((), 1000.0, dtype=torch.float32))
            self.time_embedder = TimestepEmbedder(width * 2)
            self.scale_shift_table = nn.Parameter(torch.randn(2, width) / width**0.5)

    def forward(
        self, z: torch.Tensor, timestep: torch.Tensor | None = None, causal: bool | None = None
    ) -> torch.Tensor:
        causal = bool(causal or self.is_causal)
        if self.timestep_scale_multiplier is not None:
            if timestep is None:
                raise ValueError(
                    "this decoder is timestep-conditioned: pass the decode timestep (one per sample)"
                )
            timestep = timestep * self.timestep_scale_multiplier
        x = self.conv_in(z, causal)
        x = self.mid_block(x, timestep, causal)
        for block in self.up_blocks:  # the whole clip (or tile) at once: each up block is a decode chunk
            decode_chunk_boundary()
            x = block(x, timestep, causal)
        x = channel_rms_norm(x)
        if self.time_embedder is not None:
            temb = self.time_embedder(timestep, x.shape[0], x.dtype).unflatten(1, (2, -1))
            shift, scale = (temb + self.scale_shift_table[None, :, :, None, None, None]).unbind(dim=1)
            x = x * (1 + scale) + shift
        x = self.conv_out(F.silu(x), causal)
        # Unfold the channels back into p x p pixel cells (channel order (C, p_w, p_h)).
        b, _, t, h, w = x.shape
        p = self.patch_size
        x = x.reshape(b, -1, 1, p, p, t, h, w)
        return x.permute(0, 1, 5, 2, 6, 4, 7, 3).flatten(6, 7).flatten(4, 5).flatten(2, 3)
