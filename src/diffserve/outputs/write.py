"""`write_outputs`: a finished request's images or videos written to a directory, as `diffserve generate`
and `DiffGenerator.generate(save_output=True)` do."""

from __future__ import annotations

import functools
import logging
import tempfile
import threading
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
    of them (with a warning). An output that cannot be written into `directory` (an OSError) is written
    into `kept_outputs_folder()` instead, with a warning naming both: its path is the one returned."""
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
        soundtrack = (audio[i], int(audio_sample_rate)) if is_video and len(audio) else None
        write = functools.partial(
            _write_one, output, name, params, metadata, soundtrack,
            is_video=is_video, save_frames=save_frames, quality=quality,
        )  # fmt: skip
        try:
            paths.append(write(directory))
        except OSError as exc:
            # The work is done: an output folder that cannot be written (removed, full, read-only since
            # the run began) must not lose it. The caller sees the kept file's path among the returned ones.
            kept = write(kept_outputs_folder())
            logger.warning(
                "Could not write into %s (%s); kept %s instead", directory, exc.strerror or exc, kept
            )
            paths.append(kept)
    return paths


def _write_one(
    output: Image.Image | np.ndarray,
    name: str,
    params: SamplingParams,
    metadata: dict[str, Any],
    soundtrack: tuple[np.ndarray, int] | None,
    folder: Path,
    *,
    is_video: bool,
    save_frames: bool,
    quality: int | None,
) -> Path:
    """One output (a video's frames array, or an image) written into `folder` under `name` (made unique)."""
    path = unique_path(folder, name)
    if is_video:
        save_clip(output, path, params.fps, metadata, params.video_format, soundtrack)
        if save_frames:
            frame_paths = save_frame_pngs(output, path.parent / f"{path.stem}_frames", path.stem)
            logger.info("Frames saved to %s (%d PNGs)", frame_paths[0].parent, len(frame_paths))
    else:
        save_image(output, path, metadata, params.output_format, quality)
    return path


_kept_folder: Path | None = None
_kept_folder_lock = threading.Lock()


def kept_outputs_folder() -> Path:
    """This process's temporary folder (mode 0700) for outputs that could not be written where asked, one for
    all of them so that a run's outputs stay together; created when first needed."""
    global _kept_folder
    with _kept_folder_lock:
        if _kept_folder is None or not _kept_folder.is_dir():
            _kept_folder = Path(tempfile.mkdtemp(prefix="diffserve-outputs-"))
        return _kept_folder
