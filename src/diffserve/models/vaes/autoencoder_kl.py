"""Native KL autoencoder: diffusers' `AutoencoderKL` (SD 1.x/2.x, SDXL, SD3, FLUX.1 VAEs).

Config names and defaults match diffusers' `config.json`, and state-dict keys match diffusers', so a
checkpoint loads with `load_state_dict(sd, strict=True)` into a module built on the meta device.

    encode(image in [-1, 1]) -> DiagonalGaussian over latents      decode(latents) -> image in [-1, 1]

The latent scaling (`(z - shift_factor) * scaling_factor`) is *not* applied here: as in diffusers,
the pipeline applies it, reading the factors from `self.config`. Over several ranks the decode can
be split by rows (`diffserve.distributed.parallel_vae.decode_split`), with the same output.

Tiling and slicing are Diffusers' (`tiling.py`): tiles of `tile_sample_min_size` pixels (the config's
`sample_size`; its first entry when it is a pair) / `tile_latent_min_size` latents, overlapping by
`tile_overlap_factor` (0.25), cross-faded; `enable_tiling()` takes those three as optional keywords (Diffusers'
takes none: there one sets the attributes). `enable_slicing()` encodes / decodes one image at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from diffserve.models.config_keys import DiffusersConfigured
from diffserve.models.vaes.blocks import Decoder, Encoder, KLCoderLayout
from diffserve.models.vaes.tiling import TilingMixin, decode_chunk_boundary, per_sample, run_overlapping_tiles

GeneratorArg = torch.Generator | Sequence[torch.Generator] | None


def _randn(
    shape: tuple[int, ...], generator: GeneratorArg, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Standard-normal noise with the same draws as `diffusers.utils.torch_utils.randn_tensor`.

    Seeded outputs must match diffusers, so the rules are the same: noise is drawn on the
    generator's device (a CPU generator gives the same numbers on any target device) and then moved;
    a list of generators seeds each batch item separately, one (1, ...) draw per generator.
    """
    generators = list(generator) if isinstance(generator, Sequence) else [generator]
    if len(generators) != 1 and len(generators) != shape[0]:
        raise ValueError(f"got {len(generators)} generators for a batch of {shape[0]}")
    first = generators[0]
    rand_device = device
    if first is not None and first.device.type != device.type:
        if first.device.type != "cpu":
            raise ValueError(f"cannot draw {device.type} noise from a {first.device.type} generator")
        rand_device = torch.device("cpu")
    if len(generators) == 1:
        return torch.randn(shape, generator=first, device=rand_device, dtype=dtype).to(device)
    per_item = (1, *shape[1:])
    draws = [torch.randn(per_item, generator=g, device=rand_device, dtype=dtype) for g in generators]
    return torch.cat(draws).to(device)


@dataclass(eq=False)
class DiagonalGaussian:
    """The encoder's posterior q(z | x): an axis-aligned Gaussian per latent element.

    Built from the encoder's moments with `from_moments`; `mean` is a view into them (no copy).
    """

    mean: torch.Tensor
    logvar: torch.Tensor

    @classmethod
    def from_moments(cls, moments: torch.Tensor) -> DiagonalGaussian:
        mean, logvar = moments.chunk(2, dim=1)
        # The clamp keeps exp() finite for untrained or degenerate channels (same bounds as diffusers).
        return cls(mean=mean, logvar=logvar.clamp(-30.0, 20.0))

    @cached_property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def sample(self, generator: GeneratorArg = None) -> torch.Tensor:
        """mean + std * eps, eps drawn exactly as diffusers' `DiagonalGaussianDistribution.sample`."""
        noise = _randn(tuple(self.mean.shape), generator, self.mean.device, self.mean.dtype)
        return self.mean + self.std * noise

    def mode(self) -> torch.Tensor:
        return self.mean


def kl_decoder(config: Mapping[str, Any], block_out_channels: Sequence[int]) -> Decoder:
    """The decoder of a KL autoencoder with `config` (`AutoencoderKL`'s keys) at widths `block_out_channels`:
    the config's own, or FLUX.2's `decoder_block_out_channels` where they differ from the encoder's."""
    return Decoder(
        KLCoderLayout(
            in_channels=config["latent_channels"],
            out_channels=config["out_channels"],
            block_out_channels=block_out_channels,
            layers_per_block=config["layers_per_block"],
            block_types=config["up_block_types"],
            norm_num_groups=config["norm_num_groups"],
            act_fn=config["act_fn"],
            mid_block_add_attention=config["mid_block_add_attention"],
        )
    )


class AutoencoderKL(DiffusersConfigured, TilingMixin, nn.Module):
    """KL-regularised convolutional autoencoder with diffusers' config and weight names."""

    diffusers_class_name = "AutoencoderKL"
    #: Its decoder's layers take part in a row-split decode (`distributed/parallel_vae.py`).
    decodes_row_split: ClassVar[bool] = True

    def __init__(
        self,
        *,
        in_channels: int = 3,
        out_channels: int = 3,
        down_block_types: Sequence[str] = ("DownEncoderBlock2D",),
        up_block_types: Sequence[str] = ("UpDecoderBlock2D",),
        block_out_channels: Sequence[int] = (64,),
        layers_per_block: int = 1,
        act_fn: str = "silu",
        latent_channels: int = 4,
        norm_num_groups: int = 32,
        sample_size: int | Sequence[int] = 32,
        scaling_factor: float = 0.18215,
        shift_factor: float | None = None,
        latents_mean: Sequence[float] | None = None,
        latents_std: Sequence[float] | None = None,
        force_upcast: bool = True,
        use_quant_conv: bool = True,
        use_post_quant_conv: bool = True,
        mid_block_add_attention: bool = True,
    ) -> None:
        super().__init__()
        # JSON gives lists; tuples make the config hashable-ish and comparable with diffusers' defaults.
        self.config: dict[str, Any] = {
            "in_channels": in_channels,
            "out_channels": out_channels,
            "down_block_types": tuple(down_block_types),
            "up_block_types": tuple(up_block_types),
            "block_out_channels": tuple(block_out_channels),
            "layers_per_block": layers_per_block,
            "act_fn": act_fn,
            "latent_channels": latent_channels,
            "norm_num_groups": norm_num_groups,
            "sample_size": tuple(sample_size) if isinstance(sample_size, Sequence) else sample_size,
            "scaling_factor": scaling_factor,
            "shift_factor": shift_factor,
            "latents_mean": None if latents_mean is None else tuple(latents_mean),
            "latents_std": None if latents_std is None else tuple(latents_std),
            "force_upcast": force_upcast,
            "use_quant_conv": use_quant_conv,
            "use_post_quant_conv": use_post_quant_conv,
            "mid_block_add_attention": mid_block_add_attention,
        }
        self.encoder = Encoder(
            KLCoderLayout(
                in_channels=in_channels,
                out_channels=2 * latent_channels,
                block_out_channels=block_out_channels,
                layers_per_block=layers_per_block,
                block_types=down_block_types,
                norm_num_groups=norm_num_groups,
                act_fn=act_fn,
                mid_block_add_attention=mid_block_add_attention,
            )
        )
        self.decoder = kl_decoder(self.config, block_out_channels)
        # 1x1 convs on the moments / latents; SD-era VAEs have them, FLUX and SD3 drop them.
        self.quant_conv = nn.Conv2d(2 * latent_channels, 2 * latent_channels, 1) if use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(latent_channels, latent_channels, 1) if use_post_quant_conv else None
        # Diffusers' tile defaults (used once `enable_tiling()` sets `use_tiling`).
        first_side = sample_size[0] if isinstance(sample_size, Sequence) else sample_size
        self.tile_sample_min_size = int(first_side)
        self.tile_latent_min_size = int(first_side / 2 ** (len(block_out_channels) - 1))
        self.tile_overlap_factor = 0.25

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side (diffusers pipelines call this `vae_scale_factor`)."""
        return 2 ** (len(self.config["block_out_channels"]) - 1)

    def enable_tiling(
        self,
        tile_sample_min_size: int | None = None,
        tile_latent_min_size: int | None = None,
        tile_overlap_factor: float | None = None,
    ) -> None:
        """Encode / decode images larger than a tile in overlapping tiles (Diffusers' attributes; None keeps
        the current value; a new `tile_sample_min_size` alone sets the latent size to match it)."""
        self.use_tiling = True
        if tile_sample_min_size is not None:
            self.tile_sample_min_size = tile_sample_min_size
            if tile_latent_min_size is None:
                tile_latent_min_size = int(tile_sample_min_size / self.spatial_compression_ratio)
        self.tile_latent_min_size = tile_latent_min_size or self.tile_latent_min_size
        self.tile_overlap_factor = tile_overlap_factor or self.tile_overlap_factor

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Image batch (B, in_channels, H, W) in [-1, 1] -> posterior over unscaled latents."""
        return DiagonalGaussian.from_moments(per_sample(self._encode_moments, x, self.use_slicing))

    def _encode_moments(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles_needed(x, self.tile_sample_min_size, self.tile_sample_min_size):
            return self._tiled_encode(x)
        return self._encode_tile(x)

    def _encode_tile(self, x: torch.Tensor) -> torch.Tensor:
        moments = self.encoder(x)
        return moments if self.quant_conv is None else self.quant_conv(moments)

    def _tiled_encode(self, x: torch.Tensor) -> torch.Tensor:
        """Moments from overlapping pixel tiles blended in latents (Diffusers' `_tiled_encode`)."""
        sample, latent = self.tile_sample_min_size, self.tile_latent_min_size
        return run_overlapping_tiles(
            self._encode_tile, x, (sample, sample), (latent, latent), self.tile_overlap_factor
        )

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (B, latent_channels, h, w) -> image batch in (roughly) [-1, 1]."""
        return per_sample(self._decode_images, z, self.use_slicing)

    def _decode_images(self, z: torch.Tensor) -> torch.Tensor:
        if self.tiles_needed(z, self.tile_latent_min_size, self.tile_latent_min_size):
            return self._tiled_decode(z)
        return self._decode_tile(z)

    def _decode_tile(self, z: torch.Tensor) -> torch.Tensor:
        decode_chunk_boundary()  # a tile (or the whole image) is one decode chunk
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def _tiled_decode(self, z: torch.Tensor) -> torch.Tensor:
        """Overlapping latent tiles decoded and cross-faded (Diffusers' `tiled_decode`)."""
        sample, latent = self.tile_sample_min_size, self.tile_latent_min_size
        return run_overlapping_tiles(
            self._decode_tile, z, (latent, latent), (sample, sample), self.tile_overlap_factor
        )
