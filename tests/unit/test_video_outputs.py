"""`diffserve.outputs.video`: MP4/GIF/WebP round trips, exact frame rates, metadata, odd sizes, atomic writes.

Every clip is decoded back (PyAV for MP4, Pillow for GIF/WebP) and compared with what was written: the
colours and orientation must survive (a red box top-left decodes red, top-left; a blue one stays blue),
which catches RGB/BGR swaps, transposes and colour-matrix mismatches that a frame count would miss.
"""

from __future__ import annotations

import json
import logging
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageSequence

import diffserve.outputs.files as output_files
import diffserve.outputs.video as video_outputs
from diffserve.configs.sampling_params import SamplingParams
from diffserve.outputs import VIDEO_FORMATS, save_frames, save_video

av = pytest.importorskip("av")

METADATA = {"prompt": "a red box sliding over a gradient — é", "seed": 7, "steps": 30, "model": "wan"}

# ------------------------------------------------------------------------------------------------ helpers


def _clip(num_frames: int, height: int, width: int) -> np.ndarray:
    """A smooth moving gradient with a red box sliding right (top-left) and a fixed blue box (bottom-right).

    Smooth content so that H.264 at the default CRF stays well above 30 dB; the boxes are large enough
    (12 px) that their centres are untouched by chroma subsampling and ringing.
    """
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        frames[t, ..., 0] = 40 + 120 * xx / width
        frames[t, ..., 1] = 40 + 120 * yy / height
        frames[t, ..., 2] = 60 + 100 * t / max(num_frames - 1, 1)
        x0 = 2 + t
        frames[t, 2:14, x0 : x0 + 12] = (230, 20, 20)
        frames[t, height - 14 : height - 2, width - 14 : width - 2] = (20, 20, 230)
    return frames


def _smooth(frames: np.ndarray, margin: int = 4) -> np.ndarray:
    """The gradient pixels of a `_clip`, `margin` px away from the boxes.

    yuv420p (H.264 and lossy WebP alike) stores colour at half resolution, so a saturated red/blue edge
    bleeds into its neighbours whatever the bitrate; the smooth area measures the codec and the colour
    conversion, the boxes are checked separately by their centres.
    """
    num_frames, height, width, _ = frames.shape
    keep = np.ones((num_frames, height, width), dtype=bool)
    for t in range(num_frames):
        keep[t, : 14 + margin, max(2 + t - margin, 0) : 2 + t + 12 + margin] = False
        keep[t, height - 14 - margin : height - 2 + margin, width - 14 - margin : width - 2 + margin] = False
    return frames[keep]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _assert_boxes(decoded: np.ndarray, height: int, width: int) -> None:
    """Red box centre red and blue box centre blue in every frame: no channel swap, no transpose."""
    for t, frame in enumerate(decoded):
        red = frame[8, 2 + t + 6].astype(int)
        blue = frame[height - 8, width - 8].astype(int)
        assert red[0] > 180 and red[1] < 70 and red[2] < 70, (t, red)
        assert blue[2] > 180 and blue[0] < 70 and blue[1] < 70, (t, blue)


def _decode_mp4(path: Path) -> tuple[dict, dict, np.ndarray]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        info = {
            "codec": stream.codec_context.name,
            "pix_fmt": stream.codec_context.pix_fmt,
            "width": stream.codec_context.width,
            "height": stream.codec_context.height,
            "average_rate": stream.average_rate,
            "frames": stream.frames,
            "duration_s": float(stream.duration * stream.time_base),
            "colorspace": stream.codec_context.colorspace,
            "color_range": stream.codec_context.color_range,
        }
        metadata = dict(container.metadata)
        decoded = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
    return info, metadata, decoded


def _all_files(directory: Path) -> list[str]:
    """Every entry in `directory`, hidden `.partial` files included."""
    return sorted(p.name for p in directory.iterdir())


def _decode_animation(path: Path) -> tuple[Image.Image, list[int], np.ndarray]:
    durations, frames = [], []
    with Image.open(path) as image:
        info = dict(image.info)
        for frame in ImageSequence.Iterator(image):
            frame.load()  # WebP fills in `duration` only once the frame is decoded
            durations.append(frame.info["duration"])
            frames.append(np.asarray(frame.convert("RGB")))
        exif = image.getexif()
    return {"info": info, "exif": exif}, durations, np.stack(frames)


# ------------------------------------------------------------------------------------------------ MP4


@pytest.mark.parametrize(("num_frames", "height", "width", "fps"), [(9, 48, 64, 16), (17, 32, 80, 24)])
def test_mp4_round_trip(tmp_path: Path, num_frames: int, height: int, width: int, fps: int) -> None:
    clip = _clip(num_frames, height, width)
    path = tmp_path / "clip.mp4"
    assert save_video(clip, path, fps=fps, metadata=METADATA) == path

    info, metadata, decoded = _decode_mp4(path)
    assert info["codec"] == "h264"
    assert info["pix_fmt"] == "yuv420p"
    assert (info["width"], info["height"]) == (width, height)
    assert info["average_rate"] == Fraction(fps)
    assert info["frames"] == num_frames
    assert info["duration_s"] == pytest.approx(num_frames / fps, abs=1e-3)
    assert json.loads(metadata["comment"]) == {**METADATA, "video_format": "mp4"}
    # Tagged BT.709 / limited range, matching the matrix the writer converted with.
    assert info["colorspace"] == 1 and info["color_range"] == 1

    assert decoded.shape == clip.shape
    psnr, psnr_smooth = _psnr(decoded, clip), _psnr(_smooth(decoded), _smooth(clip))
    print(
        f"mp4 {num_frames}x{height}x{width}@{fps}: PSNR {psnr:.1f} dB, away from box edges {psnr_smooth:.1f} dB"
    )
    assert psnr_smooth > 35
    assert psnr > 27
    _assert_boxes(decoded, height, width)
    assert _all_files(tmp_path) == ["clip.mp4"]  # the partial file was renamed, not copied


@pytest.mark.parametrize("output_format", VIDEO_FORMATS)
def test_a_video_records_its_own_format_never_the_image_default(tmp_path: Path, output_format: str) -> None:
    """A video request's params carry output_format="png" (the image default); the file must not claim it."""
    params = SamplingParams(prompt="a fox", num_frames=3, fps=8, video_format=output_format)
    metadata = output_files.output_metadata("/models/wan", "WanPipeline", params)
    assert metadata["output_format"] == "png"  # what the writer is handed
    path = save_video(_clip(3, 16, 16), tmp_path / f"clip.{output_format}", 8, metadata, output_format)
    if output_format == "mp4":
        text = _decode_mp4(path)[1]["comment"]
    else:
        info = _decode_animation(path)[0]
        text = info["info"]["comment"] if output_format == "gif" else info["exif"][0x010E]
    embedded = json.loads(text)
    assert "output_format" not in embedded and '"png"' not in str(text)
    assert embedded["video_format"] == output_format and embedded["prompt"] == "a fox"


def test_mp4_quality_is_crf(tmp_path: Path) -> None:
    clip = _clip(9, 48, 64)
    fine = save_video(clip, tmp_path / "fine.mp4", fps=16, metadata={}, quality=5)
    coarse = save_video(clip, tmp_path / "coarse.mp4", fps=16, metadata={}, quality=45)
    assert fine.stat().st_size > coarse.stat().st_size
    assert _psnr(_decode_mp4(fine)[2], clip) > _psnr(_decode_mp4(coarse)[2], clip)


def test_mp4_odd_size_is_padded_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clip = _clip(9, 47, 63)
    with caplog.at_level(logging.WARNING, logger="diffserve.outputs"):
        save_video(clip, tmp_path / "odd.mp4", fps=16, metadata=METADATA)
    assert any("63x47" in r.getMessage() and "64x48" in r.getMessage() for r in caplog.records)

    info, _, decoded = _decode_mp4(tmp_path / "odd.mp4")
    assert (info["width"], info["height"]) == (64, 48)
    # The original picture sits unshifted at the top-left.
    assert _psnr(_smooth(decoded[:, :47, :63]), _smooth(clip)) > 35
    # The padding repeats the edge, so it is as close to the last row/column as the codec allows.
    assert np.abs(decoded[:, 47].astype(int) - decoded[:, 46].astype(int)).mean() < 4
    assert np.abs(decoded[:, :, 63].astype(int) - decoded[:, :, 62].astype(int)).mean() < 4
    _assert_boxes(decoded[:, :47, :63], 47, 63)


def test_even_size_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="diffserve.outputs"):
        save_video(_clip(3, 16, 16), tmp_path / "even.mp4", fps=24, metadata={})
    assert not caplog.records


# ------------------------------------------------------------------------------------------------ atomic writes


@pytest.mark.parametrize(
    ("frames", "kwargs", "error"),
    [
        (_clip(3, 16, 16), {"output_format": "avi"}, ValueError),
        (_clip(3, 16, 16).astype(np.float32), {}, ValueError),
        (_clip(3, 16, 16)[0], {}, ValueError),  # a single image, not a clip
        (_clip(3, 16, 16)[..., :2], {}, ValueError),
        (np.zeros((0, 16, 16, 3), np.uint8), {}, ValueError),
        (_clip(3, 16, 16).tolist(), {}, TypeError),
        (_clip(3, 16, 16), {"fps": 0}, ValueError),
        (_clip(3, 16, 16), {"fps": 12.5}, ValueError),
        (_clip(3, 16, 16), {"quality": 52}, ValueError),
        (_clip(3, 16, 16), {"output_format": "webp", "quality": 101}, ValueError),
    ],
)
def test_bad_arguments_leave_no_file(tmp_path: Path, frames, kwargs: dict, error: type) -> None:
    kwargs = {"fps": 16, "metadata": {}, **kwargs}
    with pytest.raises(error):
        save_video(frames, tmp_path / "out.mp4", **kwargs)
    assert _all_files(tmp_path) == []


def test_failure_mid_encode_removes_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_frames = video_outputs._yuv_frames
    partial = tmp_path / ".clip.mp4.partial"
    partial_size = []

    def failing_frames(frames):
        for index, frame in enumerate(real_frames(frames)):
            # x264 holds ~40 frames of lookahead before the first packet, so fail well after that.
            if index == 55:
                partial_size.append(partial.stat().st_size if partial.exists() else None)
                raise RuntimeError("encoder blew up")
            yield frame

    monkeypatch.setattr(video_outputs, "_yuv_frames", failing_frames)
    with pytest.raises(RuntimeError, match="encoder blew up"):
        save_video(_clip(60, 16, 16), tmp_path / "clip.mp4", fps=16, metadata={})
    # The muxer had been writing the hidden partial (never the final name) when the failure hit.
    assert partial_size and partial_size[0] is not None and partial_size[0] > 0, partial_size
    assert _all_files(tmp_path) == []


@pytest.mark.parametrize("output_format", VIDEO_FORMATS)
def test_failed_rename_removes_partial_and_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output_format: str
) -> None:
    final = tmp_path / f"clip.{output_format}"
    final.write_bytes(b"previous")

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(output_files.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        save_video(_clip(3, 16, 16), final, fps=16, metadata={}, output_format=output_format)
    assert _all_files(tmp_path) == [final.name]
    assert final.read_bytes() == b"previous"


def test_creates_missing_directory(tmp_path: Path) -> None:
    path = save_video(_clip(3, 16, 16), tmp_path / "a" / "b" / "clip.gif", 16, {}, output_format="gif")
    assert path.is_file()


# ------------------------------------------------------------------------------------------------ GIF / WebP


@pytest.mark.parametrize("fps", [16, 24])
@pytest.mark.parametrize("output_format", ["gif", "webp"])
def test_animation_round_trip(tmp_path: Path, output_format: str, fps: int) -> None:
    clip = _clip(17, 32, 48)
    path = save_video(
        clip, tmp_path / f"clip.{output_format}", fps=fps, metadata=METADATA, output_format=output_format
    )
    decoded_info, durations, decoded = _decode_animation(path)

    assert decoded.shape == clip.shape
    assert decoded_info["info"]["loop"] == 0  # loop forever
    unit = 10 if output_format == "gif" else 1
    # Every frame within one storage unit of 1000/fps ms, and the total exact to within one unit.
    assert all(abs(d - 1000 / fps) < unit for d in durations), durations
    assert abs(sum(durations) - len(clip) * 1000 / fps) <= unit / 2, sum(durations)

    expected = {**METADATA, "video_format": output_format}
    if output_format == "gif":
        assert json.loads(decoded_info["info"]["comment"]) == expected
    else:
        assert json.loads(decoded_info["exif"][0x010E]) == expected

    psnr, psnr_smooth = _psnr(decoded, clip), _psnr(_smooth(decoded), _smooth(clip))
    print(f"{output_format}@{fps}: PSNR {psnr:.1f} dB, away from box edges {psnr_smooth:.1f} dB")
    assert psnr_smooth > 35
    assert psnr > 25
    _assert_boxes(decoded, 32, 48)
    assert _all_files(tmp_path) == [path.name]


def test_webp_quality_changes_size(tmp_path: Path) -> None:
    clip = _clip(5, 32, 48)
    low = save_video(clip, tmp_path / "low.webp", 16, {}, output_format="webp", quality=10)
    high = save_video(clip, tmp_path / "high.webp", 16, {}, output_format="webp", quality=95)
    assert high.stat().st_size > low.stat().st_size


def test_gif_ignores_quality(tmp_path: Path) -> None:
    path = save_video(_clip(3, 16, 16), tmp_path / "q.gif", 16, {}, output_format="gif", quality=500)
    assert path.is_file()


# ------------------------------------------------------------------------------------------------ PNG frames


def test_save_frames(tmp_path: Path) -> None:
    clip = _clip(12, 16, 24)
    paths = save_frames(clip, tmp_path / "frames", "clip")
    assert [p.name for p in paths] == [f"clip_{i:05d}.png" for i in range(12)]
    assert _all_files(tmp_path / "frames") == [p.name for p in paths]
    for path, frame in zip(paths, clip, strict=True):
        with Image.open(path) as image:
            assert image.mode == "RGB"
            np.testing.assert_array_equal(np.asarray(image), frame)  # PNG is lossless


def test_save_frames_rejects_bad_array(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        save_frames(_clip(2, 8, 8).astype(np.int16), tmp_path, "x")
    assert _all_files(tmp_path) == []
