"""Issue 31 item 3: a VAE decode runs in chunks (a latent frame, a tile, a batch element): a cancel stops it
between two chunks with the cancelled outcome of a cancel between steps, and the engine loop runs other
requests' denoising steps between the chunks of a long decode (`runtime/decode_task.py`).

A stand-in pipeline whose decode is N chunks, each calling `decode_chunk_boundary()` as the VAEs do; then
the VAEs themselves: every decode loop passes a boundary before each chunk."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import RequestCancelledError
from diffserve.layers.attention import AttentionBackend
from diffserve.platforms.cpu import CpuPlatform
from diffserve.request import Req
from diffserve.runtime import Engine, SchedulerConfig
from diffserve.runtime.decode_task import DecodeTask
from diffserve.runtime.engine import EngineEvents, RequestLog
from diffserve.runtime.memory import MemoryModel
from diffserve.testing.fake_pipeline import FakePipeline, video_facts
from diffserve.vae_tiling import decode_chunk_boundary, decode_chunk_scope

LONG_CHUNKS = 40


class ChunkedDecodePipeline(FakePipeline):
    """A video pipeline whose decode is one chunk per frame (`num_frames`), as a causal video VAE's is per
    latent frame; `log` records every step and chunk in the order they ran."""

    def __init__(self) -> None:
        super().__init__(video_facts())
        self.log: list[tuple[str, str, int]] = []
        self.on_chunk = lambda req, index: None

    def denoise_step(self, reqs: list[Req]) -> None:
        super().denoise_step(reqs)
        self.log += [("step", req.params.prompt, req.step_index) for req in reqs]

    def run_post_denoise(self, req: Req) -> Req:
        p = req.params
        frames = []
        for index in range(p.num_frames):
            decode_chunk_boundary()
            self.log.append(("chunk", p.prompt, index))
            self.on_chunk(req, index)
            frames.append(np.zeros((1, p.height, p.width, 3), np.uint8))
        req.outputs.frames = [np.concatenate(frames)]
        return req


class Recorder(EngineEvents):
    def __init__(self) -> None:
        self.ended: list[tuple[str, str]] = []

    def on_finished(self, sr) -> None:
        self.ended.append(("finished", sr.req.params.prompt))

    def on_cancelled(self, sr) -> None:
        self.ended.append(("cancelled", sr.req.params.prompt))


def engine_for(pipeline: ChunkedDecodePipeline, memory: MemoryModel | None = None) -> Engine:
    # Requests of equal steps denoise together (the measured policy would choose on the fake's noise).
    config = SchedulerConfig(batch_policy="throughput")
    return Engine(
        pipeline,
        CpuPlatform(),
        config,
        events=Recorder(),
        memory=memory,
        attention_backend=AttentionBackend.SDPA,
    )


def video(prompt: str, frames: int, steps: int = 1) -> Req:
    return Req(params=SamplingParams(prompt=prompt, num_frames=frames, num_inference_steps=steps))


def chunks_of(pipeline: ChunkedDecodePipeline, prompt: str) -> list[int]:
    return [index for kind, who, index in pipeline.log if kind == "chunk" and who == prompt]


def test_a_cancel_during_the_decode_stops_it_at_the_next_chunk() -> None:
    pipeline = ChunkedDecodePipeline()

    def cancel_at_third(req: Req, index: int) -> None:  # the front end's cancel, arriving mid-decode
        if index == 2:
            req.cancel_event.set()

    pipeline.on_chunk = cancel_at_third
    engine = engine_for(pipeline)
    engine.request_log = log = RequestLog()
    ended: list[str] = []
    log.ended = lambda sr: ended.append(sr.state)  # type: ignore[method-assign]
    sr = engine.submit(video("long", LONG_CHUNKS))
    engine.run_to_completion([sr])
    assert sr.state == "cancelled" and sr.req.outputs.frames is None, sr.state
    assert chunks_of(pipeline, "long") == [0, 1, 2]  # not the 37 chunks after the cancel
    assert engine.events.ended == [("cancelled", "long")] and ended == ["cancelled"]
    assert not engine.has_work and not engine._decodes


def test_the_finish_line_of_a_request_cancelled_while_decoding_says_so(caplog) -> None:
    pipeline = ChunkedDecodePipeline()
    pipeline.on_chunk = lambda req, index: index == 1 and req.cancel_event.set()
    engine = engine_for(pipeline)
    engine.request_log = RequestLog()
    sr = engine.submit(video("long", LONG_CHUNKS))
    with caplog.at_level("INFO", logger="diffserve.runtime"):
        engine.run_to_completion([sr])
    [line] = [
        r.getMessage() for r in caplog.records if " in " in r.getMessage() and sr.request_id in r.getMessage()
    ]
    assert f"Request {sr.request_id} cancelled while decoding in " in line, line


def test_a_long_decode_does_not_hold_the_steps_of_a_request_behind_it() -> None:
    pipeline = ChunkedDecodePipeline()
    engine = engine_for(pipeline)
    long = engine.submit(video("long", LONG_CHUNKS))
    while not chunks_of(pipeline, "long"):  # its one step done, its decode started
        engine.step()
    short = engine.submit(video("short", 1, steps=3))
    engine.run_to_completion([long, short])
    assert long.state == short.state == "finished"
    assert engine.events.ended == [("finished", "short"), ("finished", "long")]
    # The short request's three steps and its decode ran between the long decode's chunks.
    short_done = pipeline.log.index(("chunk", "short", 0))
    assert pipeline.log.index(("step", "short", 3)) < short_done < pipeline.log.index(("chunk", "long", 10))
    assert chunks_of(pipeline, "long") == list(range(LONG_CHUNKS))  # the whole video, in order
    assert long.req.outputs.frames[0].shape[0] == LONG_CHUNKS


def test_two_decodes_run_at_once_only_when_the_memory_model_fits_both() -> None:
    def model(budget: int) -> MemoryModel:  # each decode 100 bytes, each request 64 bytes of schedule
        return MemoryModel(
            bytes_per_token=0.0, bytes_per_pixel=0.0, fixed_bytes=0.0, decode_fixed_bytes=100.0,
            budget_bytes=budget, source="test",
        )  # fmt: skip

    for budget, interleaved in ((1000, True), (250, False)):
        pipeline = ChunkedDecodePipeline()
        engine = engine_for(pipeline, model(budget))
        first = engine.submit(video("first", 8))
        second = engine.submit(video("second", 8))
        engine.run_to_completion([first, second])
        chunks = [who for kind, who, _ in pipeline.log if kind == "chunk"]
        if interleaved:
            assert chunks[:4] == ["first", "second", "first", "second"], chunks
        else:  # the second decode waits for the first: two would not fit
            assert chunks == ["first"] * 8 + ["second"] * 8, chunks


def test_without_interleaving_the_decode_runs_whole_and_still_stops_between_chunks() -> None:
    """Several ranks (or offloaded weights) decode whole when the steps are done; one rank still stops
    a cancelled decode at its next chunk."""
    pipeline = ChunkedDecodePipeline()
    pipeline.on_chunk = lambda req, index: index == 4 and req.cancel_event.set()
    engine = engine_for(pipeline)
    engine.interleave_decodes = False
    sr = engine.submit(video("long", LONG_CHUNKS))
    engine.run_to_completion([sr])
    assert sr.state == "cancelled" and chunks_of(pipeline, "long") == [0, 1, 2, 3, 4]


def test_decode_task_runs_only_while_advanced_and_unwinds_when_cancelled() -> None:
    seen: list[int] = []
    unwound = threading.Event()

    def decode() -> str:
        try:
            for index in range(5):
                decode_chunk_boundary()
                seen.append(index)
            return "done"
        finally:
            unwound.set()

    task = DecodeTask(decode, "decode-test")
    assert seen == [] and not task.advance() and seen == []  # up to its first boundary
    assert not task.advance() and seen == [0]
    assert not task.advance() and seen == [0, 1]
    task.cancel()
    assert task.done and isinstance(task.error, RequestCancelledError) and unwound.is_set()
    assert seen == [0, 1] and task.result is None
    finished = DecodeTask(lambda: "ok", "decode-test")
    assert finished.advance() and finished.result == "ok"


# -- the VAEs' decode loops ---------------------------------------------------------------------------
def boundaries(decode, *args) -> int:
    count = [0]

    def hook() -> None:
        count[0] += 1

    with torch.inference_mode(), decode_chunk_scope(hook):
        decode(*args)
    return count[0]


def test_wan_vae_decodes_a_latent_frame_per_chunk_and_stops_when_the_hook_raises() -> None:
    from diffserve.families.wan.tiny import TinyWanSpec, _vae_config
    from diffserve.models.vaes.autoencoder_kl_wan import AutoencoderKLWan

    vae = AutoencoderKLWan.from_config(_vae_config(TinyWanSpec())).eval()
    z = torch.randn(1, 16, 6, 2, 2)
    assert boundaries(vae.decode, z) == 6
    vae.enable_tiling(32, 32, 24, 24)  # 6x6 latents in tiles of 4x4 latents every 3: 2 x 2 tiles
    assert boundaries(vae.decode, torch.randn(1, 16, 3, 6, 6)) == 4 * 3  # each tile's frames
    vae.disable_tiling()
    vae.enable_slicing()
    assert boundaries(vae.decode, torch.randn(2, 16, 2, 2, 2)) == 2 + 2 * 2  # each element, then its frames

    calls = [0]

    def cancel_at_third() -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RequestCancelledError("cancelled")

    with torch.inference_mode(), decode_chunk_scope(cancel_at_third), pytest.raises(RequestCancelledError):
        vae.decode(z)
    assert calls[0] == 3
    with torch.inference_mode():
        vae.decode(z)  # outside a scope the boundaries do nothing


def test_image_vaes_decode_a_tile_per_chunk() -> None:
    from diffserve.models.vaes.autoencoder_kl import AutoencoderKL

    vae = AutoencoderKL(
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[16, 32], layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16,
    ).eval()  # fmt: skip
    z = torch.randn(1, 4, 12, 12)
    assert boundaries(vae.decode, z) == 1  # untiled: the whole image is one chunk
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 16, 8  # stride 6 latents: 2 x 2 tiles of 12x12
    assert boundaries(vae.decode, z) == 4
