"""HiDream-I1's fixed facts and the defaults of Diffusers' `HiDreamImagePipeline.__call__`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class HiDreamPipelineConfig:
    """Model-family constants that are not in the checkpoint's own config files."""

    #: Latent pixels per side of the default size (Diffusers' `default_sample_size`); the square of it
    #: times the VAE's scale factor is also the pixel area every request is rescaled to.
    default_sample_size: int = 128
    #: The CLIP encoders' token cap (Diffusers pads and truncates CLIP to min(max_sequence_length, 218)).
    clip_max_length: int = 218
    #: Text tokens by default (every encoder is padded and truncated to this many).
    default_max_sequence_length: int = 128
    #: The fewest text tokens a request may ask for: the CLIP tokenizers add two special tokens, and asked
    #: for fewer they do not truncate at all (Diffusers' CLIP then reads the whole prompt, and fails past
    #: CLIP's positions), so 1 is refused.
    min_max_sequence_length: int = 2
    #: The schedule shift's line (Diffusers' `calculate_shift` defaults), evaluated at the DiT's `max_seq`.
    shift_base_seq_len: int = 256
    shift_max_seq_len: int = 4096
    shift_base: float = 0.5
    shift_max: float = 1.15


def hidream_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' `HiDreamImagePipeline.__call__` (50 steps, CFG 5.0, 128 text tokens); the size
    defaults to the square of `default_sample_size` latent pixels (1024 x 1024 with an 8x VAE)."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=5.0,
        max_sequence_length=HiDreamPipelineConfig.default_max_sequence_length,
    )


def rescaled_size(height: int, width: int, max_side: int, division: int) -> tuple[int, int]:
    """Diffusers' size rule: (height, width) scaled to the area `max_side`**2 (keeping the aspect ratio) and
    each floored to a multiple of `division` (the VAE's factor times 2). Every HiDream image has about
    that area: the requested size only sets the aspect ratio."""
    scale = math.sqrt(max_side**2 / (width * height))
    return int(height * scale // division * division), int(width * scale // division * division)


def schedule_shift_mu(config: HiDreamPipelineConfig, image_seq_len: int) -> float:
    """Diffusers' `calculate_shift(image_seq_len)` with its default line (not the scheduler's config)."""
    slope = (config.shift_max - config.shift_base) / (config.shift_max_seq_len - config.shift_base_seq_len)
    return image_seq_len * slope + (config.shift_base - slope * config.shift_base_seq_len)
