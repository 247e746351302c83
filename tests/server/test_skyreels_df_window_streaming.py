"""Streaming a long SkyReels-V2 diffusion-forcing video window by window (skyreels_v2_forcing_decode.py): a
streamed job's finished windows are decoded and published while its later windows are still denoised.

On a tiny `skyreels-v2-df` folder, 17 frames (5 latent) in windows of 9 frames (3 latent) starting 5 frames
(2 latent) back: three windows, the first giving latent frames 0-2, the next two one each. In process
(`Req.on_decoded`, the hook the server's streamed jobs set): the step at which each chunk is handed out,
the chunks against the final frames (exactly) and against an unstreamed request's (exactly), and a streamed
request batched with an unstreamed one. Then a real `diffserve serve`: the first segment reaches an SSE
client while the job is still denoising, the segments are the job's MP4, and a client that hangs up
mid-stream stops nothing.

A video extension (a `skyreels-v2-df-v2v` folder, a 6-frame input clip) streams the same way after its
input frames, resized, which it publishes before its first step: in process, the chunks against the final
and unstreamed frames (exactly), the unstreamed output against the decode it had before streaming (the
resized input, then the whole latent video decoded at once), a one-window extension, and the input frames
published first when the request was prepared without a stream; then a server's SSE job, its MP4 the
segments.
"""

from __future__ import annotations

import base64
import io
import json
import time

import av
import httpx
import numpy as np
import pytest
from PIL import Image
from server_process import serving

from diffserve import DiffGenerator, SamplingParams
from diffserve.families.wan import skyreels_v2_v2v
from diffserve.families.wan.skyreels_v2_forcing_decode import SkyReelsV2ForcingDecodingStage
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.outputs.fmp4 import chunk_bounds
from diffserve.request import Req
from diffserve.stages.video_vae_decoding import VideoVaeDecodingStage, video_to_uint8
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.parity import smooth_random_image

SIZE, FPS, FRAMES = 32, 8, 17
LONG = {"base_num_frames": 9, "overlap_history": 5}
COMMON = dict(height=SIZE, width=SIZE, num_frames=FRAMES, max_sequence_length=32, guidance_scale=5.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = TinySkyReelsV2Spec(diffusion_forcing=True)
    return build_tiny_skyreels_v2(tmp_path_factory.mktemp("skyreels-v2-df-stream"), spec)


@pytest.fixture(scope="module")
def gen(model_dir):
    return DiffGenerator.from_pretrained(
        model_dir, device="cpu", show_progress=False, batch_policy="throughput"
    )


def streamed_request(params: SamplingParams) -> tuple[Req, list[tuple[int, np.ndarray]]]:
    """A request whose decoded chunks are recorded with the step the request was at: (step, uint8 frames)."""
    req = Req(params=params)
    log: list[tuple[int, np.ndarray]] = []

    def record(pixels) -> None:
        videos = video_to_uint8(pixels)
        assert len(videos) == 1
        log.append((req.step_index, videos[0]))

    req.on_decoded = record
    return req, log


def test_windows_are_published_while_later_windows_denoise(gen) -> None:
    steps = 4  # synchronous: 4 rows a window, 12 steps in all
    params = SamplingParams(prompt="a fox", seed=7, num_inference_steps=steps, extra=LONG, **COMMON)
    req, log = streamed_request(params)
    out = gen.generate_from_params(params, request=req)
    assert req.num_steps == 3 * steps
    # Window 0 ends at step 4: its 3 latent frames are decoded one per step (steps 4, 5, 6); window 1 ends
    # at step 8 (latent frame 3); the last window's frame is the final decode's (after step 12).
    assert [(step, len(chunk)) for step, chunk in log] == [(4, 1), (5, 4), (6, 4), (8, 4), (12, 4)]
    assert [(a, n) for a, n in chunk_bounds(FRAMES, 4)] == [(0, 1), (1, 4), (5, 4), (9, 4), (13, 4)]
    final = np.stack(out.frames)[0]
    assert np.array_equal(np.concatenate([chunk for _, chunk in log]), final)  # the chunks are the video
    # The same request unstreamed (decoded whole after its last window, as Diffusers does): the same frames.
    plain = np.stack(
        gen.generate(prompt="a fox", seed=7, num_inference_steps=steps, extra=LONG, **COMMON).frames
    )
    diff = int(np.abs(plain[0].astype(int) - final).max())
    print(f"SkyReels-V2 DF streamed window by window vs unstreamed: max abs pixel diff {diff}")
    assert diff <= 1
    assert np.array_equal(plain[0], final)  # measured: bit for bit (the Wan VAE decodes causally)


def test_streamed_request_batched_with_another_matches_each_alone(gen) -> None:
    """A streamed long video sharing DiT steps with an unstreamed one-window video (same latent shape: 9
    frames): its window decodes between steps change neither request's frames."""
    long_params = SamplingParams(prompt="a fox", seed=3, num_inference_steps=3, extra=LONG, **COMMON)
    short_kwargs = {**COMMON, "num_frames": 9}
    short_params = SamplingParams(prompt="a lighthouse", seed=5, num_inference_steps=9, **short_kwargs)
    req, log = streamed_request(long_params)
    together = gen.generate_many([long_params, short_params], requests=[req, Req(params=short_params)])
    assert log and log[0][0] == 3  # published during the batch, after window 0's last row
    alone_long = np.stack(
        gen.generate(prompt="a fox", seed=3, num_inference_steps=3, extra=LONG, **COMMON).frames
    )
    alone_short = np.stack(
        gen.generate(prompt="a lighthouse", seed=5, num_inference_steps=9, **short_kwargs).frames
    )
    assert np.abs(np.stack(together[0].frames).astype(int) - alone_long).max() <= 1
    assert np.abs(np.stack(together[1].frames).astype(int) - alone_short).max() <= 1
    assert np.array_equal(np.concatenate([chunk for _, chunk in log]), np.stack(together[0].frames)[0])


def test_a_window_decode_that_fails_stops_only_the_early_streaming(gen, monkeypatch) -> None:
    """The second frame's decode between steps fails: the request and the batch go on, the frame streamed
    before stays the video's first, and the final frames are the unstreamed request's."""
    from diffserve.families.wan import skyreels_v2_forcing_decode as window_decode

    calls = {"n": 0}
    real = window_decode.denormalize_latents

    def failing_second(vae, latents):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a decode between steps failed")
        return real(vae, latents)

    monkeypatch.setattr(window_decode, "denormalize_latents", failing_second)
    params = SamplingParams(prompt="a fox", seed=7, num_inference_steps=4, extra=LONG, **COMMON)
    req, log = streamed_request(params)
    out = gen.generate_from_params(params, request=req)
    assert calls["n"] == 2  # no decode was tried after the failure
    assert [(step, len(chunk)) for step, chunk in log] == [(4, 1)]
    final = np.stack(out.frames)[0]
    assert np.array_equal(log[0][1], final[:1])
    monkeypatch.undo()
    plain = gen.generate(prompt="a fox", seed=7, num_inference_steps=4, extra=LONG, **COMMON).frames
    assert np.array_equal(np.stack(plain)[0], final)


# -- a server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    with serving(model_dir, tmp_path_factory.mktemp("df-stream"), "--max-inference-steps", "5000") as server:
        yield server


def body(**fields) -> dict:
    return {
        "prompt": "a streamed fox", "size": f"{SIZE}x{SIZE}", "num_frames": FRAMES, "fps": FPS,
        "num_inference_steps": 40, "guidance_scale": 5.0, "stream": True, "extra": LONG, **fields,
    }  # fmt: skip


def create(srv, **fields) -> dict:
    r = httpx.post(f"{srv.base_url}/v1/videos", json=body(**fields), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def job_state(srv, video_id: str) -> dict:
    return httpx.get(f"{srv.base_url}/v1/videos/{video_id}", timeout=10).json()


def sse_events(
    srv, video_id: str, stop_after_chunks: int | None = None
) -> tuple[list[tuple[str, dict]], dict]:
    """The job's stream events; on the first chunk the job's state is read at once (returned too).
    `stop_after_chunks`: hang up after that many chunks."""
    events: list[tuple[str, dict]] = []
    at_first_chunk: dict = {}
    with httpx.stream("GET", f"{srv.base_url}/v1/videos/{video_id}/stream", timeout=60) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name is not None:
                events.append((name, json.loads(line[6:])))
                chunks = sum(1 for n, _ in events if n == "video.chunk")
                if name == "video.chunk" and chunks == 1:
                    at_first_chunk = job_state(srv, video_id)
                if stop_after_chunks is not None and chunks == stop_after_chunks:
                    break
    return events, at_first_chunk


def decode(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def streamed_bytes(events: list[tuple[str, dict]], bounds: list[tuple[int, int]] | None = None) -> bytes:
    """init + segments of a whole stream, its chunks checked against `bounds` (default: the VAE's chunk
    bounds of a FRAMES-frame video)."""
    bounds = chunk_bounds(FRAMES, 4) if bounds is None else bounds
    expected = ["video.init"] + ["video.chunk"] * len(bounds) + ["video.done"]
    assert [n for n, _ in events] == expected, events
    chunks = [data for name, data in events if name == "video.chunk"]
    assert [(c["start_frame"], c["num_frames"]) for c in chunks] == bounds
    assert events[-1][1]["video"]["status"] == "completed"
    return base64.b64decode(events[0][1]["data"]) + b"".join(base64.b64decode(c["data"]) for c in chunks)


def content(srv, video_id: str) -> bytes:
    r = httpx.get(f"{srv.base_url}/v1/videos/{video_id}/content", timeout=30)
    assert r.status_code == 200, r.text
    return r.content


def test_sse_delivers_the_first_window_while_the_last_denoises(srv) -> None:
    job = create(srv, seed=11)
    events, at_first = sse_events(srv, job["id"])
    # When the client had the first segment the job was still denoising (120 steps in all, the first
    # window's frames are published from step 40): an ordering fact, read after the arrival.
    assert at_first["phase"] == "denoising" and at_first["progress"] < 90, at_first
    streamed = streamed_bytes(events)
    assert content(srv, job["id"]) == streamed  # the MP4 is the streamed segments, byte for byte
    assert len(decode(streamed)) == FRAMES
    log = srv.log()
    assert f"{job['id']}: {FRAMES} of {FRAMES} frames streamed as they were decoded" in log
    assert "the streamed chunks differ from the decoded clip" not in log


def test_a_client_that_hangs_up_mid_stream_stops_nothing(srv) -> None:
    job = create(srv, seed=13)
    twin = create(srv, seed=13)  # the same job, nobody leaving it
    events, at_first = sse_events(srv, job["id"], stop_after_chunks=2)
    assert at_first["phase"] == "denoising", at_first
    deadline = time.monotonic() + 60
    while job_state(srv, job["id"])["status"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job_state(srv, job["id"])["status"] == "completed"
    whole, _ = sse_events(srv, job["id"])  # a late subscriber: every segment, the file's bytes
    assert content(srv, job["id"]) == streamed_bytes(whole)
    twin_events, _ = sse_events(srv, twin["id"])
    # The same frames as the job nobody left, but for batching's rounding (the two shared some DiT steps
    # and not others: at most 1 uint8 level before H.264).
    frames, twin_frames = decode(content(srv, job["id"])), decode(streamed_bytes(twin_events))
    assert frames.shape == (FRAMES, SIZE, SIZE, 3)
    psnr = psnr_uint8(frames, twin_frames)
    print(f"SkyReels-V2 DF streamed job left mid-stream vs its twin: PSNR {psnr:.2f} dB")
    assert psnr >= 40.0


# -- video extension -----------------------------------------------------------------------------------------
INPUT_FRAMES = 6
#: The extension's windows are the text-to-video request's (17 generated frames, the 5-frame overlap
#: re-encoded among them): three, the first giving latent frames 0-2 (0-1 the overlap, never stepped).
EXTEND = {**COMMON, "extra": LONG, "num_inference_steps": 4}


def moving_clip(frames: int = INPUT_FRAMES) -> list[np.ndarray]:
    """A smooth pattern panning right, 48x40 (another size than the output's: resized)."""
    base = np.asarray(smooth_random_image(width=64, height=40, seed=1))
    return [np.ascontiguousarray(base[:, 2 * i : 2 * i + 48]) for i in range(frames)]


def input_clip() -> list[Image.Image]:
    return [Image.fromarray(frame) for frame in moving_clip()]


def resized_input() -> np.ndarray:
    """The input frames as the output has them (Diffusers' video processor's resize, then uint8)."""
    return video_to_uint8(skyreels_v2_v2v.video_pixels(input_clip(), SIZE, SIZE))[0]


@pytest.fixture(scope="module")
def v2v_dir(tmp_path_factory):
    spec = TinySkyReelsV2Spec(diffusion_forcing=True, video_to_video=True)
    return build_tiny_skyreels_v2(tmp_path_factory.mktemp("skyreels-v2-df-v2v-stream"), spec)


@pytest.fixture(scope="module")
def gen_v2v(v2v_dir):
    return DiffGenerator.from_pretrained(v2v_dir, device="cpu", show_progress=False)


def extend(gen_v2v, stream: bool, **overrides) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """The extension's frames (uint8) and, streamed, its chunks with the step each was handed out at."""
    params = SamplingParams(prompt="a fox", seed=7, input_video=input_clip(), **{**EXTEND, **overrides})
    if not stream:
        return np.stack(gen_v2v.generate_from_params(params).frames)[0], []
    req, log = streamed_request(params)
    return np.stack(gen_v2v.generate_from_params(params, request=req).frames)[0], log


def test_a_video_extension_streams_its_input_then_each_window(gen_v2v) -> None:
    final, log = extend(gen_v2v, stream=True)
    assert final.shape == (INPUT_FRAMES + FRAMES, SIZE, SIZE, 3)
    # The input frames before the first step; then as text-to-video: window 0 (steps 1-4) decoded at steps
    # 4-6, window 1's frame at step 8, while the last window (steps 9-12) is still to denoise; the last
    # window's frame is the final decode's.
    assert [(step, len(chunk)) for step, chunk in log] == [
        (0, INPUT_FRAMES), (4, 1), (5, 4), (6, 4), (8, 4), (12, 4),
    ]  # fmt: skip
    assert np.array_equal(log[0][1], resized_input())
    assert np.array_equal(np.concatenate([chunk for _, chunk in log]), final)  # the chunks are the video
    plain, _ = extend(gen_v2v, stream=False)
    assert np.array_equal(plain, final)  # and the unstreamed request's, bit for bit


def test_an_unstreamed_video_extension_is_decoded_as_before(gen_v2v, monkeypatch) -> None:
    """Unstreamed, the output is what the extension's own decode gave before window streaming: the resized
    input frames, then Wan's plain decode of the whole latent video."""
    seen: list[np.ndarray] = []
    real = SkyReelsV2ForcingDecodingStage.forward

    def spy(self, req: Req) -> Req:
        whole = Req(params=req.params)
        whole.latents = req.latents.clone()
        seen.extend(VideoVaeDecodingStage.forward(self, whole).outputs.frames or [])
        return real(self, req)

    monkeypatch.setattr(SkyReelsV2ForcingDecodingStage, "forward", spy)
    plain, _ = extend(gen_v2v, stream=False)
    assert len(seen) == 1
    assert np.array_equal(plain, np.concatenate([resized_input(), seen[0]]))


def test_a_one_window_extension_streams_its_input_before_denoising(gen_v2v) -> None:
    """One window (9 frames): nothing to stream while it denoises but the input frames; the generated
    frames stream as the final decode makes them."""
    one_window = {"num_frames": 9, "extra": {"overlap_history": 5}}
    final, log = extend(gen_v2v, stream=True, **one_window)
    assert [(step, len(chunk)) for step, chunk in log] == [(0, INPUT_FRAMES), (4, 1), (4, 4), (4, 4)]
    assert np.array_equal(np.concatenate([chunk for _, chunk in log]), final)
    plain, _ = extend(gen_v2v, stream=False, **one_window)
    assert np.array_equal(plain, final)


def test_input_frames_go_first_when_the_request_was_prepared_unstreamed(gen_v2v, monkeypatch) -> None:
    """Prepared where it was not streamed (an encode phase on another engine): the input frames go out
    just before the first decoded frame, after window 0."""
    monkeypatch.setattr(skyreels_v2_v2v, "streams_output", lambda req: False)
    final, log = extend(gen_v2v, stream=True)
    assert [(step, len(chunk)) for step, chunk in log][:2] == [(4, INPUT_FRAMES), (4, 1)]
    assert np.array_equal(np.concatenate([chunk for _, chunk in log]), final)


@pytest.fixture(scope="module")
def srv_v2v(v2v_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("df-v2v-stream")
    with serving(v2v_dir, work, "--max-inference-steps", "5000", "--no-warmup") as server:
        yield server


def input_mp4_url() -> str:
    """The input clip as an H.264 MP4 data URL (POST /v1/videos' JSON `video`)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 48, 40, "yuv420p"
        for frame in moving_clip():
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_sse_delivers_an_extensions_input_then_its_windows(srv_v2v) -> None:
    job = create(srv_v2v, seed=11, video=input_mp4_url())
    events, at_first = sse_events(srv_v2v, job["id"])
    print(f"SkyReels-V2 DF extension: its first chunk reached the client at {at_first['progress']}%")
    assert at_first["phase"] == "denoising" and at_first["progress"] < 90, at_first
    bounds = [(0, INPUT_FRAMES)] + [(INPUT_FRAMES + a, n) for a, n in chunk_bounds(FRAMES, 4)]
    streamed = streamed_bytes(events, bounds)
    # The input chunk went out before the first window ended (its first frame is the next chunk, decoded
    # after 40 of the job's 120 steps).
    published = [data["published_at"] for name, data in events if name == "video.chunk"]
    assert published == sorted(published) and published[0] < published[1], published
    assert content(srv_v2v, job["id"]) == streamed  # the MP4 is the streamed segments, byte for byte
    total = INPUT_FRAMES + FRAMES
    assert len(decode(streamed)) == total
    log = srv_v2v.log()
    assert f"{job['id']}: {total} of {total} frames streamed as they were decoded" in log
    assert "the streamed chunks differ from the decoded clip" not in log
