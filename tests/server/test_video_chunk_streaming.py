"""Chunk streaming of `/v1/videos` jobs (`"stream": true`): the fragmented-MP4 writer on its own, then a
real `diffserve serve` on a tiny Wan 2.1 checkpoint: `GET /v1/videos/{id}/stream` (server-sent events)
and the WebSocket `/v1/realtime/videos`.

What is guaranteed and checked: the job's MP4 is byte for byte the init segment followed by the chunks'
segments; the segments arrive before the job ends; a subscriber that leaves stops nothing.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time

import av
import httpx
import numpy as np
import pytest
from server_process import serving
from websockets.sync.client import connect

from diffserve.outputs.fmp4 import FragmentedMp4Writer, chunk_bounds, mime_type_of, segment_table
from diffserve.server.middleware import ApiKeyMiddleware
from diffserve.server.protocol import JobChunk
from diffserve.server.video_stream import ChunkStream, subscribe

SIZE, FPS, FRAMES = 32, 8, 17  # Wan: 1 + 4 * 4 frames, five VAE chunks (1, 4, 4, 4, 4 frames)


def decode(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


# -- the writer, no server ---------------------------------------------------------------------------------
def test_chunk_bounds_follow_the_vae() -> None:
    assert chunk_bounds(17, 4) == [(0, 1), (1, 4), (5, 4), (9, 4), (13, 4)]
    assert chunk_bounds(1, 4) == [(0, 1)]
    assert chunk_bounds(7, 4) == [(0, 1), (1, 4), (5, 2)]


@pytest.mark.parametrize("keyframes", [True, False])
def test_fragmented_writer_concatenation_is_the_clip(keyframes: bool) -> None:
    y, x = np.mgrid[0:48, 0:64]
    frames = np.stack(
        [np.stack([(x + 3 * t) % 256, (y + 2 * t) % 256, (x + y + t) % 256], -1) for t in range(FRAMES)]
    ).astype(np.uint8)
    writer = FragmentedMp4Writer(FPS, comment="{}", keyframe_every_chunk=keyframes)
    segments = [writer.add_chunk(frames[a : a + n]) for a, n in chunk_bounds(FRAMES, 4)]
    writer.close()
    data = (writer.init_segment or b"") + b"".join(segments)
    decoded = decode(data)
    assert len(decoded) == FRAMES
    assert np.abs(np.stack(decoded).astype(int) - frames).mean() < 4  # H.264 at CRF 20
    assert writer.mime_type == mime_type_of(writer.init_segment or b"")
    assert writer.mime_type.startswith('video/mp4; codecs="avc1.')
    table = segment_table(data)
    assert [size for _, size in table] == [len(writer.init_segment or b""), *map(len, segments)]
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        pts = [float(p.pts * stream.time_base) for p in container.demux(stream) if p.pts is not None]
    assert pts == [i / FPS for i in range(FRAMES)]  # decode times continue from chunk to chunk
    if keyframes:  # each segment decodes after the init segment alone
        for (a, n), segment in zip(chunk_bounds(FRAMES, 4), segments, strict=True):
            assert len(decode((writer.init_segment or b"") + segment)) == n, a


def test_chunk_stream_gives_late_subscribers_everything_and_ignores_replays() -> None:
    async def scenario() -> list:
        stream = ChunkStream()
        stream.add(JobChunk("r", 0, 0, 1, FPS, b"a", b"init", "video/mp4"))
        stream.add(JobChunk("r", 0, 0, 1, FPS, b"again", b"init2", "video/mp4"))  # a job run again: ignored
        stream.add(JobChunk("r", 2, 5, 4, FPS, b"gap"))  # not the next one: ignored
        got: list = []

        async def consume() -> None:
            async for kind, meta, data in subscribe(stream):
                got.append((kind, meta if kind == "init" else meta.index, data or meta.data))

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        stream.add(JobChunk("r", 1, 1, 4, FPS, b"b"))
        stream.finish()
        stream.add(JobChunk("r", 2, 5, 4, FPS, b"late"))  # after the end: ignored
        await asyncio.wait_for(task, 5)
        return got

    assert asyncio.run(scenario()) == [("init", "video/mp4", b"init"), ("chunk", 0, b"a"), ("chunk", 1, b"b")]


def test_wan_vae_hands_out_each_chunk_as_decoded() -> None:
    """Untiled, the Wan VAE hands each latent frame's pixels out as it decodes it (before the next one);
    converted like the whole clip, they are exactly its frames. Tiled, it hands out nothing."""
    import torch

    from diffserve.families.wan.tiny import TinyWanSpec, _vae_config
    from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan
    from diffserve.stages.video_vae_decoding import video_to_uint8
    from diffserve.vae_tiling import decode_chunk_boundary, decode_chunk_scope, decode_output_scope

    vae = AutoencoderKLWan.from_config(_vae_config(TinyWanSpec())).eval()
    z = torch.randn(1, 16, 5, 2, 2)
    log: list = []
    with (
        torch.inference_mode(),
        decode_chunk_scope(lambda: log.append("boundary")),
        decode_output_scope(lambda pixels: log.append(video_to_uint8(pixels)[0])),
    ):
        whole = video_to_uint8(vae.decode(z))[0]
    assert [x if isinstance(x, str) else len(x) for x in log] == ["boundary", 1] + ["boundary", 4] * 4
    assert np.array_equal(np.concatenate([x for x in log if not isinstance(x, str)]), whole)
    vae.enable_tiling(32, 32, 24, 24)
    handed: list = []
    with torch.inference_mode(), decode_output_scope(handed.append):
        vae.decode(torch.randn(1, 16, 2, 6, 6))
    assert handed == [] and decode_chunk_boundary() is None


def test_websockets_need_the_api_key() -> None:
    """ApiKeyMiddleware refuses a WebSocket without a valid key before its handshake (HTTP 403)."""
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from diffserve.server.access import PRINCIPAL_STATE, PathRedactionMiddleware, PathRedactor

    async def echo(websocket) -> None:
        await websocket.accept()
        owner = websocket.scope["state"][PRINCIPAL_STATE].owner
        await websocket.send_json({"owner": owner, "error": "cannot write /secret/root/videos/x.mp4"})
        await websocket.close()

    inner = PathRedactionMiddleware(
        Starlette(routes=[WebSocketRoute("/ws", echo)]), PathRedactor(["/secret/root"])
    )
    client = TestClient(ApiKeyMiddleware(inner, api_key="k1", admin_api_key="admin"))
    for headers in ({}, {"Authorization": "Bearer nope"}):
        with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/ws", headers=headers):
            pass
        assert refused.value.code == 1008
    with client.websocket_connect("/ws", headers={"Authorization": "Bearer k1"}) as ws:
        message = ws.receive_json()
    # A client (not the admin) is told no server path, as in every other answer.
    assert message["owner"].startswith("key:") and "/secret/root" not in message["error"], message
    with client.websocket_connect("/ws", headers={"Authorization": "Bearer admin"}) as ws:
        assert "/secret/root" in ws.receive_json()["error"]


# -- a server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan

    model_dir = build_tiny_wan(tmp_path_factory.mktemp("tiny-wan-stream"), TinyWanSpec())
    # A short header timeout and few connections per client: a WebSocket must leave both once upgraded.
    flags = ("--max-inference-steps", "5000", "--header-timeout", "2", "--max-connections-per-client", "6")
    with serving(model_dir, tmp_path_factory.mktemp("stream"), *flags) as server:
        yield server


def body(**fields) -> dict:
    return {
        "prompt": "a streamed clip", "size": f"{SIZE}x{SIZE}", "num_frames": FRAMES, "fps": FPS,
        "num_inference_steps": 2, "stream": True, **fields,
    }  # fmt: skip


def create(srv, **fields) -> dict:
    r = httpx.post(f"{srv.base_url}/v1/videos", json=body(**fields), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(srv, video_id: str, stop_after: str | None = None) -> list[tuple[str, dict, float]]:
    """(event, data, arrival time) of the job's stream; `stop_after`: hang up after the first such event."""
    events: list[tuple[str, dict, float]] = []
    url = f"{srv.base_url}/v1/videos/{video_id}/stream"
    with httpx.stream("GET", url, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name is not None:
                events.append((name, json.loads(line[6:]), time.time()))
                if name == stop_after:
                    return events
    return events


def content(srv, video_id: str) -> bytes:
    r = httpx.get(f"{srv.base_url}/v1/videos/{video_id}/content", timeout=30)
    assert r.status_code == 200, r.text
    return r.content


def check_stream(srv, events: list[tuple[str, dict, float]]) -> bytes:
    """The events of a whole stream: init, the chunks in order, done (completed); returns init+segments,
    which must be the job's MP4 byte for byte."""
    names = [name for name, _, _ in events]
    assert names == ["video.init"] + ["video.chunk"] * 5 + ["video.done"], names
    init = events[0][1]
    assert init["mime_type"].startswith('video/mp4; codecs="avc1.')
    chunks = [data for name, data, _ in events if name == "video.chunk"]
    assert [c["index"] for c in chunks] == list(range(5))
    assert [(c["start_frame"], c["num_frames"]) for c in chunks] == chunk_bounds(FRAMES, 4)
    assert [(c["start_time"], c["end_time"]) for c in chunks] == [
        (a / FPS, (a + n) / FPS) for a, n in chunk_bounds(FRAMES, 4)
    ]
    done = events[-1][1]
    assert done["video"]["status"] == "completed" and done["video"]["stream"] is True
    streamed = base64.b64decode(init["data"]) + b"".join(base64.b64decode(c["data"]) for c in chunks)
    mp4 = content(srv, done["video"]["id"])
    assert mp4 == streamed
    assert len(decode(mp4)) == FRAMES
    return streamed


def test_sse_streams_each_chunk_before_the_job_ends(srv) -> None:
    job = create(srv, num_inference_steps=50)
    events = sse_events(srv, job["id"])
    streamed = check_stream(srv, events)
    chunks = [(data, at) for name, data, at in events if name == "video.chunk"]
    done_data, done_at = events[-1][1], events[-1][2]
    first, first_at = chunks[0]
    assert first["published_at"] < done_data["finished_at"]  # published before the job finished
    assert first_at < done_at
    # On Wan every chunk was handed out by the VAE as it decoded it (not written after the decode).
    assert f"{job['id']}: {FRAMES} of {FRAMES} frames streamed as they were decoded" in srv.log()
    # The segments, decoded one after the other, are the frames of the final MP4.
    frames = decode(streamed)
    assert len(frames) == FRAMES
    # A late subscriber (the job is done: read back from the file) gets the same segments.
    again = sse_events(srv, job["id"])
    assert check_stream(srv, again) == streamed
    assert all(data.get("published_at") is None for name, data, _ in again if name == "video.chunk")


def test_a_client_that_leaves_stops_nothing(srv) -> None:
    job = create(srv, num_inference_steps=200, seed=7)
    # One client hangs up as soon as it has the init segment, another while the job is still denoising.
    early = threading.Thread(target=lambda: _hang_up_early(srv, job["id"]))
    early.start()
    partial = sse_events(srv, job["id"], stop_after="video.chunk")
    early.join(30)
    assert [name for name, _, _ in partial] == ["video.init", "video.chunk"]
    deadline = time.monotonic() + 60
    while (status := httpx.get(f"{srv.base_url}/v1/videos/{job['id']}", timeout=10).json()["status"]) not in (
        "completed", "failed", "cancelled",
    ) and time.monotonic() < deadline:  # fmt: skip
        time.sleep(0.05)
    assert status == "completed"
    check_stream(srv, sse_events(srv, job["id"]))  # whole and the same as the file


def _hang_up_early(srv, video_id: str) -> None:
    with httpx.stream("GET", f"{srv.base_url}/v1/videos/{video_id}/stream", timeout=30) as r:
        assert r.status_code == 200


def test_websocket_sends_the_same_segments(srv) -> None:
    ws_url = srv.base_url.replace("http://", "ws://") + "/v1/realtime/videos"
    fields = body(seed=3, num_inference_steps=1200)  # seconds: longer than --header-timeout
    del fields["stream"]  # implied
    messages: list = []
    with connect(ws_url, open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps(fields))
        while True:
            message = ws.recv(timeout=60)
            messages.append(message)
            if isinstance(message, str) and json.loads(message)["type"] in ("video.done", "error"):
                break
    created = json.loads(messages[0])
    assert created["type"] == "video.created", created
    video_id = created["video"]["id"]
    headers = [json.loads(m) for m in messages if isinstance(m, str)]
    assert [h["type"] for h in headers] == ["video.created", "video.init"] + ["video.chunk"] * 5 + [
        "video.done"
    ]
    segments = [m for m in messages if isinstance(m, bytes)]
    assert [len(s) for s in segments] == [h["size_bytes"] for h in headers[1:-1]]
    assert headers[-1]["video"]["status"] == "completed"
    streamed = b"".join(segments)
    assert content(srv, video_id) == streamed
    # The same segments as the server-sent events of the same job.
    assert check_stream(srv, sse_events(srv, video_id)) == streamed


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"num_frames": "many"}, "num_frames"), ({"colour": "red"}, "colour"), ({"size": "big"}, "size")],
)
def test_websocket_bad_request_names_the_field(srv, fields: dict, param: str) -> None:
    ws_url = srv.base_url.replace("http://", "ws://") + "/v1/realtime/videos"
    with connect(ws_url, open_timeout=10, close_timeout=5) as ws:
        ws.send(json.dumps(body(**fields)))
        message = json.loads(ws.recv(timeout=30))
    assert message["type"] == "error" and message["status"] == 400, message
    assert message["error"]["param"] == param and "Traceback" not in message["error"]["message"]


def test_closed_websockets_give_their_connection_back(srv) -> None:
    ws_url = srv.base_url.replace("http://", "ws://") + "/v1/realtime/videos"
    for _ in range(10):  # more than --max-connections-per-client, one after the other
        with connect(ws_url, open_timeout=10, close_timeout=5) as ws:
            ws.send("{}")
            assert json.loads(ws.recv(timeout=30))["error"]["param"] == "prompt"
    assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200


def test_stream_of_unknown_or_unstreamed_video(srv) -> None:
    r = httpx.get(f"{srv.base_url}/v1/videos/video_{'0' * 32}/stream", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found"
    r = httpx.get(f"{srv.base_url}/v1/videos/nonsense/stream", timeout=10)
    assert r.status_code == 404
    job = create(srv, stream=False)
    r = httpx.get(f"{srv.base_url}/v1/videos/{job['id']}/stream", timeout=10)
    assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_streamed"
