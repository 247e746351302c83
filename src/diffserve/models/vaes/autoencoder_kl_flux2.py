"""Native FLUX.2 VAE: Diffusers' `AutoencoderKLFlux2`.

The network is the KL autoencoder of SD / FLUX.1 (`AutoencoderKL`, `blocks.py`) with 32 latent
channels, plus the statistics of a BatchNorm over *patchified* latents (each 2x2 latent patch folded
into the channels, 4 x 32 = 128 channels, which is what the FLUX.2 DiT reads per token). The BatchNorm is
never run as a layer: FLUX.2 pipelines read its running mean and variance to normalise the latents the
DiT sees (`normalize_latents`) and to undo that before decoding (`denormalize_latents`).

    image in [-1, 1] --encode--> DiagonalGaussian over z (B, 32, H/8, W/8)
    z --patchify--> (B, 128, H/16, W/16) --normalize_latents--> what the DiT packs into tokens
    DiT latents --denormalize_latents--> --unpatchify--> z --decode--> image

State-dict keys match Diffusers' (`bn.running_mean`, `bn.running_var`, `bn.num_batches_tracked`
included), so a checkpoint loads with `load_state_dict(sd, assign=True, strict=True)` into a module
built on the meta device. Tiling and slicing are `AutoencoderKL`'s (Diffusers' code for this class is the same).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from diffserve.models.vaes.autoencoder_kl import AutoencoderKL, kl_decoder

#: `AutoencoderKL`'s config keys that FLUX.2's config has not: its latents are normalised by `bn` instead.
_KL_ONLY_KEYS = ("scaling_factor", "shift_factor", "latents_mean", "latents_std")


class LatentBatchNorm(nn.Module):
    """The running statistics of Diffusers' `bn` (`nn.BatchNorm2d(affine=False, track_running_stats=True)`),
    with its buffer names, and the normalisation FLUX.2 pipelines compute from them.

    Diffusers' pipelines never call the BatchNorm itself; they compute `(x - mean) / sqrt(var + eps)`
    with the statistics cast to the latents' device and dtype *after* `sqrt(var + eps)` is taken in
    the buffers' dtype. These methods do the same, so the rounding matches in every dtype.
    """

    def __init__(self, num_features: int, eps: float, momentum: float) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum  # only meaningful for training; kept so the config round-trips
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std), shaped (1, C, 1, 1), on `like`'s device and in its dtype."""
        if like.ndim != 4 or like.shape[1] != self.num_features:
            raise ValueError(
                f"expected patchified latents (batch, {self.num_features}, h, w), got {tuple(like.shape)}"
            )
        mean = self.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(self.running_var.view(1, -1, 1, 1) + self.eps).to(like.device, like.dtype)
        return mean, std

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """`(latents - mean) / sqrt(var + eps)` per channel."""
        mean, std = self._stats(latents)
        return (latents - mean) / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """`latents * sqrt(var + eps) + mean` per channel, the inverse of `normalize`."""
        mean, std = self._stats(latents)
        return latents * std + mean

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


class AutoencoderKLFlux2(AutoencoderKL):
    """FLUX.2's VAE with Diffusers' config keys and weight names.

    `encode(x)` -> `DiagonalGaussian` (`.mode()`, `.sample(generator)` draw as Diffusers does),
    `decode(z)` -> image; both on *unpatchified*, unnormalised latents (B, latent_channels, h, w).
    The pipeline's latent plumbing: `patchify` / `unpatchify` (Diffusers' `Flux2Pipeline._patchify_latents`
    / `_unpatchify_latents`, with `patch_size` from the config) and `normalize_latents` /
    `denormalize_latents` (the `bn` statistics, exactly as `Flux2Pipeline` applies them).

    `force_upcast` is accepted because the released `config.json` carries it (Diffusers ignores it for
    this class); nothing here reads it.
    """

    diffusers_class_name = "AutoencoderKLFlux2"
    decodes_row_split: ClassVar[bool] = True

    def __init__(
        self,
        *,
        in_channels: int = 3,
        out_channels: int = 3,
        down_block_types: Sequence[str] = ("DownEncoderBlock2D",) * 4,
        up_block_types: Sequence[str] = ("UpDecoderBlock2D",) * 4,
        block_out_channels: Sequence[int] = (128, 256, 512, 512),
        decoder_block_out_channels: Sequence[int] | None = None,
        layers_per_block: int = 2,
        act_fn: str = "silu",
        latent_channels: int = 32,
        norm_num_groups: int = 32,
        sample_size: int | Sequence[int] = 1024,
        use_quant_conv: bool = True,
        use_post_quant_conv: bool = True,
        mid_block_add_attention: bool = True,
        batch_norm_eps: float = 1e-4,
        batch_norm_momentum: float = 0.1,
        patch_size: Sequence[int] = (2, 2),
        force_upcast: bool = True,
    ) -> None:
        super().__init__(
            in_channels=in_channels,
            out_channels=out_channels,
            down_block_types=down_block_types,
            up_block_types=up_block_types,
            block_out_channels=block_out_channels,
            layers_per_block=layers_per_block,
            act_fn=act_fn,
            latent_channels=latent_channels,
            norm_num_groups=norm_num_groups,
            sample_size=sample_size,
            use_quant_conv=use_quant_conv,
            use_post_quant_conv=use_post_quant_conv,
            mid_block_add_attention=mid_block_add_attention,
        )
        decoder_widths = tuple(decoder_block_out_channels or block_out_channels)
        if decoder_widths != tuple(block_out_channels):
            # The decoder alone has other widths (Diffusers' `decoder_block_out_channels`).
            self.decoder = kl_decoder(self.config, decoder_widths)
        patch = tuple(int(p) for p in patch_size)
        if len(patch) != 2:
            raise ValueError(f"patch_size must be (height, width), got {patch}")
        self.bn = LatentBatchNorm(math.prod(patch) * latent_channels, batch_norm_eps, batch_norm_momentum)
        self.config: dict[str, Any] = {
            **{key: value for key, value in self.config.items() if key not in _KL_ONLY_KEYS},
            "decoder_block_out_channels": None
            if decoder_block_out_channels is None
            else tuple(decoder_block_out_channels),
            "batch_norm_eps": batch_norm_eps,
            "batch_norm_momentum": batch_norm_momentum,
            "patch_size": patch,
            "force_upcast": force_upcast,
        }

    @property
    def patch_size(self) -> tuple[int, int]:
        """(height, width) of the latent patches folded into channels before the `bn` statistics apply."""
        ph, pw = self.config["patch_size"]
        return ph, pw

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) -> (B, C * ph * pw, h / ph, w / pw), channel-major then patch row, patch column."""
        b, c, h, w = latents.shape
        ph, pw = self.patch_size
        if h % ph or w % pw:
            raise ValueError(f"latent size {h}x{w} is not a multiple of the patch size {ph}x{pw}")
        patches = latents.view(b, c, h // ph, ph, w // pw, pw).permute(0, 1, 3, 5, 2, 4)
        return patches.reshape(b, c * ph * pw, h // ph, w // pw)

    def unpatchify(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of `patchify`: (B, C * ph * pw, h, w) -> (B, C, h * ph, w * pw)."""
        b, cp, h, w = latents.shape
        ph, pw = self.patch_size
        pixels = latents.reshape(b, cp // (ph * pw), ph, pw, h, w).permute(0, 1, 4, 2, 5, 3)
        return pixels.reshape(b, cp // (ph * pw), h * ph, w * pw)

    def normalize_latents(self, patchified: torch.Tensor) -> torch.Tensor:
        """Patchified encoder latents -> the DiT's latent space: `(z - bn.mean) / sqrt(bn.var + eps)`."""
        return self.bn.normalize(patchified)

    def denormalize_latents(self, patchified: torch.Tensor) -> torch.Tensor:
        """The DiT's (patchified) latents -> the decoder's: `z * sqrt(bn.var + eps) + bn.mean`."""
        return self.bn.denormalize(patchified)
