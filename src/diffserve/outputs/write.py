"""`write_outputs`: a finished request's images or videos written to a directory, as `diffserve generate`
and `DiffGenerator.generate(save_output=True)` do."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from diffserve.outputs.audio_track import save_clip
from diffserve.outputs.files import output_file_name, unique_path
from diffserve.outputs.images import bounded_metadata, save_image
from diffserve.outputs.video import save_frames as save_frame_pngs

if TYPE_CHECKING:
    from diffserve.configs.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def write_outputs(
    directory: Path,
    params: SamplingParams,
    request_id: str,
    metadata: dict[str, Any],
    *,
    images: Sequence[Image.Image] = (),
    videos: Sequence[np.ndarray] = (),
    file_name: str | None = None,
    save_frames: bool = False,
    quality: int | None = None,
    audio: Sequence[np.ndarray] = (),
    audio_sample_rate: int | None = None,
) -> list[Path]:
    """Write a request's videos (if it made any) or else its images into `directory`; returns the paths.

    Names: `file_name`'s stem (plus `_{i}` when there are several outputs), else `output_file_name`; an
    existing file is never overwritten (`unique_path`). The extension is `params.video_format` for videos,
    `params.output_format` for images. Every file embeds `metadata` (`output_metadata`, its prompts bounded
    by `bounded_metadata`); `quality` is the JPEG/WebP quality of images. `save_frames` also writes each
    video's frames as PNGs into `{video stem}_frames/` next to it (logged, since only the videos' paths are
    returned). `audio`: one (channels, samples) float waveform per video at `audio_sample_rate` Hz (LTX-2's
    soundtracks), written into MP4s as an AAC track; GIF and WebP cannot carry sound, so it is left out
    of them (with a warning)."""
    outputs: Sequence[Image.Image | np.ndarray] = videos if len(videos) else images
    is_video = bool(len(videos))
    metadata = bounded_metadata(metadata)
    extension = params.video_format if is_video else params.output_format
    paths = []
    for i, output in enumerate(outputs):
        if file_name:
            suffix = f"_{i}" if len(outputs) > 1 else ""
            name = f"{Path(file_name).stem}{suffix}.{extension}"
        else:
            name = output_file_name(params.prompt, request_id, i, extension)
        path = unique_path(directory, name)
        if is_video:
            soundtrack = (audio[i], int(audio_sample_rate)) if len(audio) else None
            save_clip(output, path, params.fps, metadata, params.video_format, soundtrack)
            if save_frames:
                frame_paths = save_frame_pngs(output, path.parent / f"{path.stem}_frames", path.stem)
                logger.info("Frames saved to %s (%d PNGs)", frame_paths[0].parent, len(frame_paths))
        else:
            save_image(output, path, metadata, params.output_format, quality)
        paths.append(path)
    return paths
