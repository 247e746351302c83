"""MP4 clips with sound: the H.264 video of `outputs/video.py` plus an AAC audio track (LTX-2's output).

The waveform arrives as float samples in [-1, 1] of shape (channels, samples) at its own sample rate
(24 kHz for LTX-2's vocoder, 48 kHz for LTX-2.3's). The track is made exactly as long as the video
(num_frames / fps): a vocoder's few-millisecond shortfall or overshoot is padded with silence or cut,
while a mismatch of more than `MAX_DURATION_MISMATCH_S` is refused as a caller error (wrong sample rate
or fps). AAC is the codec every player reads; only a PyAV build without an AAC encoder falls back to
Opus (resampled to 48 kHz), and says so in the log.

`read_audio_track` decodes the track back with PyAV, for tests and checks.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from diffserve.outputs.files import metadata_json, write_atomically
from diffserve.outputs.video import (
    MP4_DEFAULT_CRF,
    _check_frames,
    _check_quality,
    _write_mp4,
    save_video,
    video_metadata,
)

if TYPE_CHECKING:
    import av

logger = logging.getLogger(__name__)

#: The audio codec, and the one used (with a warning) when PyAV's FFmpeg lacks an AAC encoder.
AUDIO_CODEC = "aac"
FALLBACK_AUDIO_CODEC = "libopus"
#: Sample rates the AAC encoder accepts; Opus always runs at 48 kHz here.
AAC_SAMPLE_RATES: tuple[int, ...] = (
    7350,
    8000,
    11025,
    12000,
    16000,
    22050,
    24000,
    32000,
    44100,
    48000,
    64000,
    88200,
    96000,
)
OPUS_SAMPLE_RATE = 48000
#: Bits per second per audio channel.
AUDIO_BIT_RATE_PER_CHANNEL = 96_000
#: How far the waveform's duration may be from the video's before it is an error rather than a trim/pad.
MAX_DURATION_MISMATCH_S = 0.25

_LAYOUTS = {1: "mono", 2: "stereo"}


def save_clip(
    frames: np.ndarray,
    path: Path,
    fps: int,
    metadata: dict[str, Any],
    video_format: str,
    soundtrack: tuple[np.ndarray, int] | None = None,
) -> Path:
    """`save_video`, with the clip's `soundtrack` ((channels, samples) waveform, sample rate) as an AAC track
    when it has one and the container is MP4; GIF and WebP cannot carry sound, so it is left out of them
    (with a warning)."""
    if soundtrack is None:
        return save_video(frames, path, fps, metadata, video_format)
    if video_format != "mp4":
        logger.warning("%s cannot carry sound: %s is written without it", video_format, path)
        return save_video(frames, path, fps, metadata, video_format)
    waveform, sample_rate = soundtrack
    return save_video_with_audio(frames, path, fps, metadata, waveform, sample_rate)


def save_video_with_audio(
    frames: np.ndarray,
    path: Path,
    fps: int,
    metadata: dict[str, Any],
    waveform: np.ndarray,
    sample_rate: int,
    quality: int | None = None,
) -> Path:
    """Write `frames` (uint8 RGB (frames, height, width, 3)) as H.264 with `waveform` ((channels, samples)
    float in [-1, 1], 1 or 2 channels, at `sample_rate` Hz) as an AAC track, atomically; returns `path`.

    Everything is validated before a file is created. `quality` is the x264 CRF, as in `save_video`.
    """
    _check_frames(frames)
    if isinstance(fps, bool) or not isinstance(fps, (int, np.integer)) or fps <= 0:
        raise ValueError(f"fps must be a positive integer, got {fps!r}")
    _check_quality("mp4", quality)
    codec = pick_audio_codec(_codecs_available())
    _check_sample_rate(sample_rate, codec)
    audio = fit_to_video(waveform, sample_rate, num_frames=len(frames), fps=int(fps))
    record = video_metadata(metadata, "mp4")
    record.update(audio_codec=codec, audio_sample_rate=int(sample_rate), audio_channels=audio.shape[0])
    comment = metadata_json(record)
    track = AudioTrack(audio, int(sample_rate), codec)
    crf = MP4_DEFAULT_CRF if quality is None else int(quality)

    def write(partial: Path) -> None:
        _write_mp4(frames, partial, int(fps), comment, crf, extra_track=track)

    return write_atomically(path, write)


def pick_audio_codec(available: Collection[str]) -> str:
    """AAC when the FFmpeg build has its encoder; else Opus, with a warning; else an error."""
    if AUDIO_CODEC in available:
        return AUDIO_CODEC
    if FALLBACK_AUDIO_CODEC in available:
        logger.warning(
            f"PyAV's FFmpeg has no {AUDIO_CODEC!r} encoder: the MP4's audio track is Opus "
            f"({FALLBACK_AUDIO_CODEC}, {OPUS_SAMPLE_RATE} Hz) instead, which some players cannot play"
        )
        return FALLBACK_AUDIO_CODEC
    raise RuntimeError(
        f"PyAV's FFmpeg has neither an {AUDIO_CODEC!r} nor a {FALLBACK_AUDIO_CODEC!r} encoder; "
        "cannot write a video with sound"
    )


def fit_to_video(waveform: np.ndarray, sample_rate: int, num_frames: int, fps: int) -> np.ndarray:
    """`waveform` as float32 (channels, round(num_frames * sample_rate / fps)), clipped to [-1, 1]:
    zero-padded or cut at the end to last exactly as long as the video."""
    if not isinstance(waveform, np.ndarray):
        raise TypeError(f"waveform must be a numpy array, got {type(waveform).__name__}")
    if waveform.ndim != 2 or waveform.shape[0] not in _LAYOUTS or waveform.shape[1] == 0:
        raise ValueError(
            f"waveform must have shape (channels, samples) with 1 or 2 channels, got {waveform.shape}"
        )
    if not np.issubdtype(waveform.dtype, np.floating):
        raise ValueError(f"waveform must be floating point in [-1, 1], got {waveform.dtype}")
    if not np.isfinite(waveform).all():
        raise ValueError("waveform has NaN or infinite samples")
    target = round(num_frames * sample_rate / fps)
    mismatch_s = abs(waveform.shape[1] - target) / sample_rate
    if mismatch_s > MAX_DURATION_MISMATCH_S:
        raise ValueError(
            f"waveform lasts {waveform.shape[1] / sample_rate:.3f} s at sample_rate {sample_rate} but the video "
            f"lasts {num_frames / fps:.3f} s ({num_frames} frames at {fps} fps); they may differ by at most "
            f"{MAX_DURATION_MISMATCH_S} s"
        )
    audio = np.clip(waveform[:, :target].astype(np.float32), -1.0, 1.0)
    if audio.shape[1] < target:
        audio = np.pad(audio, ((0, 0), (0, target - audio.shape[1])))
    return np.ascontiguousarray(audio)


def _check_sample_rate(sample_rate: int, codec: str) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise ValueError(f"sample_rate must be an integer, got {sample_rate!r}")
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    if codec == AUDIO_CODEC and sample_rate not in AAC_SAMPLE_RATES:
        raise ValueError(
            f"sample_rate {sample_rate} is not one AAC supports; expected one of {AAC_SAMPLE_RATES}"
        )


def _codecs_available() -> Collection[str]:
    import av  # lazily, as in outputs/video.py

    return av.codecs_available


class AudioTrack:
    """The audio stream of one MP4 (`video.ExtraTrack`): added before the video is encoded, muxed after it.

    PyAV's encoder converts the float planar samples to the codec's sample format and rate and cuts them
    into codec-sized frames (1024 samples for AAC); pts count samples at the stream's rate, from 0.
    """

    def __init__(self, waveform: np.ndarray, sample_rate: int, codec: str) -> None:
        self.waveform = waveform
        self.sample_rate = sample_rate
        self.codec = codec
        self.stream_rate = OPUS_SAMPLE_RATE if codec == FALLBACK_AUDIO_CODEC else sample_rate
        self._stream: av.AudioStream | None = None

    def add_stream(self, container: av.container.OutputContainer) -> None:
        stream = container.add_stream(self.codec, rate=self.stream_rate)
        stream.layout = _LAYOUTS[self.waveform.shape[0]]
        stream.bit_rate = AUDIO_BIT_RATE_PER_CHANNEL * self.waveform.shape[0]
        stream.time_base = Fraction(1, self.stream_rate)
        self._stream = stream

    def mux(self, container: av.container.OutputContainer) -> None:
        import av

        if self._stream is None:
            raise RuntimeError("AudioTrack.mux called before add_stream")
        frame = av.AudioFrame.from_ndarray(
            self.waveform, format="fltp", layout=_LAYOUTS[self.waveform.shape[0]]
        )
        frame.sample_rate = self.sample_rate
        # pts 0: the encoder then stamps its priming packet (1024 samples for AAC) at a negative pts, and the
        # MP4 muxer writes an edit list that makes players (and `read_audio_track`) skip it.
        frame.pts = 0
        container.mux(self._stream.encode(frame))
        container.mux(self._stream.encode(None))


@dataclass(frozen=True)
class DecodedAudio:
    """An MP4's decoded audio track: float32 samples (channels, n), their rate, the stream's stated
    duration in seconds and its codec name."""

    samples: np.ndarray
    sample_rate: int
    duration_s: float
    codec: str


def read_audio_track(path: Path) -> DecodedAudio:
    """Decode the first audio stream of `path` with PyAV (encoder priming removed by the demuxer's edit list)."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise ValueError(f"{path} has no audio stream")
        stream = container.streams.audio[0]
        chunks = [_planar(frame) for frame in container.decode(stream)]
        sample_rate = int(stream.codec_context.sample_rate)
        codec = stream.codec_context.name
        if stream.duration is not None and stream.time_base is not None:
            duration_s = float(stream.duration * stream.time_base)
        else:
            duration_s = float("nan")
    samples = np.concatenate(chunks, axis=1).astype(np.float32)
    return DecodedAudio(samples=samples, sample_rate=sample_rate, duration_s=duration_s, codec=codec)


def _planar(frame: av.AudioFrame) -> np.ndarray:
    """A decoded frame's samples as (channels, n), whether the decoder's format is planar or packed."""
    array = frame.to_ndarray()
    if frame.format.is_planar:
        return array
    return array.reshape(-1, frame.layout.nb_channels).T
