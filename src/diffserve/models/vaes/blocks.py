"""Convolutional building blocks of the KL autoencoder (the SD / SDXL / SD3 / FLUX VAE family).

Module and parameter names follow diffusers (`resnets.0.norm1`, `downsamplers.0.conv`,
`attentions.0.to_out.0`, ...) so a diffusers checkpoint loads with `strict=True` and no renaming.
Only the inference path is kept: no dropout (it is 0.0 in every released VAE), no time embedding,
no gradient checkpointing, no spatial-norm variant.

Activations that follow a norm run in place: the norm's output is a fresh tensor nobody else holds,
so this saves one full-resolution allocation per resnet half without changing a single bit of the
result. Nothing here computes from parameters at build time, so modules build on the meta device.

The 3x3 convolutions, the GroupNorms and the mid-block attention are the row-split-aware layers of
`diffserve.distributed.parallel_vae` (plain `nn.Conv2d` / `nn.GroupNorm` / attention outside a
row-split decode), so the decoder also runs split by rows over several ranks with the same output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffserve.distributed.parallel_vae import HaloConv2d, SplitGroupNorm, gather_tokens
from diffserve.layers.attention import attention
from diffserve.models.vaes.coder_layout import CoderLayout


def _silu_(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def _mish_(x: torch.Tensor) -> torch.Tensor:
    return F.mish(x, inplace=True)


def _relu_(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x, inplace=True)


#: diffusers' get_activation names -> an op that may overwrite its input (see module docstring).
#: Module-level functions rather than lambdas so modules stay picklable.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _silu_,
    "swish": _silu_,
    "mish": _mish_,
    "relu": _relu_,
    "gelu": F.gelu,
}

#: The only block types the KL autoencoder uses in released checkpoints.
SUPPORTED_DOWN_BLOCKS = ("DownEncoderBlock2D",)
SUPPORTED_UP_BLOCKS = ("UpDecoderBlock2D",)

#: Every norm in this VAE uses diffusers' epsilon, not torch's 1e-5 default.
NORM_EPS = 1e-6

#: Layout of every activation inside the encoder and decoder. Channels-last measured ~10-15% faster
#: than NCHW for the decoder on CPU (oneDNN convolutions are NHWC-native), makes the mid-block
#: attention's token view contiguous for free, and is what diffusers itself ends up running after
#: its mid-block attention (its `.reshape` there yields a channels-last view). Convolution weights
#: may stay NCHW: converting them too measured no faster.
ACTIVATION_MEMORY_FORMAT = torch.channels_last


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation diffusers would build for `name`, as an in-place-when-possible function."""
    try:
        return _ACTIVATIONS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown act_fn {name!r}; supported: {sorted(_ACTIVATIONS)}") from None


def _group_norm(channels: int, groups: int) -> nn.GroupNorm:
    return SplitGroupNorm(num_groups=groups, num_channels=channels, eps=NORM_EPS, affine=True)


class ResnetBlock2D(nn.Module):
    """Pre-norm residual block: (GroupNorm, act, conv3x3) twice, plus a 1x1 shortcut when widths differ."""

    def __init__(self, in_channels: int, out_channels: int, groups: int, act_fn: str) -> None:
        super().__init__()
        self.act = get_activation(act_fn)
        self.norm1 = _group_norm(in_channels, groups)
        self.conv1 = HaloConv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = _group_norm(out_channels, groups)
        self.conv2 = HaloConv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.conv_shortcut = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1) if in_channels != out_channels else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.act(self.norm1(x)))
        h = self.conv2(self.act(self.norm2(h)))
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        # conv2's output is ours alone, so the residual sum can reuse its memory.
        return h.add_(shortcut)


class Downsample2D(nn.Module):
    """Stride-2 3x3 conv after padding one row/column on the bottom/right only.

    The asymmetric padding is what the original LDM VAE was trained with; `nn.Conv2d` cannot express
    it, hence the explicit `F.pad`.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample2D(nn.Module):
    """Nearest-neighbour 2x upsampling followed by a 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = HaloConv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class SpatialSelfAttention(nn.Module):
    """Single-head self-attention over all H*W positions, with a residual (diffusers' mid-block `Attention`).

    The head is as wide as the channel count, so q/k/v are (B, H*W, 1, C): the layout
    `diffserve.layers.attention.attention` takes, obtained from the projections without a copy.
    """

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = _group_norm(channels, groups)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        # A list only so the weight is named `to_out.0`, as in diffusers (its `to_out.1` is a no-op dropout).
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, height, width = x.shape
        # GroupNorm over (B, C, H, W) is the same maths as over (B, C, H*W); then view as tokens
        # (contiguous when x is channels-last, a strided view otherwise; never a copy).
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)  # (B, S, C)
        q = self.to_q(tokens).unsqueeze(2)
        # In a row-split decode (distributed/parallel_vae.py) the queries stay local and the keys and
        # values are every rank's; otherwise `gather_tokens` returns its input.
        k = gather_tokens(self.to_k(tokens), width).unsqueeze(2)
        v = gather_tokens(self.to_v(tokens), width).unsqueeze(2)
        out = self.to_out[0](attention(q, k, v).flatten(2))  # (B, S, C)
        # Back to (B, C, H, W) as a view (channels-last strides); the residual add writes the result
        # in x's layout, with no copy before it.
        return x + out.transpose(1, 2).unflatten(2, (height, width))


class MidBlock2D(nn.Module):
    """resnet -> (attention) -> resnet at the lowest resolution (diffusers' `UNetMidBlock2D`, one layer)."""

    def __init__(self, channels: int, groups: int, act_fn: str, add_attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [
                ResnetBlock2D(channels, channels, groups, act_fn),
                ResnetBlock2D(channels, channels, groups, act_fn),
            ]
        )
        # Empty when disabled: the diffusers list then holds `None`, which has no weights either.
        self.attentions = nn.ModuleList([SpatialSelfAttention(channels, groups)] if add_attention else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class ResnetStage(nn.Module):
    """One level of a VAE encoder or decoder: its resnets in order, then an optional resampler.

    The resampler is held as Diffusers names it, `<resamplers_name>.0` (`downsamplers.0` in a down block,
    `upsamplers.0` in an up block), the list None on a level that keeps its size. Extra forward inputs
    (a causal cache, say) go to every layer.
    """

    resamplers_name: ClassVar[str]

    def __init__(self, resnets: Iterable[nn.Module], resampler: nn.Module | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(resnets)
        setattr(self, self.resamplers_name, None if resampler is None else nn.ModuleList([resampler]))

    def forward(self, x: torch.Tensor, *context: Any) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, *context)
        resamplers = getattr(self, self.resamplers_name)
        return x if resamplers is None else resamplers[0](x, *context)


def resnet_chain(
    resnet: Callable[[int, int], nn.Module], in_channels: int, out_channels: int, count: int
) -> list[nn.Module]:
    """`count` resnets `resnet(in, out)` from `in_channels` to `out_channels`: the first changes the width."""
    return [resnet(in_channels if i == 0 else out_channels, out_channels) for i in range(count)]


class DownEncoderBlock2D(ResnetStage):
    """`ResnetBlock2D`s, then an optional stride-2 `Downsample2D`."""

    resamplers_name = "downsamplers"


class UpDecoderBlock2D(ResnetStage):
    """`ResnetBlock2D`s, then an optional 2x `Upsample2D`."""

    resamplers_name = "upsamplers"


def _check_block_types(kind: str, types: Sequence[str], supported: tuple[str, ...], n: int) -> None:
    unsupported = sorted({t for t in types if t not in supported})
    if unsupported:
        raise ValueError(
            f"{kind} {unsupported} not supported by the native KL autoencoder; supported: {supported}"
        )
    if len(types) != n:
        raise ValueError(f"{kind} has {len(types)} entries but block_out_channels has {n}; they must match")


@dataclass(frozen=True)
class KLCoderLayout(CoderLayout):
    """An `AutoencoderKL` half's layout (`block_out_channels` in the encoder's order for both halves; the
    encoder's `out_channels` is its moments, twice the latent width), the half's Diffusers block types
    (`down_block_types` / `up_block_types`), its GroupNorm groups, the resnets' activation and whether the
    mid block attends."""

    block_types: Sequence[str]
    norm_num_groups: int
    act_fn: str
    mid_block_add_attention: bool


class Encoder(nn.Module):
    """Image (B, in_channels, H, W) -> moments (B, 2 * latent_channels, H / f, W / f), f = 2 ** (levels - 1).

    The moments are the Gaussian's mean and log-variance stacked on the channel axis, returned in
    `ACTIVATION_MEMORY_FORMAT`; call `.contiguous()` where NCHW-contiguous memory matters.
    """

    def __init__(self, layout: KLCoderLayout) -> None:
        super().__init__()
        block_out_channels, groups = layout.block_out_channels, layout.norm_num_groups
        _check_block_types(
            "down_block_types", layout.block_types, SUPPORTED_DOWN_BLOCKS, len(block_out_channels)
        )
        widths = list(block_out_channels)
        self.conv_in = HaloConv2d(layout.in_channels, widths[0], kernel_size=3, padding=1)
        resnet = partial(ResnetBlock2D, groups=groups, act_fn=layout.act_fn)
        self.down_blocks = nn.ModuleList(
            DownEncoderBlock2D(
                resnet_chain(resnet, widths[max(i - 1, 0)], width, layout.layers_per_block),
                Downsample2D(width) if i < len(widths) - 1 else None,
            )
            for i, width in enumerate(widths)
        )
        self.mid_block = MidBlock2D(widths[-1], groups, layout.act_fn, layout.mid_block_add_attention)
        self.conv_norm_out = _group_norm(widths[-1], groups)
        self.conv_out = HaloConv2d(widths[-1], layout.out_channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x.contiguous(memory_format=ACTIVATION_MEMORY_FORMAT))
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        # The output activation is SiLU whatever act_fn says, as in diffusers.
        return self.conv_out(_silu_(self.conv_norm_out(x)))


class Decoder(nn.Module):
    """Latents (B, latent_channels, h, w) -> image (B, out_channels, h * f, w * f).

    Each up block has one more resnet than the matching down block (diffusers' `layers_per_block + 1`).
    The image comes back in `ACTIVATION_MEMORY_FORMAT`, which suits the NHWC permute that image
    writers do; call `.contiguous()` where NCHW-contiguous memory matters.
    """

    def __init__(self, layout: KLCoderLayout) -> None:
        super().__init__()
        block_out_channels, groups = layout.block_out_channels, layout.norm_num_groups
        _check_block_types("up_block_types", layout.block_types, SUPPORTED_UP_BLOCKS, len(block_out_channels))
        widths = list(reversed(block_out_channels))
        self.conv_in = HaloConv2d(layout.in_channels, widths[0], kernel_size=3, padding=1)
        self.mid_block = MidBlock2D(widths[0], groups, layout.act_fn, layout.mid_block_add_attention)
        resnet = partial(ResnetBlock2D, groups=groups, act_fn=layout.act_fn)
        self.up_blocks = nn.ModuleList(
            UpDecoderBlock2D(
                resnet_chain(resnet, widths[max(i - 1, 0)], width, layout.layers_per_block + 1),
                Upsample2D(width) if i < len(widths) - 1 else None,
            )
            for i, width in enumerate(widths)
        )
        self.conv_norm_out = _group_norm(widths[-1], groups)
        self.conv_out = HaloConv2d(widths[-1], layout.out_channels, kernel_size=3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(z.contiguous(memory_format=ACTIVATION_MEMORY_FORMAT))
        x = self.mid_block(x)
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(_silu_(self.conv_norm_out(x)))
