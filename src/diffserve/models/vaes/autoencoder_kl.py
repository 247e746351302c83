"""Native KL autoencoder: diffusers' `AutoencoderKL` (SD 1.x/2.x, SDXL, SD3, FLUX.1 VAEs).

Config names and defaults match diffusers' `config.json`, and state-dict keys match diffusers', so a
checkpoint loads with `load_state_dict(sd, strict=True)` into a module built on the meta device.

    encode(image in [-1, 1]) -> DiagonalGaussian over latents      decode(latents) -> image in [-1, 1]

The latent scaling (`(z - shift_factor) * scaling_factor`) is *not* applied here: as in diffusers,
the pipeline applies it, reading the factors from `self.config`. Tiling and slicing are not
implemented; callers that need them split the batch themselves. Over several ranks the decode can
be split by rows (`diffserve.distributed.parallel_vae.decode_split`), with the same output.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from diffserve.models.config_keys import checked_config_kwargs
from diffserve.models.vaes.blocks import Decoder, Encoder

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


class AutoencoderKL(nn.Module):
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
            in_channels=in_channels,
            latent_channels=latent_channels,
            down_block_types=down_block_types,
            block_out_channels=block_out_channels,
            layers_per_block=layers_per_block,
            norm_num_groups=norm_num_groups,
            act_fn=act_fn,
            mid_block_add_attention=mid_block_add_attention,
        )
        self.decoder = Decoder(
            latent_channels=latent_channels,
            out_channels=out_channels,
            up_block_types=up_block_types,
            block_out_channels=block_out_channels,
            layers_per_block=layers_per_block,
            norm_num_groups=norm_num_groups,
            act_fn=act_fn,
            mid_block_add_attention=mid_block_add_attention,
        )
        # 1x1 convs on the moments / latents; SD-era VAEs have them, FLUX and SD3 drop them.
        self.quant_conv = nn.Conv2d(2 * latent_channels, 2 * latent_channels, 1) if use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(latent_channels, latent_channels, 1) if use_post_quant_conv else None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AutoencoderKL:
        """Build from a diffusers `config.json` dict; `_`-prefixed metadata keys are ignored.

        Unknown keys are an error rather than silently dropped: they mean the checkpoint expects
        behaviour this class does not implement.
        """
        return cls(**checked_config_kwargs(config, cls.config_keys(), cls.__name__))

    @classmethod
    def config_keys(cls) -> frozenset[str]:
        """The config names the constructor accepts (diffusers' `AutoencoderKL` config)."""
        params = inspect.signature(cls.__init__).parameters.values()
        return frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)

    @property
    def spatial_compression_ratio(self) -> int:
        """Pixels per latent along each side (diffusers pipelines call this `vae_scale_factor`)."""
        return 2 ** (len(self.config["block_out_channels"]) - 1)

    def encode(self, x: torch.Tensor) -> DiagonalGaussian:
        """Image batch (B, in_channels, H, W) in [-1, 1] -> posterior over unscaled latents."""
        moments = self.encoder(x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return DiagonalGaussian.from_moments(moments)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (B, latent_channels, h, w) -> image batch in (roughly) [-1, 1]."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)
