"""Mochi 1's fixed facts and the defaults of Diffusers' `MochiPipeline.__call__`."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class MochiPipelineConfig:
    """Model-family constants that are not in the checkpoint's own config files."""

    #: Diffusers' default size (its pipeline's `default_height` / `default_width`).
    default_height: int = 480
    default_width: int = 848
    #: T5 tokens by default (padded and truncated to this many; the padding masked).
    default_max_sequence_length: int = 256
    #: The sigma below which the schedule is linear (Diffusers' `threshold_noise` of its linear-quadratic
    #: schedule), over the first half of the steps.
    threshold_noise: float = 0.025
    #: Mochi 1's frame rate (the one its examples export at).
    fps: int = 30


def mochi_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' `MochiPipeline.__call__` (64 steps, CFG 4.5, 19 frames, 256 text tokens)."""
    return SamplingParams(
        num_inference_steps=64,
        guidance_scale=4.5,
        max_sequence_length=MochiPipelineConfig.default_max_sequence_length,
        num_frames=19,
        fps=MochiPipelineConfig.fps,
        video_format="mp4",
    )
