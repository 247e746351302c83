"""Wan 2.1 / 2.2 family (text-to-video, image-to-video): constants and sampling defaults (Diffusers semantics)."""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class WanPipelineConfig:
    #: Diffusers' WanPipeline defaults to 480x832 (height x width).
    default_height: int = 480
    default_width: int = 832
    #: UMT5 states are zero-padded to this many tokens; the DiT cross-attends to all of them.
    max_sequence_length_limit: int = 512
    #: Image-to-video: when height/width are unset, the output keeps the input image's aspect ratio
    #: at about this many pixels (Diffusers' documented recipe: 480 * 832).
    image_to_video_area: int = 480 * 832
    #: Wan 2.2 TI2V-5B's native frame rate (its folders' default fps; Wan 2.1 and 2.2 A14B make 16 fps).
    ti2v_fps: int = 24


def wan_default_sampling_params() -> SamplingParams:
    """Defaults of Diffusers' WanPipeline.__call__; 16 fps is Wan 2.1's native frame rate."""
    return SamplingParams(
        num_inference_steps=50,
        guidance_scale=5.0,
        max_sequence_length=512,
        num_frames=81,
        fps=16,
        video_format="mp4",
    )
