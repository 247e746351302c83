"""SkyReels-V2 diffusion forcing's video extension on every surface: `diffserve generate --video PATH` and
POST /v1/videos' `video` (a multipart file part, or a JSON base64 data URL) give the frames
`DiffGenerator.generate(video=...)` gives for the same seed and the same decoded input MP4; what is not a
video, a clip over the frame limit and another family's server are refused naming `video`.

The CLI's frames (`--save-frames`, lossless PNGs) are compared with the API's as uint8 (within 1 level);
the server's MP4 with the API's MP4 of the same request, written by the same encoder (>= 35 dB; x264 is not
bit-reproducible across runs), and far from the API's extension of another clip. The V2V server starts
with its warm-up on: the warm-up, calibration and /health_generate probes send a grey one-frame clip.
"""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from server_process import ServerProcess, start_server

from diffserve import DiffGenerator
from diffserve.cli.main import main as cli_main
from diffserve.families.wan.skyreels_v2_tiny import TinySkyReelsV2Spec, build_tiny_skyreels_v2
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.parity import smooth_random_image
from diffserve.video_inputs import MAX_INPUT_VIDEO_FRAMES, VideoInputLimits, load_video

PROMPT = "a red fox running through snow"
SEED, STEPS, FRAMES, INPUT_FRAMES = 3, 2, 9, 6
FORCING = {"overlap_history": 5}
#: The request of every surface: 32x32, 9 frames generated (the 5-frame overlap re-encoded among them).
REQUEST = dict(
    height=32, width=32, num_frames=FRAMES, num_inference_steps=STEPS, seed=SEED, guidance_scale=5.0
)

#: The V2V server's --max-image-bytes: an input video's bound too (its body: 4/3 of it plus --max-body-bytes).
MAX_BYTES = 200_000
#: The served MP4 against the in-process API's MP4 of the same request (two encodes by the same encoder).
PSNR_BAR_DB = 35.0

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def write_mp4(path: Path, frames: list[np.ndarray], fps: int = 8) -> Path:
    """`frames` (H, W, 3) uint8 as an H.264 MP4."""
    height, width = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def run_cli(argv: list[str]) -> int:
    """`diffserve generate ...` in this process (its exit code); the root logger's handlers, which the
    command replaces with one on the current (captured) stderr, restored after it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return cli_main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def moving_clip(frames: int) -> list[np.ndarray]:
    """A smooth pattern panning right, 48x40 (another size than the output's: resized)."""
    base = np.asarray(smooth_random_image(width=64, height=40, seed=1))
    return [np.ascontiguousarray(base[:, 2 * i : 2 * i + 48]) for i in range(frames)]


def mp4_frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The V2V folder and a SkyReels-V2 diffusion-forcing text-to-video one, a server on each (started together, the V2V one with
    its warm-up), the input MP4 and the in-process API's output for it."""
    work = tmp_path_factory.mktemp("v2v-surfaces")
    v2v = build_tiny_skyreels_v2(
        work / "v2v", TinySkyReelsV2Spec(diffusion_forcing=True, video_to_video=True)
    )
    t2v = build_tiny_skyreels_v2(work / "t2v", TinySkyReelsV2Spec(diffusion_forcing=True))
    (work / "srv-v2v").mkdir(), (work / "srv-t2v").mkdir()
    # The V2V server with its warm-up and calibration (one running request: no batch-curve measurement).
    servers = [
        start_server(
            v2v, work / "srv-v2v", "--max-running-requests", "1", "--max-image-bytes", str(MAX_BYTES)
        ),
        start_server(t2v, work / "srv-t2v", "--no-warmup"),
    ]
    try:
        mp4 = write_mp4(work / "input.mp4", moving_clip(INPUT_FRAMES))
        video = load_video(mp4, param="video", limits=VideoInputLimits())
        generator = DiffGenerator.from_pretrained(v2v, device="cpu", show_progress=False)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the server (OMP_NUM_THREADS=1)
        try:
            out = generator.generate(
                prompt=PROMPT, video=video, extra=FORCING, max_sequence_length=32, save_output=True,
                output_path=str(work / "api"), output_file_name="api", **REQUEST,
            )  # fmt: skip
            # The control: the same request extending the clip played backwards.
            generator.generate(
                prompt=PROMPT, video=video[::-1], extra=FORCING, max_sequence_length=32, save_output=True,
                output_path=str(work / "api"), output_file_name="control", **REQUEST,
            )  # fmt: skip
        finally:
            torch.set_num_threads(threads)
        for srv in servers:
            srv.wait_ready()
        yield {
            "v2v": v2v, "mp4": mp4, "work": work, "frames": out.frames[0], "servers": servers,
            "api_mp4": mp4_frames((work / "api" / "api.mp4").read_bytes()),
            "control_mp4": mp4_frames((work / "api" / "control.mp4").read_bytes()),
        }  # fmt: skip
    finally:
        for srv in servers:  # both drain at once
            srv.process.terminate()
        for srv in servers:
            srv.stop()


def test_cli_extends_an_mp4_as_the_python_api(setup, tmp_path) -> None:
    out = tmp_path / "cli"
    argv = [
        "generate", "--model-path", str(setup["v2v"]), "--device", "cpu", "--prompt", PROMPT,
        "--video", str(setup["mp4"]), "--extra", json.dumps(FORCING), "--max-sequence-length", "32",
        "--height", "32", "--width", "32", "--num-frames", str(FRAMES), "--num-inference-steps", str(STEPS),
        "--seed", str(SEED), "--guidance-scale", "5.0", "--save-frames", "--output-path", str(out),
        "--output-file-name", "cli",
    ]  # fmt: skip
    assert run_cli(argv) == 0
    pngs = sorted(out.rglob("*.png"))
    assert len(pngs) == len(setup["frames"]) >= FRAMES
    got = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in pngs]).astype(int)
    diff = np.abs(got - setup["frames"].astype(int)).max()
    print(f"CLI vs API: max difference {diff} levels over {len(pngs)} frames")
    assert diff <= 1


def test_cli_refuses_what_is_not_a_video_and_a_clip_over_the_limit(setup, tmp_path, capsys) -> None:
    base = ["generate", "--model-path", str(setup["v2v"]), "--prompt", PROMPT, "--extra", json.dumps(FORCING)]
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    assert run_cli([*base, "--video", str(text)]) == 2
    assert "error: --video: not a readable video" in capsys.readouterr().err
    long = write_mp4(tmp_path / "long.mp4", [np.zeros((16, 16, 3), np.uint8)] * (MAX_INPUT_VIDEO_FRAMES + 1))
    assert run_cli([*base, "--video", str(long)]) == 2
    err = capsys.readouterr().err
    assert f"more than {MAX_INPUT_VIDEO_FRAMES} frames" in err and err.startswith("error: --video")


def served_frames(srv: ServerProcess, **request: object) -> np.ndarray:
    """POST /v1/videos (`files` as multipart, else JSON), wait for the job, return its MP4's frames."""
    files = request.pop("files", None)
    fields = {"prompt": PROMPT, "size": "32x32", "num_frames": FRAMES, "num_inference_steps": STEPS,
              "seed": SEED, "guidance_scale": 5.0, "max_sequence_length": 32, "extra": FORCING, **request}  # fmt: skip
    if files is not None:
        form = {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in fields.items()}
        r = httpx.post(f"{srv.base_url}/v1/videos", data=form, files=files, timeout=60)
    else:
        r = httpx.post(f"{srv.base_url}/v1/videos", json=fields, timeout=60)
    assert r.status_code == 200, r.text
    video_id = r.json()["id"]
    job = srv.wait_for(
        lambda: (j := httpx.get(f"{srv.base_url}/v1/videos/{video_id}").json())["status"]
        in ("completed", "failed") and j,
        timeout=60, what="the job",
    )  # fmt: skip
    assert job["status"] == "completed", job
    return mp4_frames(httpx.get(f"{srv.base_url}/v1/videos/{video_id}/content", timeout=30).content)


def assert_as_api(got: np.ndarray, setup: dict, what: str) -> None:
    """`got` (the served MP4's frames) is the API's MP4 of the same request: >= 35 dB (x264's threads make two
    encodes of the same frames differ slightly from run to run: 40 dB to identical), while the API's MP4
    extending another clip (the same one backwards) is far from it."""
    want, control = setup["api_mp4"], setup["control_mp4"]
    assert got.shape == want.shape and want.shape[0] >= FRAMES
    same, other = psnr_uint8(got, want), psnr_uint8(got, control)
    print(f"{what}: served vs API MP4 {same:.1f} dB; vs the API's extension of another clip {other:.1f} dB")
    assert same >= PSNR_BAR_DB and other < PSNR_BAR_DB - 10


def test_server_extends_an_uploaded_mp4_as_the_python_api(setup) -> None:
    srv = setup["servers"][0]
    assert "Warm-up generation done" in srv.log()
    data = setup["mp4"].read_bytes()
    got = served_frames(srv, files={"video": ("input.mp4", data, "video/mp4")})
    assert_as_api(got, setup, "multipart")
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    assert_as_api(served_frames(srv, video=url), setup, "JSON data URL")
    assert httpx.get(f"{srv.base_url}/health_generate", timeout=60).status_code == 200


def post_error(srv: ServerProcess, **kwargs: object) -> dict:
    form = {"prompt": PROMPT, "num_frames": str(FRAMES), "extra": json.dumps(FORCING)}
    r = httpx.post(f"{srv.base_url}/v1/videos", data=form, timeout=60, **kwargs)  # type: ignore[arg-type]
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_server_refusals_name_video(setup, tmp_path) -> None:
    v2v, t2v = setup["servers"]
    error = post_error(v2v, files={"video": ("notes.mp4", b"not a video at all", "video/mp4")})
    assert error["param"] == "video" and "not a readable video" in error["message"]
    long = write_mp4(tmp_path / "long.mp4", [np.zeros((16, 16, 3), np.uint8)] * (MAX_INPUT_VIDEO_FRAMES + 1))
    error = post_error(v2v, files={"video": ("long.mp4", long.read_bytes(), "video/mp4")})
    assert error["param"] == "video" and f"limit: {MAX_INPUT_VIDEO_FRAMES} frames" in error["message"]
    # Over --max-image-bytes: 413 naming video; a body over the route's limit: 413 before it is read whole.
    r = httpx.post(
        f"{v2v.base_url}/v1/videos",
        data={"prompt": PROMPT},
        files={"video": ("big.mp4", bytes(MAX_BYTES + 1))},
    )
    assert r.status_code == 413 and r.json()["error"]["param"] == "video", r.text
    assert "--max-image-bytes" in r.json()["error"]["message"]
    r = httpx.post(
        f"{v2v.base_url}/v1/videos", data={"prompt": PROMPT}, files={"video": ("huge.mp4", bytes(4 << 20))}
    )
    assert r.status_code == 413, r.text
    error = post_error(v2v)  # no video at all
    assert error["param"] == "video" and "extends an input video" in error["message"]
    error = post_error(t2v, files={"video": ("input.mp4", setup["mp4"].read_bytes(), "video/mp4")})
    assert error["param"] == "video" and "video is not a parameter of" in error["message"]
