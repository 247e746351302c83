"""Native deep-compression autoencoder: Diffusers' `AutoencoderDC` (DC-AE, MIT HAN Lab), SANA's VAE.

Config names and defaults match Diffusers' `config.json` and state-dict keys match Diffusers', so a
checkpoint loads with `load_state_dict(sd, assign=True, strict=True)` into a module built on the meta device.

    encode(image in [-1, 1], (B, 3, H, W)) -> latents (B, latent_channels, H / f, W / f)   deterministic
    decode(latents) -> image in (roughly) [-1, 1]                                           f = 2 ** (stages - 1)

SANA's `dc-ae-f32c32-sana-1.x` (f = 32, 32 channels): six stages, ResBlocks in the first three and
EfficientViT blocks (ReLU linear attention with a 5x5 multi-scale branch, then a GLUMBConv) in the
last three; stride-2 convolutions down and nearest-interpolation + conv up, each with a parameter-free
shortcut (space-to-channel then channel averaging down, channel repetition then channel-to-space up).
The ImageNet/mix DC-AEs (no first-stage layers, BatchNorm/ReLU decoder stages, pixel (un)shuffle
resampling) build from their configs too.

The latent scaling is *not* applied here: as in Diffusers, the pipeline multiplies encoder output by
`config["scaling_factor"]` and divides by it before decoding.

Tiling and slicing are Diffusers' (`tiling.py`): `enable_tiling(tile_sample_min_height=512,
tile_sample_min_width=512, tile_sample_stride_height=448, tile_sample_stride_width=448)` encodes / decodes
images larger than a tile in overlapping tiles, cross-faded; `enable_slicing()` one image at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.layers.glumbconv import GLUMBConv
from diffserve.models.config_keys import DiffusersConfigured, check_choices, per_block
from diffserve.models.vaes.blocks import get_activation
from diffserve.models.vaes.tiling import StridedTilingMixin, decode_chunk_boundary, per_sample

#: Every RMSNorm / BatchNorm in DC-AE uses this epsilon.
NORM_EPS = 1e-5
#: Linear attention's denominator guard, as Diffusers'.
LINEAR_ATTENTION_EPS = 1e-15
BLOCK_TYPES = ("ResBlock", "EfficientViTBlock")
NORM_TYPES = ("rms_norm", "batch_norm")
#: Diffusers treats every value but "pixel_unshuffle" as a stride-2 conv; released configs say "conv"/"Conv".
DOWNSAMPLE_TYPES = ("pixel_unshuffle", "conv")
UPSAMPLE_TYPES = ("pixel_shuffle", "interpolate")


class ChannelRMSNorm(nn.Module):
    """RMSNorm over the channels of a (B, C, H, W) map with weight and bias: Diffusers' `RMSNorm(bias=True)`
    applied on channels-last, including its rounding (mean square in fp32; cast to a half-precision weight's
    dtype before the weight multiply)."""

    def __init__(self, channels: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight[:, None, None] + self.bias[:, None, None]


class FrozenBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm with its running statistics, in train mode too (inference only); Diffusers' keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )


def _norm(norm_type: str, channels: int) -> nn.Module:
    if norm_type == "rms_norm":
        return ChannelRMSNorm(channels)
    if norm_type == "batch_norm":
        return FrozenBatchNorm2d(channels, eps=NORM_EPS)
    raise ValueError(f"AutoencoderDC: norm type {norm_type!r} is not supported; supported: {NORM_TYPES}")


class ResBlock(nn.Module):
    """x + norm(conv3x3(act(conv3x3(x)))); the second conv has no bias (the norm follows it)."""

    def __init__(self, channels: int, norm_type: str, act_fn: str) -> None:
        super().__init__()
        self.act = get_activation(act_fn)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = _norm(norm_type, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv2(self.act(self.conv1(x)))) + x


class MultiscaleProjection(nn.Module):
    """A multi-scale branch of the q/k/v maps: depthwise k x k conv, then a per-head grouped 1x1 conv."""

    def __init__(self, channels: int, num_heads: int, kernel_size: int) -> None:
        super().__init__()
        qkv = 3 * channels
        self.proj_in = nn.Conv2d(qkv, qkv, kernel_size, padding=kernel_size // 2, groups=qkv, bias=False)
        self.proj_out = nn.Conv2d(qkv, qkv, 1, groups=3 * num_heads, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.proj_in(x))


class MultiscaleLinearAttention(nn.Module):
    """EfficientViT's LiteMLA, residual: ReLU linear attention over the q/k/v maps and their multi-scale
    aggregates (each scale adds `num_heads` more heads), then a projection and a norm.

    The concatenated [to_q; to_k; to_v; scale-1 branch; ...] channels are read as consecutive groups of
    3 x head_dim, each group's thirds being one head's q, k and v: `to_q`/`to_k`/`to_v` are the three
    thirds of the original fused qkv projection (Diffusers' conversion splits it so), not per-role
    weights. Maps of at most head_dim pixels take the quadratic form (ReLU kernel, normalised over
    keys), as Diffusers does.
    """

    def __init__(
        self, channels: int, head_dim: int, kernel_sizes: Sequence[int], norm_type: str, mult: float = 1.0
    ) -> None:
        super().__init__()
        num_heads = int(channels // head_dim * mult)
        inner = num_heads * head_dim
        self.head_dim = head_dim
        self.to_q = nn.Linear(channels, inner, bias=False)
        self.to_k = nn.Linear(channels, inner, bias=False)
        self.to_v = nn.Linear(channels, inner, bias=False)
        self.to_qkv_multiscale = nn.ModuleList(
            [MultiscaleProjection(inner, num_heads, k) for k in kernel_sizes]
        )
        self.to_out = nn.Linear(inner * (1 + len(kernel_sizes)), channels, bias=False)
        self.norm_out = _norm(norm_type, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        tokens = height * width
        linear = tokens > self.head_dim
        x_last = x.movedim(1, -1)
        qkv = torch.cat([self.to_q(x_last), self.to_k(x_last), self.to_v(x_last)], dim=-1).movedim(-1, 1)
        qkv = torch.cat([qkv, *(branch(qkv) for branch in self.to_qkv_multiscale)], dim=1)
        if linear:
            qkv = qkv.float()
        q, k, v = qkv.reshape(batch, -1, 3 * self.head_dim, tokens).chunk(3, dim=2)  # (B, heads, d, N)
        q, k = F.relu(q), F.relu(k)
        out = self._linear(q, k, v).to(x.dtype) if linear else self._quadratic(q, k, v)
        out = self.to_out(out.reshape(batch, -1, height, width).movedim(1, -1)).movedim(-1, 1)
        return self.norm_out(out) + x

    @staticmethod
    def _linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[V; 1] K^T (d + 1 x d per head), times Q: numerators and the normaliser in one product."""
        out = (F.pad(v, (0, 0, 0, 1), value=1.0) @ k.transpose(-1, -2)) @ q
        out = out.float()
        return out[:, :, :-1] / (out[:, :, -1:] + LINEAR_ATTENTION_EPS)

    @staticmethod
    def _quadratic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The same attention with the N x N weights formed explicitly (tiny maps), normalised in fp32."""
        weights = (k.transpose(-1, -2) @ q).float()
        weights = weights / (weights.sum(dim=2, keepdim=True) + LINEAR_ATTENTION_EPS)
        return v @ weights.to(v.dtype)


class EfficientViTBlock(nn.Module):
    """Multi-scale linear attention, then a GLUMBConv with an RMSNorm, each residual."""

    def __init__(self, channels: int, head_dim: int, kernel_sizes: Sequence[int], norm_type: str) -> None:
        super().__init__()
        self.attn = MultiscaleLinearAttention(channels, head_dim, kernel_sizes, norm_type)
        self.conv_out = GLUMBConv(
            channels, channels, 4.0, norm=ChannelRMSNorm(channels), residual_connection=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_out(self.attn(x))


def _block(
    block_type: str, channels: int, head_dim: int, norm_type: str, act_fn: str, scales: Sequence[int]
) -> nn.Module:
    if block_type == "ResBlock":
        return ResBlock(channels, norm_type, act_fn)
    if block_type == "EfficientViTBlock":
        return EfficientViTBlock(channels, head_dim, scales, norm_type)
    raise ValueError(f"AutoencoderDC: block type {block_type!r} is not supported; supported: {BLOCK_TYPES}")


class DCDownBlock2d(nn.Module):
    """Halve H and W: a stride-2 conv (or a conv then space-to-channel), plus, with `shortcut`, the input
    folded space-to-channel and averaged over consecutive channel groups down to `out_channels`."""

    def __init__(self, in_channels: int, out_channels: int, pixel_unshuffle: bool, shortcut: bool) -> None:
        super().__init__()
        self.pixel_unshuffle = pixel_unshuffle
        self.shortcut = shortcut
        self.group_size = in_channels * 4 // out_channels
        conv_out = out_channels // 4 if pixel_unshuffle else out_channels
        if pixel_unshuffle and out_channels % 4:
            raise ValueError(
                f"AutoencoderDC: pixel_unshuffle needs out channels divisible by 4, got {out_channels}"
            )
        self.conv = nn.Conv2d(in_channels, conv_out, 3, stride=1 if pixel_unshuffle else 2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        if self.pixel_unshuffle:
            out = F.pixel_unshuffle(out, 2)
        if not self.shortcut:
            return out
        return out + F.pixel_unshuffle(x, 2).unflatten(1, (-1, self.group_size)).mean(dim=2)


class DCUpBlock2d(nn.Module):
    """Double H and W: nearest upsampling then a conv (or a conv then channel-to-space), plus, with
    `shortcut`, the input's channels repeated and folded channel-to-space."""

    def __init__(self, in_channels: int, out_channels: int, interpolate: bool, shortcut: bool) -> None:
        super().__init__()
        self.interpolate = interpolate
        self.shortcut = shortcut
        self.repeats = out_channels * 4 // in_channels
        self.conv = nn.Conv2d(in_channels, out_channels if interpolate else 4 * out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.interpolate:
            out = self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))
        else:
            out = F.pixel_shuffle(self.conv(x), 2)
        if not self.shortcut:
            return out
        repeated = x.repeat_interleave(self.repeats, dim=1, output_size=x.shape[1] * self.repeats)
        return out + F.pixel_shuffle(repeated, 2)


class DCEncoder(nn.Module):
    """conv_in, per stage its blocks then (not after the last) a downsampling block, conv_out + channel-mean shortcut."""

    def __init__(
        self,
        in_channels: int,
        latent_channels: int,
        head_dim: int,
        block_types: Sequence[str],
        block_out_channels: Sequence[int],
        layers_per_block: Sequence[int],
        qkv_multiscales: Sequence[Sequence[int]],
        pixel_unshuffle: bool,
        out_shortcut: bool,
    ) -> None:
        super().__init__()
        stages = len(block_out_channels)
        if layers_per_block[0] > 0:
            self.conv_in: nn.Module = nn.Conv2d(in_channels, block_out_channels[0], 3, padding=1)
        else:
            self.conv_in = DCDownBlock2d(in_channels, block_out_channels[1], pixel_unshuffle, shortcut=False)
        down_blocks = []
        for i, (channels, layers) in enumerate(zip(block_out_channels, layers_per_block, strict=True)):
            stage: list[nn.Module] = [
                _block(block_types[i], channels, head_dim, "rms_norm", "silu", qkv_multiscales[i])
                for _ in range(layers)
            ]
            if i < stages - 1 and layers > 0:
                stage.append(
                    DCDownBlock2d(channels, block_out_channels[i + 1], pixel_unshuffle, shortcut=True)
                )
            down_blocks.append(nn.Sequential(*stage))
        self.down_blocks = nn.ModuleList(down_blocks)
        self.conv_out = nn.Conv2d(block_out_channels[-1], latent_channels, 3, padding=1)
        self.out_shortcut_group = block_out_channels[-1] // latent_channels if out_shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for stage in self.down_blocks:
            x = stage(x)
        if self.out_shortcut_group is None:
            return self.conv_out(x)
        return self.conv_out(x) + x.unflatten(1, (-1, self.out_shortcut_group)).mean(dim=2)


class DCDecoder(nn.Module):
    """conv_in + channel-repeat shortcut, per stage (deepest first) an upsampling block then its blocks,
    RMSNorm, activation, conv_out. `up_blocks[i]` is stage i, as in Diffusers."""

    def __init__(
        self,
        out_channels: int,
        latent_channels: int,
        head_dim: int,
        block_types: Sequence[str],
        block_out_channels: Sequence[int],
        layers_per_block: Sequence[int],
        qkv_multiscales: Sequence[Sequence[int]],
        norm_types: Sequence[str],
        act_fns: Sequence[str],
        interpolate: bool,
        in_shortcut: bool,
        conv_act_fn: str,
    ) -> None:
        super().__init__()
        stages = len(block_out_channels)
        self.conv_in = nn.Conv2d(latent_channels, block_out_channels[-1], 3, padding=1)
        self.in_shortcut_repeats = block_out_channels[-1] // latent_channels if in_shortcut else None
        up_blocks = []
        for i, (channels, layers) in enumerate(zip(block_out_channels, layers_per_block, strict=True)):
            stage: list[nn.Module] = []
            if i < stages - 1 and layers > 0:
                stage.append(DCUpBlock2d(block_out_channels[i + 1], channels, interpolate, shortcut=True))
            stage += [
                _block(block_types[i], channels, head_dim, norm_types[i], act_fns[i], qkv_multiscales[i])
                for _ in range(layers)
            ]
            up_blocks.append(nn.Sequential(*stage))
        self.up_blocks = nn.ModuleList(up_blocks)
        channels = block_out_channels[0] if layers_per_block[0] > 0 else block_out_channels[1]
        self.norm_out = ChannelRMSNorm(channels)
        self.conv_act = get_activation(conv_act_fn)
        if layers_per_block[0] > 0:
            self.conv_out: nn.Module = nn.Conv2d(channels, out_channels, 3, padding=1)
        else:
            self.conv_out = DCUpBlock2d(channels, out_channels, interpolate, shortcut=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(z)
        if self.in_shortcut_repeats is not None:
            r = self.in_shortcut_repeats
            x = x + z.repeat_interleave(r, dim=1, output_size=z.shape[1] * r)
        for stage in reversed(self.up_blocks):
            x = stage(x)
        # norm_out's output is fresh, so the (in-place when possible) activation may overwrite it.
        return self.conv_out(self.conv_act(self.norm_out(x)))


class AutoencoderDC(DiffusersConfigured, StridedTilingMixin, nn.Module):
    """DC-AE with Diffusers' config and weight names.

        encode(image (B, in_channels, H, W) in [-1, 1], H and W multiples of spatial_compression_ratio)
            -> unscaled latents (B, latent_channels, H / f, W / f); deterministic (no posterior)
        decode(unscaled latents (B, latent_channels, h, w)) -> image (B, in_channels, h * f, w * f)

    The pipeline scales: `latents = encode(x) * config["scaling_factor"]`, `decode(latents / scaling_factor)`.
    """

    diffusers_class_name: ClassVar[str] = "AutoencoderDC"

    def __init__(
        self,
        *,
        in_channels: int = 3,
        latent_channels: int = 32,
        attention_head_dim: int = 32,
        encoder_block_types: str | Sequence[str] = "ResBlock",
        decoder_block_types: str | Sequence[str] = "ResBlock",
        encoder_block_out_channels: Sequence[int] = (128, 256, 512, 512, 1024, 1024),
        decoder_block_out_channels: Sequence[int] = (128, 256, 512, 512, 1024, 1024),
        encoder_layers_per_block: Sequence[int] = (2, 2, 2, 3, 3, 3),
        decoder_layers_per_block: Sequence[int] = (3, 3, 3, 3, 3, 3),
        encoder_qkv_multiscales: Sequence[Sequence[int]] = ((), (), (), (5,), (5,), (5,)),
        decoder_qkv_multiscales: Sequence[Sequence[int]] = ((), (), (), (5,), (5,), (5,)),
        upsample_block_type: str = "pixel_shuffle",
        downsample_block_type: str = "pixel_unshuffle",
        decoder_norm_types: str | Sequence[str] = "rms_norm",
        decoder_act_fns: str | Sequence[str] = "silu",
        encoder_out_shortcut: bool = True,
        decoder_in_shortcut: bool = True,
        decoder_conv_act_fn: str = "relu",
        scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        enc_stages, dec_stages = len(encoder_block_out_channels), len(decoder_block_out_channels)
        owner = self.diffusers_class_name
        enc_types = per_block(owner, "encoder_block_types", encoder_block_types, enc_stages)
        dec_types = per_block(owner, "decoder_block_types", decoder_block_types, dec_stages)
        norm_types = per_block(owner, "decoder_norm_types", decoder_norm_types, dec_stages)
        act_fns = per_block(owner, "decoder_act_fns", decoder_act_fns, dec_stages)
        check_choices(owner, "block type", (*enc_types, *dec_types), BLOCK_TYPES)
        check_choices(owner, "decoder_norm_types", norm_types, NORM_TYPES)
        check_choices(owner, "downsample_block_type", [downsample_block_type.lower()], DOWNSAMPLE_TYPES)
        check_choices(owner, "upsample_block_type", [upsample_block_type], UPSAMPLE_TYPES)
        enc_scales = tuple(tuple(int(k) for k in s) for s in encoder_qkv_multiscales)
        dec_scales = tuple(tuple(int(k) for k in s) for s in decoder_qkv_multiscales)
        # JSON gives lists; tuples make the config comparable with Diffusers' defaults.
        self.config: dict[str, Any] = {
            "in_channels": in_channels,
            "latent_channels": latent_channels,
            "attention_head_dim": attention_head_dim,
            "encoder_block_types": encoder_block_types if isinstance(encoder_block_types, str) else enc_types,
            "decoder_block_types": decoder_block_types if isinstance(decoder_block_types, str) else dec_types,
            "encoder_block_out_channels": tuple(encoder_block_out_channels),
            "decoder_block_out_channels": tuple(decoder_block_out_channels),
            "encoder_layers_per_block": tuple(encoder_layers_per_block),
            "decoder_layers_per_block": tuple(decoder_layers_per_block),
            "encoder_qkv_multiscales": enc_scales,
            "decoder_qkv_multiscales": dec_scales,
            "upsample_block_type": upsample_block_type,
            "downsample_block_type": downsample_block_type,
            "decoder_norm_types": decoder_norm_types if isinstance(decoder_norm_types, str) else norm_types,
            "decoder_act_fns": decoder_act_fns if isinstance(decoder_act_fns, str) else act_fns,
            "encoder_out_shortcut": encoder_out_shortcut,
            "decoder_in_shortcut": decoder_in_shortcut,
            "decoder_conv_act_fn": decoder_conv_act_fn,
            "scaling_factor": scaling_factor,
        }
        self.encoder = DCEncoder(
            in_channels,
            latent_channels,
            attention_head_dim,
            enc_types,
            encoder_block_out_channels,
            encoder_layers_per_block,
            enc_scales,
            pixel_unshuffle=downsample_block_type == "pixel_unshuffle",
            out_shortcut=encoder_out_shortcut,
        )
        self.decoder = DCDecoder(
            in_channels,
            latent_channels,
            attention_head_dim,
            dec_types,
            decoder_block_out_channels,
            decoder_layers_per_block,
            dec_scales,
            norm_types,
            act_fns,
            interpolate=upsample_block_type == "interpolate",
            in_shortcut=decoder_in_shortcut,
            conv_act_fn=decoder_conv_act_fn,
        )
        # Diffusers' tile defaults (pixels; used once `enable_tiling()` sets `use_tiling`).
        self.tile_sample_min_height = 512
        self.tile_sample_min_width = 512
        self.tile_sample_stride_height = 448
        self.tile_sample_stride_width = 448
        self.tile_latent_min_height = self.tile_sample_min_height // self.spatial_compression_ratio
        self.tile_latent_min_width = self.tile_sample_min_width // self.spatial_compression_ratio

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side (Diffusers pipelines call this `vae_scale_factor`)."""
        return 2 ** (len(self.config["encoder_block_out_channels"]) - 1)

    def _enable_tiling_with(self, **tile_params: float | None) -> None:
        super()._enable_tiling_with(**tile_params)
        # Diffusers' latent tile sizes follow the pixel ones (they decide when a decode is tiled).
        self.tile_latent_min_height = self.tile_sample_min_height // self.spatial_compression_ratio
        self.tile_latent_min_width = self.tile_sample_min_width // self.spatial_compression_ratio

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Image batch (B, in_channels, H, W) in [-1, 1] -> unscaled latents (B, latent_channels, H / f, W / f)."""
        f = self.spatial_compression_ratio
        if x.ndim != 4 or x.shape[-2] % f or x.shape[-1] % f:
            raise ValueError(
                f"AutoencoderDC.encode: need (B, C, H, W) with H, W multiples of {f}, got {tuple(x.shape)}"
            )
        return per_sample(self._encode_images, x, self.use_slicing)

    def _encode_images(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder, or with tiling on and `x` larger than a tile, Diffusers' `tiled_encode`: overlapping
        pixel tiles encoded and cross-faded in latents, cropped to the latent size."""
        if not self.tiles_needed(x, self.tile_sample_min_height, self.tile_sample_min_width):
            return self.encoder(x)
        f = self.spatial_compression_ratio
        latents = self.run_strided_tiles(self._encode_tile, x, in_scale=1, out_scale=f)
        return latents[:, :, : x.shape[2] // f, : x.shape[3] // f]

    def _encode_tile(self, tile: torch.Tensor) -> torch.Tensor:
        """A pixel tile padded at its bottom / right to a multiple of the compression ratio, encoded."""
        f = self.spatial_compression_ratio
        pad_h, pad_w = -tile.shape[2] % f, -tile.shape[3] % f
        if pad_h or pad_w:
            tile = F.pad(tile, (0, pad_w, 0, pad_h))
        return self.encoder(tile)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (B, latent_channels, h, w) -> image batch (B, in_channels, h * f, w * f)."""
        return per_sample(self._decode_images, z, self.use_slicing)

    def _decode_images(self, z: torch.Tensor) -> torch.Tensor:
        """The decoder, or with tiling on and `z` larger than a tile, Diffusers' `tiled_decode`: overlapping
        latent tiles decoded and cross-faded (no final crop)."""
        if not self.tiles_needed(z, self.tile_latent_min_height, self.tile_latent_min_width):
            return self.decoder(z)
        f = self.spatial_compression_ratio
        return self.run_strided_tiles(self._decode_tile, z, in_scale=f, out_scale=1)

    def _decode_tile(self, z: torch.Tensor) -> torch.Tensor:
        decode_chunk_boundary()  # each tile is one decode chunk
        return self.decoder(z)
