"""Diffusers' `AutoencoderKLMochi`: Mochi 1's video VAE (12 latent channels, 8x spatial and 6x temporal
compression in the released folder), encoder and decoder native.

    encode: video (B, 3, T, H, W) in [-1, 1] -> DiagonalGaussian over (B, 12, (T-1) // 6 + 1, H // 8, W // 8)
    decode: latents (B, 12, t, h, w) -> video (B, 3, 6 (t - 1) + 1, 8h, 8w), not clamped

The encoder: each pixel's RGB with sin / cos features of it at 2^6 and 2^7 cycles (`fourier_features`, 15
channels), a Linear over channels, then residual blocks and, per level, a causal conv whose kernel equals its
stride (temporal x spatial x spatial, first frame replicated in front) followed by residual blocks. Where
`add_attention_block` says so, each residual block is followed by a residual attention of every pixel over
its own frames, causal in time (heads of 32 channels, L2-normalised queries and keys). A per-frame GroupNorm,
SiLU and a bias-free Linear give the moments: the mean and log-variance of the posterior, channel halves.
T need not be 1 + 6k: each temporal level keeps `(frames - 1) // stride + 1` frames (rows / columns are
floored).

The decoder: a 1x1x1 conv in, residual blocks (per-frame GroupNorm of 32 groups, SiLU, causal 3x3x3 convs
whose padding replicates the first frame twice in front and the edge rows / columns), then per level a Linear
over channels that expands each latent cell into (temporal x spatial x spatial) cells, then residual blocks
and a Linear to RGB. The first `temporal_compression - 1` output frames are dropped
(`drop_last_temporal_frames`).

As in Diffusers' defaults, both directions take the whole clip in one piece, no frame chunks (Diffusers'
frame-wise encode only raises: the attention needs every frame). Tiling (`enable_tiling`, Diffusers' pixel
tiles of 256 every 192) encodes / decodes spatial tiles alone and cross-fades them (in latents when encoding,
in pixels when decoding); slicing takes a batch one clip at a time.

The convs are CogVideoX's `SafeConv3d`, as Diffusers' are: an input over 2 GiB (at 2 bytes an element) runs
in pieces of frames. Every piece after the first starts `kernel - 1` frames early, which is exact for stride 1
but moves the windows of a strided conv that does not split on a stride boundary (the encoder's 2x temporal
level on long, large clips); Diffusers' numbers are kept. The latents' mean / std normalisation is the
pipeline's job; the values stay in `config`. State-dict keys match Diffusers'.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.autoencoder_kl import DiagonalGaussian
from diffserve.models.vaes.autoencoder_kl_cogvideox import SafeConv3d
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
#: The encoder's Fourier features: sin / cos of each input channel at 2^6 and 2^7 cycles per unit.
FOURIER_OCTAVES = (6, 7)
#: Channels per head of the encoder's attention; the eps of its queries' and keys' L2 normalisation.
ATTENTION_HEAD_DIM = 32
ATTENTION_NORM_EPS = 1e-5
#: Pixels (sequences) per attention call at most: Diffusers' bound, past which one CUDA launch fails.
ATTENTION_POSITIONS_PER_CALL = 2**15


def linear_over_channels(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer` (a Linear) applied to the channels of (B, C, T, H, W), the result back in that layout."""
    return layer(x.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)


def fourier_features(x: torch.Tensor) -> torch.Tensor:
    """(B, C, ...) -> (B, C (1 + 2 n), ...) for n = len(FOURIER_OCTAVES): the input, then the sines, then the
    cosines of 2 pi 2^k x, channel-major (channel 0's octaves, then channel 1's). Computed in float32, as
    Diffusers' `FourierFeatures` does, and returned in the input's dtype."""
    dtype = x.dtype
    x = x.float()
    octaves = torch.tensor(FOURIER_OCTAVES, dtype=torch.float32, device=x.device)
    scales = torch.pow(2.0, octaves) * (2 * math.pi)
    shape = [1, -1] + [1] * (x.ndim - 2)
    angles = x.repeat_interleave(len(FOURIER_OCTAVES), dim=1) * scales.repeat(x.shape[1]).view(shape)
    return torch.cat([x, angles.sin(), angles.cos()], dim=1).to(dtype)


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
    (kernel - 1) / 2 edge rows and columns each side (`conv` keeps Diffusers' name). The conv splits a very
    large input into pieces of frames as Diffusers' does (`SafeConv3d`)."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel: tuple[int, int, int], stride: tuple[int, ...]
    ):
        super().__init__()
        kt, kh, kw = kernel
        self.padding = ((kw - 1) // 2, (kw - 1) // 2, (kh - 1) // 2, (kh - 1) // 2, kt - 1, 0)
        self.conv = SafeConv3d(in_channels, out_channels, kernel, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding, mode="replicate"))


class ResnetBlock(nn.Module):
    """x + conv2(silu(norm2(conv1(silu(norm1(x)))))), the causal convs 3x3x3."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm1 = FrameGroupNorm(channels)
        self.conv1 = ReplicateCausalConv3d(channels, channels, (3, 3, 3), (1, 1, 1))
        self.norm2 = FrameGroupNorm(channels)
        self.conv2 = ReplicateCausalConv3d(channels, channels, (3, 3, 3), (1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        # The conv's output first: the sum takes its (contiguous) layout, not that of x (channels-last after
        # the encoder's `proj_in`), as in Diffusers; the next GroupNorm then reduces in the same order.
        return self.conv2(F.silu(self.norm2(h))) + x


class FrameAttention(nn.Module):
    """Self-attention of each pixel over its own frames, causal in time (Diffusers' `Attention` with
    `MochiVaeAttnProcessor2_0`, whose weight names it keeps): heads of 32 channels, queries and keys
    L2-normalised per head, then softmax(q k^T / sqrt(32)); no residual (the block adds it)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.heads = channels // ATTENTION_HEAD_DIM
        inner = self.heads * ATTENTION_HEAD_DIM
        self.to_q = nn.Linear(channels, inner, bias=False)
        self.to_k = nn.Linear(channels, inner, bias=False)
        self.to_v = nn.Linear(channels, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, channels), nn.Identity()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, C, T, H, W): each (b, h, w) is one sequence of T tokens. The pixels go
        through in groups of at most `ATTENTION_POSITIONS_PER_CALL` (each is independent of the others)."""
        b, _, _, h, w = x.shape
        tokens = x.permute(0, 3, 4, 2, 1).flatten(0, 2).contiguous()  # (B H W, T, C)
        step = ATTENTION_POSITIONS_PER_CALL
        out = torch.cat([self._attend(tokens[i : i + step]) for i in range(0, tokens.shape[0], step)])
        return out.unflatten(0, (b, h, w)).permute(0, 4, 3, 1, 2)

    def _attend(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, T, C) sequences -> (N, T, C). A single frame attends only to itself, so its output is its
        value, projected (Diffusers skips the queries and keys there as well)."""
        if tokens.shape[1] == 1:
            return self.to_out[0](self.to_v(tokens))
        q, k, v = (self._split_heads(proj(tokens)) for proj in (self.to_q, self.to_k, self.to_v))
        q = F.normalize(q, dim=-1, eps=ATTENTION_NORM_EPS)
        k = F.normalize(k, dim=-1, eps=ATTENTION_NORM_EPS)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out[0](out.transpose(1, 2).flatten(2))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, heads * 32) -> (N, heads, T, 32)."""
        return x.unflatten(-1, (self.heads, ATTENTION_HEAD_DIM)).transpose(1, 2)


class MidBlock(nn.Module):
    """Residual blocks, each followed (with `attention`) by a residual `FrameAttention` of its per-frame
    GroupNorm's output, as the encoder's blocks are where `add_attention_block` says so."""

    def __init__(self, channels: int, layers: int, attention: bool = False) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels) for _ in range(layers)])
        self.attention = attention
        if attention:
            self.norms = nn.ModuleList([FrameGroupNorm(channels) for _ in range(layers)])
            self.attentions = nn.ModuleList([FrameAttention(channels) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(x)
            if self.attention:
                x = x + self.attentions[i](self.norms[i](x))
        return x


class DownBlock(MidBlock):
    """The encoder's level: a causal conv with kernel = stride = (st, ss, ss) (st - 1 copies of the first
    frame in front, so T frames become (T - 1) // st + 1), then `MidBlock`'s layers at the new width."""

    def __init__(self, in_channels: int, out_channels: int, layers: int, st: int, ss: int, attention: bool):
        super().__init__(out_channels, layers, attention)
        self.conv_in = ReplicateCausalConv3d(in_channels, out_channels, (st, ss, ss), (st, ss, ss))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.conv_in(x))


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
        return linear_over_channels(self.proj_out, x)


class Encoder(nn.Module):
    """Video (B, C, T, H, W) -> moments (B, 2 latent, (T - 1) // st + 1, H // ss, W // ss), mean channels
    first (Diffusers' `MochiEncoder3D`, with its module names; `in_channels` counts the Fourier features,
    5 per video channel)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        channels = cfg["encoder_block_out_channels"]
        layers, attention = cfg["layers_per_block"], cfg["add_attention_block"]
        st, ss = cfg["temporal_expansions"], cfg["spatial_expansions"]
        self.proj_in = nn.Linear(cfg["in_channels"], channels[0])
        self.block_in = MidBlock(channels[0], layers[0], attention[0])
        self.down_blocks = nn.ModuleList(
            [
                DownBlock(channels[i], channels[i + 1], layers[i + 1], st[i], ss[i], attention[i + 1])
                for i in range(len(channels) - 1)
            ]
        )
        self.block_out = MidBlock(channels[-1], layers[-1], attention[-1])
        self.norm_out = FrameGroupNorm(channels[-1])
        self.proj_out = nn.Linear(channels[-1], 2 * cfg["latent_channels"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block_in(linear_over_channels(self.proj_in, fourier_features(x)))
        for block in self.down_blocks:
            x = block(x)
        x = F.silu(self.norm_out(self.block_out(x)))
        return linear_over_channels(self.proj_out, x)


class AutoencoderKLMochi(DiffusersConfigured, StridedTilingMixin, nn.Module):
    """Mochi's video VAE with Diffusers' config keys and weight names."""

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
        self.encoder = Encoder(cfg)
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

    @property
    def video_channels(self) -> int:
        """Channels of the video the encoder takes: `in_channels` counts each with its Fourier features."""
        return self.config["in_channels"] // (1 + 2 * len(FOURIER_OCTAVES))

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Video (B, 3, T, H, W) in [-1, 1] -> posterior over unnormalised latents
        (B, 12, (T - 1) // 6 + 1, H // 8, W // 8), in one piece or, with tiling on, in spatial tiles."""
        if x.ndim != 5 or x.shape[1] != self.video_channels:
            raise ValueError(
                f"expected a video batch (B, {self.video_channels}, T, H, W), got shape {tuple(x.shape)}"
            )
        return DiagonalGaussian.from_moments(per_sample(self._encode_clip, x, self.use_slicing))

    def _encode_clip(self, x: torch.Tensor) -> torch.Tensor:
        """Moments of one clip (or batch); with tiling on and frames larger than a tile, Diffusers'
        `tiled_encode`: pixel tiles encoded alone, one stride of latents kept and the overlap cross-faded."""
        if not self.tiles_needed(x, self.tile_sample_min_height, self.tile_sample_min_width):
            return self.encoder(x)
        ratio = self.spatial_compression_ratio
        moments = self.run_strided_tiles(self.encoder, x, 1, ratio)
        return moments[..., : x.shape[-2] // ratio, : x.shape[-1] // ratio]

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
