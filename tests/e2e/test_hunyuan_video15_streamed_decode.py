"""A streamed HunyuanVideo 1.5 request in process (`Req.on_decoded`, the hook the server's streamed video
jobs set): its VAE decodes the clip one latent frame at a time and hands each chunk's pixels out as it is
decoded, so the job's fragmented MP4 gets its frames while the rest decodes. On a tiny text-to-video folder:
the chunks (1 frame, then 4 per latent frame) converted as the server does are exactly the request's frames,
and an unstreamed request of the same seed makes the same frames.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffserve import DiffGenerator, SamplingParams
from diffserve.families.hunyuan_video15.tiny import build_tiny_hunyuan_video15
from diffserve.request import Req
from diffserve.stages.video_vae_decoding import video_to_uint8

PARAMS = dict(
    prompt="a quiet lake", height=48, width=80, num_frames=9, num_inference_steps=2, guidance_scale=1.0
)


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> DiffGenerator:
    root = build_tiny_hunyuan_video15(tmp_path_factory.mktemp("hv15-stream"))
    return DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)


def test_streamed_request_gets_each_latent_frame_as_decoded(gen: DiffGenerator) -> None:
    params = SamplingParams(seed=4, **PARAMS)
    req = Req(params=params)
    chunks: list[tuple[int, np.ndarray]] = []

    def record(pixels) -> None:
        videos = video_to_uint8(pixels)
        assert len(videos) == 1
        chunks.append((req.step_index, videos[0]))

    req.on_decoded = record
    out = gen.generate_from_params(params, request=req)
    final = np.stack(out.frames)[0]
    assert [(step, len(chunk)) for step, chunk in chunks] == [(2, 1), (2, 4), (2, 4)]
    assert np.array_equal(np.concatenate([chunk for _, chunk in chunks]), final)
    plain = np.stack(gen.generate(seed=4, **PARAMS).frames)[0]
    assert np.array_equal(plain, final)
