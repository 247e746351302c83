"""CogVideoX family (text-to-video, image-to-video): its fixed facts, sampling defaults and the settings a
request may set in `SamplingParams.extra`, with the defaults of Diffusers' `__call__`.

Diffusers' defaults depend on the checkpoint: the size is the DiT's sample size times the VAE's spatial
compression (480 x 720 for CogVideoX 1.0), the text-to-video frame count the DiT's `sample_frames` (49 for
1.0, 81 for 1.5), the image-to-video one 49.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from diffserve.configs.option import option, settings_from
from diffserve.configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class CogVideoXPipelineConfig:
    """Model-family constants that are not in the checkpoint's own config files."""

    #: Diffusers' CogVideoX pipelines pad and truncate T5's tokens to this many by default.
    default_max_sequence_length: int = 226
    #: Diffusers' image-to-video `num_frames` default.
    image_to_video_frames: int = 49
    #: The released models' frame rates: CogVideoX 1.0 makes 8 fps, 1.5 (temporal patches) 16 fps.
    fps_v10: int = 8
    fps_v15: int = 16
    #: What Diffusers' image-to-video pipeline passes as the 1.5 I2V DiT's `ofs` (its ofs embedding).
    ofs: float = 2.0


@dataclass(frozen=True)
class CogVideoXSettings:
    """One request's CogVideoX settings beyond SamplingParams (Diffusers' `__call__` arguments, its
    defaults), set in `SamplingParams.extra` and checked by `cogvideox_settings`."""

    use_dynamic_cfg: bool = option(
        False,
        help="raise the CFG scale along the schedule: 1 + guidance_scale * (1 - cos(pi * ((n - t) / n)^5)) / 2 "
        "at timestep t of n steps (CogVideoX's cosine schedule)",
    )


#: The keys a CogVideoX request may set in `SamplingParams.extra`.
COGVIDEOX_EXTRA_KEYS: tuple[str, ...] = tuple(f.name for f in fields(CogVideoXSettings))


def cogvideox_settings(params: SamplingParams) -> CogVideoXSettings:
    """The request's settings: Diffusers' defaults overridden by `params.extra` (an unknown key or a bad value
    is an InvalidRequestError naming it)."""
    return settings_from(CogVideoXSettings, params.extra, "extra")


def cogvideox_default_sampling_params(num_frames: int, fps: int) -> SamplingParams:
    """Defaults of Diffusers' CogVideoX pipelines' `__call__` (50 steps, CFG 6, 226 text tokens)."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=6.0,
        max_sequence_length=CogVideoXPipelineConfig.default_max_sequence_length,
        num_frames=num_frames,
        fps=fps,
        video_format="mp4",
    )
