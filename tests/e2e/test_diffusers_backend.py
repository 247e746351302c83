"""`--backend diffusers` end to end: Diffusers pipeline classes run by diffusers itself (SDXL, which diffserve
has not ported; CogVideoX, which it also runs natively), on tiny random checkpoints built with diffusers'
own classes, served through diffserve and compared with calling diffusers directly on the same folder and
seed.

- SDXL through a real `diffserve serve --backend diffusers` process and the openai SDK: the images equal
  diffusers' (max pixel difference and PSNR printed); a field the pipeline does not take is a 400 naming
  it; `/server_info` reports the backend and forces one request at a time.
- CogVideoX through `DiffGenerator(backend="diffusers")`: the frames equal diffusers'.
- The same SDXL folder without the flag is refused with a message naming `--backend diffusers`.
"""

from __future__ import annotations

import base64
import io
import sys
import threading
import time
import warnings
from pathlib import Path

import av
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from diffserve.api import DiffGenerator
from diffserve.backends.diffusers_import import import_diffusers
from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, ModelLoadError, RequestCancelledError, UserError
from diffserve.request import Req
from diffserve.runtime.contract import resolved_params
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.tokenizers import build_clip_tokenizer, build_t5_tokenizer

# The server launcher lives next to the server tests (a plain module there, not a conftest).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_process import API_KEY, start_server  # noqa: E402

diffusers = pytest.importorskip("diffusers", reason="the diffusers backend needs diffusers installed")
transformers = pytest.importorskip("transformers")

SEED = 1234
PROMPT = "a red cube on a table"
SDXL_SIZE = 64
SDXL_STEPS = 3


def _clip_config(tokenizer, hidden: int):
    return transformers.CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=hidden,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_sdxl(root: Path) -> Path:
    """A random-weight StableDiffusionXLPipeline folder (two CLIP encoders, a small UNet, a 2-block VAE)."""
    torch.manual_seed(0)
    tokenizer = build_clip_tokenizer()
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=SDXL_SIZE // 2,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=6 * 8 + 16,  # six size/crop ids x 8, plus the pooled text
        cross_attention_dim=32,  # both encoders' hidden states side by side
        norm_num_groups=8,
    )
    vae = diffusers.AutoencoderKL(
        block_out_channels=[16, 32],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=SDXL_SIZE,
    )
    scheduler = diffusers.EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="scaled_linear",
        timestep_spacing="leading",
    )  # fmt: skip
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=transformers.CLIPTextModel(_clip_config(tokenizer, 16)),
        text_encoder_2=transformers.CLIPTextModelWithProjection(_clip_config(tokenizer, 16)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=scheduler,
    )
    pipe.save_pretrained(root)
    return root


def build_tiny_cogvideox(root: Path) -> Path:
    """A random-weight CogVideoXPipeline folder (a one-layer DiT, a 3D VAE, a tiny T5)."""
    torch.manual_seed(0)
    tokenizer = build_t5_tokenizer()
    text_encoder = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
    )  # fmt: skip
    transformer = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=32,
        num_layers=1,
        sample_width=4,
        sample_height=4,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=226,  # diffusers' default max_sequence_length: the server's probes use it
    )
    vae = diffusers.AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    pipe = diffusers.CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=diffusers.CogVideoXDDIMScheduler(),
    )
    pipe.save_pretrained(root)
    return root


def diffusers_reference(folder: Path, **kwargs) -> object:
    """The same folder run by diffusers directly, with the seed as the backend passes it."""
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe(generator=torch.Generator("cpu").manual_seed(SEED), output_type="np", **kwargs)


def to_uint8(array: np.ndarray) -> np.ndarray:
    return (np.asarray(array) * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def sdxl_folder(tmp_path_factory) -> Path:
    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny-sdxl"))


@pytest.fixture(scope="module")
def sdxl_server(sdxl_folder: Path, tmp_path_factory):
    work = tmp_path_factory.mktemp("sdxl-server")
    srv = start_server(
        sdxl_folder, work, "--backend", "diffusers", "--device", "cpu", "--dtype", "float32",
        "--api-key", API_KEY, "--served-model-name", "tiny-sdxl", "--no-warmup",
    )  # fmt: skip
    srv.api_key, srv.model_name = API_KEY, "tiny-sdxl"
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_sdxl_images_through_server_equal_diffusers(sdxl_server, sdxl_folder: Path) -> None:
    client = openai.OpenAI(base_url=f"{sdxl_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    response = client.images.generate(
        model="tiny-sdxl",
        prompt=PROMPT,
        size=f"{SDXL_SIZE}x{SDXL_SIZE}",
        response_format="b64_json",
        extra_body={"seed": SEED, "num_inference_steps": SDXL_STEPS, "guidance_scale": 5.0},
    )
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).convert("RGB"))
    reference = diffusers_reference(
        sdxl_folder, prompt=PROMPT, height=SDXL_SIZE, width=SDXL_SIZE,
        num_inference_steps=SDXL_STEPS, guidance_scale=5.0,
    ).images[0]  # fmt: skip
    expected = to_uint8(reference)
    diff = int(np.abs(served.astype(np.int16) - expected.astype(np.int16)).max())
    score = psnr(served, expected)
    print(f"SDXL served vs diffusers: max pixel diff {diff}, PSNR {score:.1f} dB, shape {served.shape}")
    assert served.shape == (SDXL_SIZE, SDXL_SIZE, 3)
    assert diff == 0 or score >= 60.0
    assert served.std() > 1.0  # a real picture of random weights, not a constant image


def test_server_refuses_a_field_the_pipeline_does_not_take(sdxl_server) -> None:
    client = openai.OpenAI(base_url=f"{sdxl_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.images.generate(
            model="tiny-sdxl",
            prompt=PROMPT,
            size=f"{SDXL_SIZE}x{SDXL_SIZE}",
            extra_body={"true_cfg_scale": 4.0, "num_inference_steps": 1},
        )
    assert caught.value.status_code == 400
    error = caught.value.body
    print("refused field:", error)
    assert "true_cfg_scale" in str(error)


def test_server_info_reports_the_backend(sdxl_server) -> None:
    info = sdxl_server.info()
    engine = info["engine"]
    backend = engine["backend"]
    print("server_info backend:", backend, "scheduler:", engine["scheduler"])
    assert backend["name"] == "diffusers" and backend["step_batching"] is False
    assert backend["quality_tiers"] == ["high"]
    assert engine["diffusers_pipeline"] == "StableDiffusionXLPipeline"
    assert engine["scheduler"]["max_running_requests"] == 1
    assert "backend diffusers" in sdxl_server.log()


def test_unported_pipeline_without_the_flag_is_refused(sdxl_folder: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        DiffGenerator.from_pretrained(sdxl_folder, device="cpu", show_progress=False)
    print("refusal:", caught.value)
    assert "StableDiffusionXLPipeline" in str(caught.value)
    assert "--backend diffusers" in str(caught.value)


@pytest.fixture(scope="module")
def cogvideox_folder(tmp_path_factory) -> Path:
    return build_tiny_cogvideox(tmp_path_factory.mktemp("tiny-cogvideox"))


def test_cogvideox_video_job_through_the_server(cogvideox_folder: Path, tmp_path: Path) -> None:
    """`/v1/videos` with the openai SDK: the job completes and its MP4 has the frames, size and fps asked."""
    srv = start_server(
        cogvideox_folder, tmp_path, "--backend", "diffusers", "--device", "cpu", "--dtype", "float32",
        "--served-model-name", "tiny-cogvideox", "--no-warmup",
    )  # fmt: skip
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        with warnings.catch_warnings():  # the SDK marks its video API deprecated; the calls are what we test
            warnings.simplefilter("ignore", DeprecationWarning)
            video = client.videos.create(
                prompt=PROMPT, seconds="1", size="32x32", model="tiny-cogvideox",
                extra_body={"fps": 8, "seed": SEED, "num_inference_steps": 2},
            )  # fmt: skip
            deadline = time.monotonic() + 60
            while video.status not in ("completed", "failed") and time.monotonic() < deadline:
                time.sleep(0.05)
                video = client.videos.retrieve(video.id)
            assert video.status == "completed", video
            data = client.videos.download_content(video.id).read()
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
            fps = float(stream.average_rate)
        print(f"CogVideoX /v1/videos: {len(frames)} frames of {frames[0].shape}, {fps:g} fps")
        assert (len(frames), frames[0].shape, fps) == (9, (32, 32, 3), 8.0)
        assert srv.info()["engine"]["task"] == "text-to-video"
    finally:
        srv.stop()


def test_cogvideox_frames_through_generator_equal_diffusers(cogvideox_folder: Path) -> None:
    folder = cogvideox_folder
    call = dict(prompt=PROMPT, height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=3.0)
    generator = DiffGenerator.from_pretrained(
        folder, device="cpu", dtype="float32", backend="diffusers", show_progress=False
    )
    assert generator.family.task == "text-to-video"
    steps_seen: list[int] = []
    output = generator.generate(**call, seed=SEED)
    steps_seen.append(len(output.step_times))
    frames = output.frames[0]
    expected = to_uint8(diffusers_reference(folder, **call).frames[0])
    diff = int(np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max())
    score = psnr(frames, expected)
    print(f"CogVideoX vs diffusers: max pixel diff {diff}, PSNR {score:.1f} dB, frames {frames.shape}")
    assert frames.shape == (9, 32, 32, 3)
    assert diff == 0 or score >= 60.0
    assert steps_seen == [2]  # one engine step per diffusers step


@pytest.fixture(scope="module")
def sdxl_generator(sdxl_folder: Path) -> DiffGenerator:
    return DiffGenerator.from_pretrained(
        sdxl_folder, device="cpu", dtype="float32", backend="diffusers", show_progress=False
    )


def test_cancelled_request_stops_its_call_and_the_next_one_is_unaffected(sdxl_generator) -> None:
    """A request cancelled after its first step ends there (the paused diffusers call raises and its
    thread exits); the next request gets the same pixels as one run before it."""
    params = dict(prompt=PROMPT, height=SDXL_SIZE, width=SDXL_SIZE, num_inference_steps=3, seed=SEED)
    before = np.asarray(sdxl_generator.generate(**params).images[0])
    req = Req(params=SamplingParams(**params), cancel_event=threading.Event())
    req.on_step = lambda r: r.cancel_event.set() if r.step_index == 1 else None
    with pytest.raises(RequestCancelledError):
        sdxl_generator.generate_from_params(req.params, request=req)
    assert req.step_index == 1
    after = sdxl_generator.generate(**params)
    assert len(after.step_times) == 3
    assert np.array_equal(np.asarray(after.images[0]), before)


def test_request_validation_against_the_call_signature(sdxl_generator) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        sdxl_generator.generate(PROMPT, height=SDXL_SIZE, width=SDXL_SIZE, num_frames=5)
    assert caught.value.param == "num_frames"
    with pytest.raises(InvalidRequestError) as caught:
        sdxl_generator.generate(PROMPT, height=SDXL_SIZE + 1, width=SDXL_SIZE)
    assert caught.value.param == "height"
    with pytest.raises(InvalidRequestError) as caught:
        sdxl_generator.generate(PROMPT, height=SDXL_SIZE, width=SDXL_SIZE, quality="draft")
    assert caught.value.param == "quality"
    resolved = resolved_params(sdxl_generator.pipeline, SamplingParams(PROMPT))
    # The size the pipeline makes by default (UNet sample size x VAE factor), its __call__'s step default.
    assert (resolved.height, resolved.width, resolved.num_inference_steps) == (SDXL_SIZE, SDXL_SIZE, 50)


def test_ported_pipeline_runs_through_diffusers_when_asked(tiny_flux_dir: Path) -> None:
    """`--backend diffusers` on a FLUX folder runs diffusers' FluxPipeline, not the native one."""
    call = dict(prompt=PROMPT, height=32, width=32, num_inference_steps=2, guidance_scale=3.5)
    generator = DiffGenerator.from_pretrained(
        tiny_flux_dir, device="cpu", dtype="float32", backend="diffusers", show_progress=False
    )
    assert generator.family.diffusers_pipeline == "FluxPipeline"
    assert type(generator.pipeline.pipe).__name__ == "FluxPipeline"
    image = np.asarray(generator.generate(**call, seed=SEED).images[0])
    expected = to_uint8(diffusers_reference(tiny_flux_dir, **call).images[0])
    diff = int(np.abs(image.astype(np.int16) - expected.astype(np.int16)).max())
    print(f"FLUX through the diffusers backend vs diffusers: max pixel diff {diff}")
    assert diff == 0 or psnr(image, expected) >= 60.0


def test_missing_diffusers_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` now raises ImportError
    with pytest.raises(UserError) as caught:
        import_diffusers()
    assert "pip install 'diffserve[diffusers]'" in str(caught.value)
