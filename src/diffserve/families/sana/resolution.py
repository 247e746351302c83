"""SANA's resolution binning (Diffusers' `use_resolution_binning=True`, a request setting in `extra`, on by
default): a request is generated at the aspect-ratio bin nearest its size, then its decoded images are
resized and centre-cropped back to the size it asked for, which may then be any size (the bins are
multiples of 32 pixels). Turned off, a request is generated at its own size.

The bins are PixArt's / SANA's tables of (height, width) around one base resolution, chosen by the DiT's
`sample_size` in latent pixels (16, 32, 64, 128: the 512, 1024, 2048, 4096 px bins). The nearest bin is
the first whose ratio key (height / width, as written in the table) is closest to the request's ratio;
the resize is bilinear (no antialiasing) to cover the requested size, then a centre crop, on the decoded
images in [-1, 1] before they are quantised, as Diffusers' `PixArtImageProcessor` does.

Binning is a pure function of the request (its size and setting), so it keeps its `params.height/width` (the
output size): latent preparation generates at the bin, decoding resizes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from diffserve.configs.sampling_params import SamplingParams
from diffserve.distributed.parallel_vae import decode_split
from diffserve.errors import InvalidRequestError
from diffserve.families.sana.config import sana_settings
from diffserve.request import LatentSize, Req
from diffserve.stages.base import to_module
from diffserve.stages.decoding import DecodeLayout, DecodingStage, tensor_to_pil
from diffserve.stages.latent_preparation import SpatialLatentPreparationStage, initial_noise

#: One bin: (ratio key as Diffusers writes it, height, width), in the tables' order (ties go to the first).
AspectRatioBin = tuple[str, int, int]

#: PixArt-alpha's 512 px bins.
ASPECT_RATIO_512_BIN: tuple[AspectRatioBin, ...] = (
    ("0.25", 256, 1024),
    ("0.28", 256, 928),
    ("0.32", 288, 896),
    ("0.33", 288, 864),
    ("0.35", 288, 832),
    ("0.4", 320, 800),
    ("0.42", 320, 768),
    ("0.48", 352, 736),
    ("0.5", 352, 704),
    ("0.52", 352, 672),
    ("0.57", 384, 672),
    ("0.6", 384, 640),
    ("0.68", 416, 608),
    ("0.72", 416, 576),
    ("0.78", 448, 576),
    ("0.82", 448, 544),
    ("0.88", 480, 544),
    ("0.94", 480, 512),
    ("1.0", 512, 512),
    ("1.07", 512, 480),
    ("1.13", 544, 480),
    ("1.21", 544, 448),
    ("1.29", 576, 448),
    ("1.38", 576, 416),
    ("1.46", 608, 416),
    ("1.67", 640, 384),
    ("1.75", 672, 384),
    ("2.0", 704, 352),
    ("2.09", 736, 352),
    ("2.4", 768, 320),
    ("2.5", 800, 320),
    ("3.0", 864, 288),
    ("4.0", 1024, 256),
)
#: PixArt-alpha's 1024 px bins.
ASPECT_RATIO_1024_BIN: tuple[AspectRatioBin, ...] = (
    ("0.25", 512, 2048),
    ("0.28", 512, 1856),
    ("0.32", 576, 1792),
    ("0.33", 576, 1728),
    ("0.35", 576, 1664),
    ("0.4", 640, 1600),
    ("0.42", 640, 1536),
    ("0.48", 704, 1472),
    ("0.5", 704, 1408),
    ("0.52", 704, 1344),
    ("0.57", 768, 1344),
    ("0.6", 768, 1280),
    ("0.68", 832, 1216),
    ("0.72", 832, 1152),
    ("0.78", 896, 1152),
    ("0.82", 896, 1088),
    ("0.88", 960, 1088),
    ("0.94", 960, 1024),
    ("1.0", 1024, 1024),
    ("1.07", 1024, 960),
    ("1.13", 1088, 960),
    ("1.21", 1088, 896),
    ("1.29", 1152, 896),
    ("1.38", 1152, 832),
    ("1.46", 1216, 832),
    ("1.67", 1280, 768),
    ("1.75", 1344, 768),
    ("2.0", 1408, 704),
    ("2.09", 1472, 704),
    ("2.4", 1536, 640),
    ("2.5", 1600, 640),
    ("3.0", 1728, 576),
    ("4.0", 2048, 512),
)
#: PixArt-Sigma's 2048 px bins.
ASPECT_RATIO_2048_BIN: tuple[AspectRatioBin, ...] = (
    ("0.25", 1024, 4096),
    ("0.26", 1024, 3968),
    ("0.27", 1024, 3840),
    ("0.28", 1024, 3712),
    ("0.32", 1152, 3584),
    ("0.33", 1152, 3456),
    ("0.35", 1152, 3328),
    ("0.4", 1280, 3200),
    ("0.42", 1280, 3072),
    ("0.48", 1408, 2944),
    ("0.5", 1408, 2816),
    ("0.52", 1408, 2688),
    ("0.57", 1536, 2688),
    ("0.6", 1536, 2560),
    ("0.68", 1664, 2432),
    ("0.72", 1664, 2304),
    ("0.78", 1792, 2304),
    ("0.82", 1792, 2176),
    ("0.88", 1920, 2176),
    ("0.94", 1920, 2048),
    ("1.0", 2048, 2048),
    ("1.07", 2048, 1920),
    ("1.13", 2176, 1920),
    ("1.21", 2176, 1792),
    ("1.29", 2304, 1792),
    ("1.38", 2304, 1664),
    ("1.46", 2432, 1664),
    ("1.67", 2560, 1536),
    ("1.75", 2688, 1536),
    ("2.0", 2816, 1408),
    ("2.09", 2944, 1408),
    ("2.4", 3072, 1280),
    ("2.5", 3200, 1280),
    ("2.89", 3328, 1152),
    ("3.0", 3456, 1152),
    ("3.11", 3584, 1152),
    ("3.62", 3712, 1024),
    ("3.75", 3840, 1024),
    ("3.88", 3968, 1024),
    ("4.0", 4096, 1024),
)
#: SANA's 4096 px bins.
ASPECT_RATIO_4096_BIN: tuple[AspectRatioBin, ...] = (
    ("0.25", 2048, 8192),
    ("0.26", 2048, 7936),
    ("0.27", 2048, 7680),
    ("0.28", 2048, 7424),
    ("0.32", 2304, 7168),
    ("0.33", 2304, 6912),
    ("0.35", 2304, 6656),
    ("0.4", 2560, 6400),
    ("0.42", 2560, 6144),
    ("0.48", 2816, 5888),
    ("0.5", 2816, 5632),
    ("0.52", 2816, 5376),
    ("0.57", 3072, 5376),
    ("0.6", 3072, 5120),
    ("0.68", 3328, 4864),
    ("0.72", 3328, 4608),
    ("0.78", 3584, 4608),
    ("0.82", 3584, 4352),
    ("0.88", 3840, 4352),
    ("0.94", 3840, 4096),
    ("1.0", 4096, 4096),
    ("1.07", 4096, 3840),
    ("1.13", 4352, 3840),
    ("1.21", 4352, 3584),
    ("1.29", 4608, 3584),
    ("1.38", 4608, 3328),
    ("1.46", 4864, 3328),
    ("1.67", 5120, 3072),
    ("1.75", 5376, 3072),
    ("2.0", 5632, 2816),
    ("2.09", 5888, 2816),
    ("2.4", 6144, 2560),
    ("2.5", 6400, 2560),
    ("2.89", 6656, 2304),
    ("3.0", 6912, 2304),
    ("3.11", 7168, 2304),
    ("3.62", 7424, 2048),
    ("3.75", 7680, 2048),
    ("3.88", 7936, 2048),
    ("4.0", 8192, 2048),
)

#: The DiT's `sample_size` (latent pixels) -> the bins Diffusers' SanaPipeline snaps its sizes to.
BINS_BY_SAMPLE_SIZE: Mapping[int, tuple[AspectRatioBin, ...]] = {
    128: ASPECT_RATIO_4096_BIN,
    64: ASPECT_RATIO_2048_BIN,
    32: ASPECT_RATIO_1024_BIN,
    16: ASPECT_RATIO_512_BIN,
}


def bins_for_sample_size(sample_size: int) -> tuple[AspectRatioBin, ...]:
    """The bins of a DiT with this `sample_size`; Diffusers has none for other sizes and refuses them."""
    bins = BINS_BY_SAMPLE_SIZE.get(sample_size)
    if bins is None:
        raise ValueError(
            f"resolution binning has no aspect-ratio bins for a transformer sample_size of {sample_size} "
            f"(known: {sorted(BINS_BY_SAMPLE_SIZE)})"
        )
    return bins


def nearest_bin(height: int, width: int, bins: tuple[AspectRatioBin, ...]) -> tuple[int, int]:
    """(height, width) of the bin whose ratio key is nearest height / width (the first of equals)."""
    ratio = float(height / width)
    _, bin_height, bin_width = min(bins, key=lambda entry: abs(float(entry[0]) - ratio))
    return bin_height, bin_width


def resize_and_crop(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(batch, C, h, w) images scaled (bilinear) to cover height x width, then centre-cropped to it."""
    current_height, current_width = images.shape[-2:]
    if (current_height, current_width) == (height, width):
        return images
    scale = max(height / current_height, width / current_width)
    scaled_height, scaled_width = int(current_height * scale), int(current_width * scale)
    images = F.interpolate(images, size=(scaled_height, scaled_width), mode="bilinear", align_corners=False)
    top, left = (scaled_height - height) // 2, (scaled_width - width) // 2
    return images[:, :, top : top + height, left : left + width]


@dataclass(frozen=True)
class ResolutionBinning:
    """Where a request of a given size is generated: with its `use_resolution_binning` setting (on by
    default, `SanaSettings`) the nearest of `bins`, else its own size. `bins` is None for a DiT whose
    `sample_size` has no bins (Diffusers raises "Invalid sample size" for a binned call): such a request is
    refused, naming the setting to turn off; `pipeline_name` names the pipeline in that message."""

    bins: tuple[AspectRatioBin, ...] | None
    sample_size: int
    pipeline_name: str

    def binned(self, params: SamplingParams) -> bool:
        """Whether `params` (a request's) asks for resolution binning."""
        return sana_settings(params).use_resolution_binning

    def generation_size(self, params: SamplingParams) -> tuple[int, int]:
        """(height, width) the request is generated at (InvalidRequestError for a binned request on a DiT
        without bins)."""
        height, width = int(params.height), int(params.width)
        if not self.binned(params):
            return height, width
        if self.bins is None:
            raise InvalidRequestError(
                f"extra['use_resolution_binning'] has no aspect-ratio bins in {self.pipeline_name} for this "
                f"transformer's sample_size ({self.sample_size}; Diffusers refuses it too): set it to false",
                param="extra",
            )
        return nearest_bin(height, width, self.bins)


class SanaLatentPreparationStage(SpatialLatentPreparationStage):
    """Initial noise as a float32 (batch, channels, h, w) latent image at the request's generation size
    (SANA keeps its latents and scheduler in float32 whatever the DiT's dtype, as Diffusers does)."""

    def __init__(
        self, latent_channels: int, vae_scale_factor: int, device: torch.device, binning: ResolutionBinning
    ) -> None:
        super().__init__(latent_channels, vae_scale_factor, device, torch.float32)
        self.binning = binning

    def forward(self, req: Req) -> Req:
        p = req.params
        height, width = self.binning.generation_size(p)
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        noise = initial_noise(req, (p.num_outputs_per_prompt, self.latent_channels, h, w), self.dtype)
        req.latents = noise.to(self.device)
        req.latent_size = LatentSize(h, w)
        return req


class SanaDecodingStage(DecodingStage):
    """DC-AE decoding (latents / scaling_factor, in the VAE's dtype as Diffusers divides them), then,
    with binning, the images resized and cropped back to the requested size before quantisation.

    `sigma_data` (SANA-Sprint): its final latents are TrigFlow samples at that scale, divided by it
    (in float32) before anything else, as Diffusers' SanaSprintPipeline does."""

    def __init__(
        self, vae: torch.nn.Module, binning: ResolutionBinning, sigma_data: float | None = None
    ) -> None:
        super().__init__(vae, packed_latents=False)
        self.binning = binning
        self.sigma_data = sigma_data

    def decode_layout(self) -> DecodeLayout:
        layout = super().decode_layout()
        if self.sigma_data is None:
            return layout
        return replace(layout, scaling_factor=layout.scaling_factor * self.sigma_data)

    @torch.inference_mode()
    def forward(self, req: Req) -> Req:
        latents = req.latents if self.sigma_data is None else req.latents / self.sigma_data
        latents = to_module(self.vae, latents) / self.scaling_factor
        images = decode_split(self.vae, latents)
        if self.binning.binned(req.params):
            images = resize_and_crop(images, req.params.height, req.params.width)
        req.outputs.images = tensor_to_pil(images)
        return req
