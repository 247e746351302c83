"""Diffusers' `AutoencoderKLMochi`: Mochi 1's video VAE (12 latent channels, 8x spatial and 6x temporal
compression in the released folder), its decoder native.

    decode: latents (B, 12, t, h, w) -> video (B, 3, 6 (t - 1) + 1, 8h, 8w), not clamped

The decoder: a 1x1x1 conv in, residual blocks (per-frame GroupNorm of 32 groups, SiLU, causal 3x3x3 convs
whose padding replicates the first frame twice in front and the edge rows / columns), then per level a Linear
over channels that expands each latent cell into (temporal x spatial x spatial) cells, then residual blocks and
a Linear to RGB. As in Diffusers' defaults the whole clip goes through in one piece (no frame chunks), and the
first `temporal_compression - 1` output frames are dropped (`drop_last_temporal_frames`). Tiling
(`enable_tiling`, Diffusers' pixel tiles of 256 every 192) decodes spatial tiles alone and cross-fades them.

The encoder's weights load (the folder holds them) but encoding is not implemented: Mochi's pipeline is
text-to-video. The latents' mean / std normalisation is the pipeline's job; the values stay in `config`.
State-dict keys match Diffusers'.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.tiling import StridedTilingMixin, per_sample

#: Diffusers' `AutoencoderKLMochi` config keys and defaults (the released Mochi VAE).
MOCHI_VAE_CONFIG_DEFAULTS: dict[str, Any] = {
    "in_channels": 15,
    "out_channels": 3,
    "encoder_block_out_channels": (64, 128, 256, 384),
    "decoder_block_out_channels": (128, 256, 512, 768),
    "latent_channels": 12,
    "layers_per_block": (3, 3, 4, 6, 3),
    "act_fn": "silu",
    "temporal_expansions": (1, 2, 3),
    "spatial_expansions": (2, 2, 2),
    "add_attention_block": (False, True, True, True, True),
    "latents_mean": (
        -0.06730895953510081,
        -0.038011381506090416,
        -0.07477820912866141,
        -0.05565264470995561,
        0.012767231469026969,
        -0.04703542746246419,
        0.043896967884726704,
        -0.09346305707025976,
        -0.09918314763016893,
        -0.008729793427399178,
        -0.011931556316503654,
        -0.0321993391887285,
    ),
    "latents_std": (
        0.9263795028493863,
        0.9248894543193766,
        0.9393059390890617,
        0.959253732819592,
        0.8244560132752793,
        0.917259975397747,
        0.9294154431013696,
        1.3720942357788521,
        0.881393668867029,
        0.9168315692124348,
        0.9185249279345552,
        0.9274757570805041,
    ),
    "scaling_factor": 1.0,
}
GROUPS = 32


class FrameGroupNorm(nn.Module):
    """GroupNorm of each frame on its own (Diffusers' `MochiChunkedGroupNorm3D`; `norm_layer` keeps its name)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm_layer = nn.GroupNorm(GROUPS, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        frames = x.transpose(1, 2).flatten(0, 1)
        return self.norm_layer(frames).unflatten(0, (b, -1)).transpose(1, 2)


class ReplicateCausalConv3d(nn.Module):
    """A 3-D conv whose input is padded by replication: `kernel_t - 1` copies of the first frame in front,
    (kernel - 1) / 2 edge rows and columns each side (`conv` keeps Diffusers' name)."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel: tuple[int, int, int], stride: tuple[int, ...]
    ):
        super().__init__()
        kt, kh, kw = kernel
        self.padding = ((kw - 1) // 2, (kw - 1) // 2, (kh - 1) // 2, (kh - 1) // 2, kt - 1, 0)
        self.conv = nn.Conv3d(in_channels, out_channels, kernel, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding, mode="replicate"))


class ResnetBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm1 = FrameGroupNorm(channels)
        self.conv1 = ReplicateCausalConv3d(channels, channels, (3, 3, 3), (1, 1, 1))
        self.norm2 = FrameGroupNorm(channels)
        self.conv2 = ReplicateCausalConv3d(channels, channels, (3, 3, 3), (1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class _EncoderAttention(nn.Module):
    """The encoder's per-position attention over frames (weights only: encoding is not implemented)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(channels, channels, bias=False)
        self.to_k = nn.Linear(channels, channels, bias=False)
        self.to_v = nn.Linear(channels, channels, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels), nn.Identity()])


class MidBlock(nn.Module):
    """Residual blocks (with the encoder's attention layers' weights when `attention`)."""

    def __init__(self, channels: int, layers: int, attention: bool = False) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels) for _ in range(layers)])
        if attention:
            self.norms = nn.ModuleList([FrameGroupNorm(channels) for _ in range(layers)])
            self.attentions = nn.ModuleList([_EncoderAttention(channels) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x


class _DownBlock(MidBlock):
    def __init__(self, in_channels: int, out_channels: int, layers: int, st: int, ss: int, attention: bool):
        super().__init__(out_channels, layers, attention)
        self.conv_in = ReplicateCausalConv3d(in_channels, out_channels, (st, ss, ss), (st, ss, ss))


class UpBlock(nn.Module):
    """Residual blocks, then a Linear over channels expanding each cell into st x ss x ss output cells."""

    def __init__(self, in_channels: int, out_channels: int, layers: int, st: int, ss: int) -> None:
        super().__init__()
        self.st, self.ss = st, ss
        self.resnets = nn.ModuleList([ResnetBlock(in_channels) for _ in range(layers)])
        self.proj = nn.Linear(in_channels, out_channels * st * ss * ss)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        x = self.proj(x.permute(0, 2, 3, 4, 1))  # (b, f, h, w, c * st * ss * ss)
        b, f, h, w, _ = x.shape
        st, ss = self.st, self.ss
        x = x.view(b, f, h, w, -1, st, ss, ss).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(b, -1, f * st, h * ss, w * ss)


class Decoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        channels = cfg["decoder_block_out_channels"]
        layers = cfg["layers_per_block"]
        st, ss = cfg["temporal_expansions"], cfg["spatial_expansions"]
        self.conv_in = nn.Conv3d(cfg["latent_channels"], channels[-1], kernel_size=1)
        self.block_in = MidBlock(channels[-1], layers[-1])
        self.up_blocks = nn.ModuleList(
            [
                UpBlock(channels[-i - 1], channels[-i - 2], layers[-i - 2], st[-i - 1], ss[-i - 1])
                for i in range(len(channels) - 1)
            ]
        )
        self.block_out = MidBlock(channels[0], layers[0])
        self.proj_out = nn.Linear(channels[0], cfg["out_channels"])

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.block_in(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        x = F.silu(self.block_out(x))
        return self.proj_out(x.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)


class _Encoder(nn.Module):
    """The encoder's modules, for its weights (Diffusers' `MochiEncoder3D` names)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        channels = cfg["encoder_block_out_channels"]
        layers, attention = cfg["layers_per_block"], cfg["add_attention_block"]
        st, ss = cfg["temporal_expansions"], cfg["spatial_expansions"]
        self.proj_in = nn.Linear(cfg["in_channels"], channels[0])
        self.block_in = MidBlock(channels[0], layers[0], attention[0])
        self.down_blocks = nn.ModuleList(
            [
                _DownBlock(channels[i], channels[i + 1], layers[i + 1], st[i], ss[i], attention[i + 1])
                for i in range(len(channels) - 1)
            ]
        )
        self.block_out = MidBlock(channels[-1], layers[-1], attention[-1])
        self.norm_out = FrameGroupNorm(channels[-1])
        self.proj_out = nn.Linear(channels[-1], 2 * cfg["latent_channels"], bias=False)


class AutoencoderKLMochi(DiffusersConfigured, StridedTilingMixin, nn.Module):
    """Mochi's video VAE with Diffusers' config keys and weight names; decode only."""

    diffusers_class_name: ClassVar[str] = "AutoencoderKLMochi"
    config_defaults = MOCHI_VAE_CONFIG_DEFAULTS

    def __init__(self, **config: Any) -> None:
        super().__init__()
        cfg = {**MOCHI_VAE_CONFIG_DEFAULTS, **config}
        for key in (
            "encoder_block_out_channels",
            "decoder_block_out_channels",
            "layers_per_block",
            "temporal_expansions",
            "spatial_expansions",
            "add_attention_block",
        ):
            cfg[key] = tuple(cfg[key])
        if cfg["act_fn"] not in ("silu", "swish"):
            raise ValueError(f"AutoencoderKLMochi: act_fn must be silu, got {cfg['act_fn']!r}")
        self.config = cfg
        self.encoder = _Encoder(cfg)
        self.decoder = Decoder(cfg)
        #: Diffusers' defaults: tiles of 256 pixels every 192 (tiling off until `enable_tiling`).
        self.tile_sample_min_height = 256
        self.tile_sample_min_width = 256
        self.tile_sample_stride_height = 192
        self.tile_sample_stride_width = 192
        #: Diffusers drops the first `temporal_compression_ratio - 1` decoded frames.
        self.drop_last_temporal_frames = True

    @property
    def spatial_compression_ratio(self) -> int:
        return functools.reduce(operator.mul, self.config["spatial_expansions"], 1)

    @property
    def temporal_compression_ratio(self) -> int:
        return functools.reduce(operator.mul, self.config["temporal_expansions"], 1)

    def encode(self, x: torch.Tensor):
        raise NotImplementedError(
            "AutoencoderKLMochi: encoding is not implemented (text-to-video decodes only)"
        )

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, t, h, w), already un-normalised -> video (B, 3, 6 (t - 1) + 1, 8h, 8w), not clamped."""
        if z.ndim != 5:
            raise ValueError(f"expected video latents (B, C, t, h, w), got shape {tuple(z.shape)}")
        return per_sample(self._decode_clip, z, self.use_slicing)

    def _decode_whole(self, z: torch.Tensor) -> torch.Tensor:
        video = self.decoder(z)
        ratio = self.temporal_compression_ratio
        if self.drop_last_temporal_frames and video.shape[2] >= ratio:
            video = video[:, :, ratio - 1 :]
        return video

    def _decode_clip(self, z: torch.Tensor) -> torch.Tensor:
        ratio = self.spatial_compression_ratio
        tile_h, tile_w = self.tile_sample_min_height // ratio, self.tile_sample_min_width // ratio
        if not self.tiles_needed(z, tile_h, tile_w):
            return self._decode_whole(z)
        video = self.run_strided_tiles(self._decode_whole, z, ratio, 1)
        return video[..., : z.shape[-2] * ratio, : z.shape[-1] * ratio]
