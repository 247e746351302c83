"""`/v1/videos` on the wave-2 video families (Wan 2.2 TI2V-5B, LTX-2, SANA-Video), through real `diffserve
serve` processes driven by the official `openai` SDK: the clip served has the frame count the family's
frame rule gives for the seconds asked, and its frames equal those of the in-process API's MP4 for the
same seed, both written by the same encoder: >= 30 dB over the clip (most frames decode identical; x264's
threads make a few frames of two encodes of the same frames differ, 33-45 dB, from run to run).

TI2V-5B is one folder for both tasks: the same server makes a text-to-video and an image-to-video job.
LTX-2's clip carries its soundtrack: an AAC track as long as the video, equal to the in-process one's."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from server_process import start_server

from diffserve import DiffGenerator
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.families.hunyuan_video.tiny import build_tiny_hunyuan_video
from diffserve.families.ltx2.tiny import build_tiny_ltx2
from diffserve.families.mochi.tiny import build_tiny_mochi
from diffserve.families.sana_video.tiny import build_tiny_sana_video
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.families.wan.tiny import TinyWanSpec, build_tiny_wan
from diffserve.outputs.audio_track import read_audio_track
from diffserve.testing.image_metrics import psnr_uint8 as psnr

WIDTH, HEIGHT, FPS, STEPS, SEED = 96, 64, 8, 4, 5
#: family -> the folder's builder
FAMILIES = {
    "wan-2.2-ti2v": lambda out: build_tiny_wan(out, TinyWanSpec(variant="2.2-ti2v")),
    "ltx2": build_tiny_ltx2,
    "sana-video": build_tiny_sana_video,
    "cogvideox": build_tiny_cogvideox,
    # CogVideoX 1.5 image-to-video, its positions reaching the 96-pixel width.
    "cogvideox-i2v": lambda out: build_tiny_cogvideox(
        out, TinyCogVideoXSpec(variant="1.5", image_to_video=True, sample_width=12)
    ),
    "mochi": build_tiny_mochi,
    "hunyuan-video": build_tiny_hunyuan_video,
    "skyreels-v2": build_tiny_skyreels_v2,
    "skyreels-v2-i2v": lambda out: build_tiny_skyreels_v2(out, TinySkyReelsV2Spec(image_to_video=True)),
    "skyreels-v2-df": lambda out: build_tiny_skyreels_v2(out, TinySkyReelsV2Spec(diffusion_forcing=True)),
}
#: family -> frames for 1 s at FPS: Wan's 4k+1, LTX's 8k+1 (8 frames -> 9 either way)
FRAMES = {
    "wan-2.2-ti2v": 9,
    "ltx2": 9,
    "sana-video": 9,
    "cogvideox": 9,
    "cogvideox-i2v": 9,
    "mochi": 7,
    "hunyuan-video": 9,
    "skyreels-v2": 9,
    "skyreels-v2-i2v": 9,
    "skyreels-v2-df": 9,
}
#: Families whose folders make image-to-video only (the text-to-video test skips them).
IMAGE_TO_VIDEO_ONLY = {"cogvideox-i2v", "skyreels-v2-i2v"}
#: family -> what its requests add: SANA-Video generates at its 480p aspect-ratio bins unless told not to
#: (Diffusers' use_resolution_binning), too large for a quick test.
REQUEST_EXTRAS = {"sana-video": {"extra": {"use_resolution_binning": False}}}

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    model_dir = Path(FAMILIES[family](tmp_path_factory.mktemp(family)))
    srv = start_server(model_dir, tmp_path_factory.mktemp(f"{family}-server"), "--no-warmup")
    try:
        srv.wait_ready()
        generator = DiffGenerator.from_pretrained(model_dir, device="cpu", show_progress=False)
        yield family, srv, generator
    finally:
        srv.process.terminate()
        srv.process.wait(30)


def decoded_frames(data: bytes) -> tuple[np.ndarray, float]:
    """An MP4's frames (frames, H, W, 3) and its frame rate, decoded with PyAV."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def served_clip(srv, *, image_path: Path | None = None, **extra) -> tuple[np.ndarray, float, dict, bytes]:
    """Create a 1-second job through the SDK, wait for it, download and decode it."""
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    body = {"fps": FPS, "seed": SEED, "num_inference_steps": STEPS, **extra}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if image_path is None:
            video = client.videos.create(
                prompt="a red fox running", seconds="1", size=f"{WIDTH}x{HEIGHT}", extra_body=body
            )
        else:
            with open(image_path, "rb") as image:
                video = client.videos.create(
                    prompt="a red fox running",
                    seconds="1",
                    size=f"{WIDTH}x{HEIGHT}",
                    input_reference=image,
                    extra_body=body,
                )
        video = client.videos.poll(video.id, poll_interval_ms=100)
    assert video.status == "completed", (video.error, video)
    data = client.videos.download_content(video.id).read()
    frames, fps = decoded_frames(data)
    return frames, fps, video.model_extra, data


def local_clip(generator: DiffGenerator, tmp_path: Path, num_frames: int, **extra) -> np.ndarray:
    """The in-process API's MP4 of the same request, decoded; run on one thread like the server."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = generator.generate(
            prompt="a red fox running",
            height=HEIGHT,
            width=WIDTH,
            num_frames=num_frames,
            fps=FPS,
            seed=SEED,
            num_inference_steps=STEPS,
            save_output=True,
            output_path=str(tmp_path),
            output_file_name="local",
            **extra,
        )
    finally:
        torch.set_num_threads(threads)
    assert out.frames[0].shape == (num_frames, HEIGHT, WIDTH, 3)
    return decoded_frames((tmp_path / "local.mp4").read_bytes())[0]


def test_text_to_video_job_matches_the_python_api(served, tmp_path) -> None:
    family, srv, generator = served
    if family in IMAGE_TO_VIDEO_ONLY:
        pytest.skip("an image-to-video folder needs an input image")
    family_extras = REQUEST_EXTRAS.get(family, {})
    # A multipart form (the SDK's videos.create) carries `extra` as its JSON text.
    frames, fps, extras, data = served_clip(srv, **{k: json.dumps(v) for k, v in family_extras.items()})
    n = FRAMES[family]
    assert extras["num_frames"] == n and fps == FPS
    assert frames.shape == (n, HEIGHT, WIDTH, 3)
    value = psnr(frames, local_clip(generator, tmp_path, n, **family_extras))
    print(f"{family} text-to-video: served vs in-process {value:.1f} dB")
    assert value >= 30.0
    if family == "ltx2":
        (tmp_path / "served.mp4").write_bytes(data)
        served, local = read_audio_track(tmp_path / "served.mp4"), read_audio_track(tmp_path / "local.mp4")
        print(f"ltx2 audio: {served.codec} {served.sample_rate} Hz, {served.duration_s:.3f} s")
        assert served.codec == "aac" and served.sample_rate == local.sample_rate
        assert abs(served.duration_s - n / FPS) < 0.05
        assert served.samples.shape == local.samples.shape


def test_ti2v_makes_image_to_video_on_the_same_server(served, tmp_path) -> None:
    family, srv, generator = served
    if family != "wan-2.2-ti2v" and family not in IMAGE_TO_VIDEO_ONLY:
        pytest.skip("only Wan 2.2 TI2V-5B folders (and image-to-video ones) take an input image")
    pixels = np.random.default_rng(1).integers(0, 256, (48, 80, 3), dtype=np.uint8)  # non-square input
    image_path = tmp_path / "first-frame.png"
    Image.fromarray(pixels).save(image_path)
    frames, _, extras, _ = served_clip(srv, image_path=image_path)
    assert extras["image_to_video"] is True and frames.shape == (9, HEIGHT, WIDTH, 3)
    with Image.open(image_path) as image:
        local = local_clip(generator, tmp_path, 9, image=image.convert("RGB"))
    value = psnr(frames, local)
    print(f"{family} image-to-video: served vs in-process {value:.1f} dB")
    assert value >= 30.0
