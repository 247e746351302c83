"""`diffserve.outputs.audio_track`: H.264 + AAC MP4s with sound, decoded back with PyAV.

A known waveform (sine sweeps) is written next to a short clip and decoded back: the track must be AAC at the
waveform's rate and channel count, last as long as the video (num_frames / fps), start on time (the
encoder's priming samples hidden by the MP4 edit list: best alignment lag 0) and sound like the input
(SNR of the decoded samples against the fitted input). Also the Opus fallback (with its log line) and the
input checks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

import diffserve.outputs.audio_track as audio_track
from diffserve.outputs.audio_track import (
    fit_to_video,
    pick_audio_codec,
    read_audio_track,
    save_clip,
    save_video_with_audio,
)

av = pytest.importorskip("av")

METADATA = {"prompt": "a bell ringing", "seed": 3}
MAX_LAG = 2048


def _frames(num_frames: int, height: int = 32, width: int = 48) -> np.ndarray:
    yy, xx = np.mgrid[0:height, 0:width]
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        frames[t] = np.stack([40 + 3 * xx, 40 + 3 * yy, np.full_like(xx, 60 + 4 * t)], axis=-1)
    return frames


def _tones(sample_rate: int, num_samples: int, channels: int) -> np.ndarray:
    """Sine sweeps (left 300 -> 3000 Hz at 0.5, right 3000 -> 300 Hz at 0.3; mono: the left), with a soft
    onset. A sweep, unlike a steady tone, correlates with itself at one lag only, so alignment is unambiguous."""
    t = np.arange(num_samples) / sample_rate
    span = num_samples / sample_rate
    ramp = np.minimum(1.0, t / 0.02)

    def sweep(f0: float, f1: float) -> np.ndarray:
        return np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * span)))

    return (np.stack([0.5 * sweep(300, 3000), 0.3 * sweep(3000, 300)]) * ramp)[:channels]


def _best_lag(decoded: np.ndarray, reference: np.ndarray) -> int:
    """How many samples `decoded` lags `reference` (first channel), by the peak of their cross-correlation
    (FFT, no wrap-around) within +-MAX_LAG."""
    n = min(decoded.shape[-1], reference.shape[-1])
    size = 1 << (2 * n).bit_length()
    spectrum = np.fft.rfft(decoded[0, :n], size) * np.conj(np.fft.rfft(reference[0, :n], size))
    corr = np.fft.irfft(spectrum, size)
    lags = np.arange(-MAX_LAG, MAX_LAG + 1)
    return int(lags[np.argmax(corr[lags])])


def _snr_db(decoded: np.ndarray, reference: np.ndarray) -> float:
    n = min(decoded.shape[-1], reference.shape[-1])
    err = decoded[:, :n].astype(np.float64) - reference[:, :n]
    return float(10 * np.log10(np.sum(reference[:, :n] ** 2) / np.sum(err**2)))


@pytest.mark.parametrize(
    ("sample_rate", "channels", "num_frames", "fps", "shortfall"),
    [(24000, 2, 25, 24, 720), (48000, 1, 17, 16, -300)],  # LTX-2-like: a few ms short; or a little long
)
def test_mp4_with_aac_round_trip(
    tmp_path: Path, sample_rate: int, channels: int, num_frames: int, fps: int, shortfall: int
) -> None:
    target = round(num_frames * sample_rate / fps)
    waveform = _tones(sample_rate, target - shortfall, channels).astype(np.float32)
    path = save_video_with_audio(
        _frames(num_frames), tmp_path / "clip.mp4", fps, METADATA, waveform, sample_rate
    )

    decoded = read_audio_track(path)
    assert decoded.codec == "aac"
    assert decoded.sample_rate == sample_rate
    assert decoded.samples.shape[0] == channels
    video_s = num_frames / fps
    assert decoded.duration_s == pytest.approx(video_s, abs=2e-3)
    assert decoded.samples.shape[1] >= target - 64  # whole AAC frames: the last one may run past the end

    with av.open(str(path)) as container:
        video = container.streams.video[0]
        assert video.codec_context.name == "h264"
        assert video.frames == num_frames
        assert float(video.duration * video.time_base) == pytest.approx(video_s, abs=1e-3)
        assert container.duration / 1e6 == pytest.approx(video_s, abs=2e-3)
        comment = json.loads(container.metadata["comment"])
    assert comment == {
        **METADATA,
        "video_format": "mp4",
        "audio_codec": "aac",
        "audio_sample_rate": sample_rate,
        "audio_channels": channels,
    }

    reference = fit_to_video(waveform, sample_rate, num_frames, fps)
    assert reference.shape == (channels, target)
    lag = _best_lag(decoded.samples, reference)
    snr = _snr_db(decoded.samples[:, :target], reference)
    print(
        f"aac {channels}ch {sample_rate} Hz, {num_frames} frames @ {fps} fps: audio {decoded.duration_s:.4f} s "
        f"vs video {video_s:.4f} s, alignment lag {lag} samples, SNR {snr:.1f} dB"
    )
    assert lag == 0, "the encoder's priming samples were not hidden by the edit list"
    assert snr > 20
    # The padded tail (silence past the waveform's end) decodes quiet.
    if shortfall > 0:
        tail = decoded.samples[:, target - shortfall + 256 : target]
        assert np.abs(tail).max() < 0.05


def test_opus_fallback_logs_and_resamples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if "libopus" not in av.codecs_available:
        pytest.skip("PyAV's FFmpeg has no libopus encoder")
    monkeypatch.setattr(audio_track, "_codecs_available", lambda: {"libopus"})
    num_frames, fps, sample_rate = 25, 24, 24000
    waveform = _tones(sample_rate, round(num_frames * sample_rate / fps), 2)
    with caplog.at_level(logging.WARNING, logger="diffserve.outputs.audio_track"):
        path = save_video_with_audio(_frames(num_frames), tmp_path / "o.mp4", fps, {}, waveform, sample_rate)
    assert any("Opus" in record.getMessage() for record in caplog.records)

    decoded = read_audio_track(path)
    assert decoded.codec == "opus"
    assert decoded.sample_rate == 48000
    assert decoded.samples.shape[0] == 2
    assert decoded.duration_s == pytest.approx(num_frames / fps, abs=2e-3)
    reference = _tones(48000, round(num_frames * 48000 / fps), 2)
    lag = _best_lag(decoded.samples, reference)
    snr = _snr_db(decoded.samples, reference)
    print(f"opus fallback 24 kHz -> 48 kHz: lag {lag} samples, SNR {snr:.1f} dB")
    assert abs(lag) <= 1
    assert snr > 15


def test_pick_audio_codec() -> None:
    assert pick_audio_codec({"aac", "libopus"}) == "aac"
    assert pick_audio_codec({"libopus"}) == "libopus"
    with pytest.raises(RuntimeError, match="neither"):
        pick_audio_codec({"mp3"})


def test_fit_to_video_pads_cuts_and_refuses() -> None:
    wave = np.full((2, 990), 0.5, dtype=np.float64)
    fitted = fit_to_video(wave, sample_rate=1000, num_frames=10, fps=10)
    assert fitted.dtype == np.float32 and fitted.shape == (2, 1000)
    assert np.all(fitted[:, :990] == 0.5) and np.all(fitted[:, 990:] == 0)
    assert fit_to_video(np.full((1, 1100), 2.0), 1000, 10, 10).shape == (1, 1000)
    assert fit_to_video(np.full((1, 1100), 2.0), 1000, 10, 10).max() == 1.0  # clipped to [-1, 1]
    with pytest.raises(ValueError, match="lasts"):
        fit_to_video(np.zeros((2, 500)), 1000, 10, 10)
    with pytest.raises(ValueError, match="channels"):
        fit_to_video(np.zeros((3, 1000)), 1000, 10, 10)
    with pytest.raises(ValueError, match="floating"):
        fit_to_video(np.zeros((2, 1000), dtype=np.int16), 1000, 10, 10)
    with pytest.raises(ValueError, match="NaN"):
        fit_to_video(np.full((2, 1000), np.nan), 1000, 10, 10)


def test_bad_inputs_leave_nothing(tmp_path: Path) -> None:
    frames, wave = _frames(4), np.zeros((2, 4000), dtype=np.float32)
    with pytest.raises(ValueError, match="sample_rate"):
        save_video_with_audio(frames, tmp_path / "a.mp4", 4, {}, wave, 4001)
    with pytest.raises(ValueError, match="fps"):
        save_video_with_audio(frames, tmp_path / "a.mp4", 0, {}, wave, 4000)
    with pytest.raises(ValueError, match="quality"):
        save_video_with_audio(frames, tmp_path / "a.mp4", 4, {}, wave, 8000, quality=99)
    assert list(tmp_path.iterdir()) == []


def test_reader_rejects_a_silent_video(tmp_path: Path) -> None:
    from diffserve.outputs import save_video

    path = save_video(_frames(4), tmp_path / "v.mp4", fps=4, metadata={})
    with pytest.raises(ValueError, match="no audio"):
        read_audio_track(path)


def test_save_clip_puts_the_soundtrack_in_mp4s_and_warns_it_off_gifs(tmp_path: Path, caplog) -> None:
    frames = _frames(9)
    waveform = np.sin(np.linspace(0, 200, 9 * 16000 // 8))[None].astype(np.float32) * 0.5
    mp4 = save_clip(frames, tmp_path / "clip.mp4", 8, METADATA, "mp4", (waveform, 16000))
    decoded = read_audio_track(mp4)
    assert decoded.sample_rate == 16000 and abs(decoded.duration_s - 9 / 8) < 0.05
    silent = save_clip(frames, tmp_path / "silent.mp4", 8, METADATA, "mp4")
    with av.open(str(silent)) as container:
        assert not container.streams.audio
    with caplog.at_level(logging.WARNING, logger=audio_track.logger.name):
        gif = save_clip(frames, tmp_path / "clip.gif", 8, METADATA, "gif", (waveform, 16000))
    assert gif.exists() and "gif cannot carry sound" in caplog.text
