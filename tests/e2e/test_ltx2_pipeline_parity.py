"""Whole LTX-2 generations (video and soundtrack): diffserve against Diffusers' LTX2Pipeline /
LTX2ImageToVideoPipeline on the same tiny folder and seed.

Every frame of the clip is compared as uint8 (PSNR >= 40 dB) and the waveform as float (SNR >= 40 dB), with
Diffusers' default guidance (CFG, STG, modality guidance and rescale all on; STG moved to a block the tiny
DiT has) and with CFG off, on non-square sizes; image-to-video from a non-square image (re-compressed at the
default CRF 33). The written MP4 carries the soundtrack as an AAC track of the clip's duration, and two
requests that share DiT batches get what each gets alone. Folder configs Diffusers cannot run (shape
errors mid-generation, NaN schedules) are refused at load, and text lengths against both connectors'
registers.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.ltx2.folder_checks import check_ltx2_folder
from diffserve.families.ltx2.text_encoding import register_multiple
from diffserve.families.ltx2.tiny import TinyLTX2Spec, build_tiny_ltx2
from diffserve.outputs.audio_track import read_audio_track
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import (
    assert_images_match,
    assert_parity,
    generator_and_reference,
    gradient_image,
    snr_db,
    stack_uint8,
    to_uint8,
)
from diffserve.testing.threads import one_torch_thread

PSNR_BAR_DB = 40.0
SNR_BAR_DB = 40.0
PROMPT = "a robot dancing in the rain"
MSL = 32  # a multiple of the tiny connectors' 8 registers
STG = {"spatio_temporal_guidance_blocks": [1]}  # Diffusers' default block 28 is beyond the tiny DiT's 2
NO_STG = {"spatio_temporal_guidance_blocks": None, "stg_scale": 0.0, "audio_stg_scale": 0.0}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models' ops take microseconds: threads only add contention on a shared CPU."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    root = build_tiny_ltx2(tmp_path_factory.mktemp("ltx2-t2v"), TinyLTX2Spec())
    return generator_and_reference(DiffGenerator, root, LTX2Pipeline)


def _compare(out, ref, frames: int, height: int, width: int, what: str, outputs: int = 1) -> None:
    label = f"LTX-2 {what} {frames}x{height}x{width} video"
    shape = (outputs, frames, height, width, 3)
    assert_images_match(stack_uint8(out.frames), to_uint8(ref.frames), label, min_db=PSNR_BAR_DB, shape=shape)
    ref_audio = ref.audio.float().numpy()
    assert len(out.audio) == outputs
    assert all(track.sample_rate == 24000 for track in out.audio)
    ours_audio = np.stack([track.waveform for track in out.audio])
    assert np.abs(ref_audio).max() > 1e-3, "the reference soundtrack is silent"
    assert_parity(ours_audio, ref_audio, f"LTX-2 {what} {frames}x{height}x{width} audio", min_db=SNR_BAR_DB)


def test_ltx2_text_states_match_diffusers(t2v) -> None:
    """Gemma's stacked hidden states through the connectors, as Diffusers' encode_prompt + connectors."""
    ours, reference = t2v
    stage = next(s for s in ours.pipeline.stages if type(s).__name__ == "LTX2TextEncodingStage")
    for prompt in (PROMPT, "  a cat playing piano at night  ", ""):
        mine = stage.encode(prompt, MSL)
        embeds, mask, _, _ = reference.encode_prompt(
            prompt, do_classifier_free_guidance=False, max_sequence_length=MSL, device="cpu"
        )
        video, audio, text_mask = reference.connectors(embeds, mask, padding_side="left")
        assert torch.equal(mine.mask, text_mask)
        for got, want in ((mine.video, video), (mine.audio, audio)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("height", "width", "frames", "outputs", "extra", "guidance"),
    [
        (64, 96, 17, 1, STG, {"guidance_scale": 3.0, "negative_prompt": "blurry"}),  # every guidance term
        (96, 64, 9, 2, {**STG, "audio_guidance_scale": 1.0}, {"guidance_scale": 1.0}),  # CFG off, 2 videos
        (64, 64, 1, 1, NO_STG, {"guidance_scale": 3.0}),  # STG off with no blocks (null), one frame
    ],
)
def test_ltx2_t2v_matches_diffusers(t2v, height, width, frames, outputs, extra, guidance) -> None:
    ours, reference = t2v
    kwargs = dict(height=height, width=width, num_frames=frames, num_inference_steps=3, **guidance)
    out = ours.generate(
        prompt=PROMPT, seed=3, max_sequence_length=MSL, num_outputs_per_prompt=outputs, extra=extra, **kwargs
    )
    ref = reference(
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="np",
        frame_rate=24.0,
        max_sequence_length=MSL,
        num_videos_per_prompt=outputs,
        **extra,  # the `extra` keys are Diffusers' __call__ argument names
        **kwargs,
    )
    _compare(out, ref, frames, height, width, f"T2V x{outputs} {guidance}", outputs)


def test_ltx2_mp4_carries_the_soundtrack(t2v, tmp_path) -> None:
    ours, _ = t2v
    out = ours.generate(
        prompt=PROMPT, seed=1, height=64, width=64, num_frames=17, fps=24, num_inference_steps=1,
        max_sequence_length=MSL, save_output=True, output_path=str(tmp_path),
    )  # fmt: skip
    assert len(out.output_paths) == 1 and out.output_paths[0].endswith(".mp4")
    track = read_audio_track(out.output_paths[0])
    assert track.sample_rate == 24000
    assert track.duration_s == pytest.approx(17 / 24, abs=0.05)
    assert track.samples.shape[0] == 2
    assert track.samples.shape[1] == pytest.approx(17 / 24 * 24000, abs=0.05 * 24000)
    assert np.abs(track.samples).max() > 1e-3


def test_ltx2_batched_requests_equal_each_alone(t2v) -> None:
    ours, _ = t2v
    params = [
        SamplingParams(
            prompt=prompt,
            seed=seed,
            height=64,
            width=96,
            num_frames=9,
            num_inference_steps=2,
            max_sequence_length=MSL,
            guidance_scale=3.0,
            extra=dict(STG),
        )  # fmt: skip
        for prompt, seed in ((PROMPT, 5), ("a cat playing piano", 6))
    ]
    alone = [ours.generate_from_params(p) for p in params]
    counts = ours.engine.scheduler.batch_size_counts
    shared_before = sum(n for size, n in counts.items() if size >= 2)
    together = ours.generate_many(params)
    assert sum(n for size, n in counts.items() if size >= 2) > shared_before, (
        "the requests never shared a step"
    )
    for a, b in zip(alone, together, strict=True):
        video_db = psnr(np.stack(a.frames), np.stack(b.frames))
        audio_db = snr_db(b.audio[0].waveform, a.audio[0].waveform)
        print(f"LTX-2 batched vs alone: video PSNR {video_db:.1f} dB, audio SNR {audio_db:.1f} dB")
        assert video_db >= 45.0 and audio_db >= 45.0


def test_ltx2_rejects_bad_requests(t2v) -> None:
    ours, _ = t2v
    base = dict(height=64, width=64, num_inference_steps=1, max_sequence_length=MSL)
    with pytest.raises(InvalidRequestError, match=r"num_frames must be 8k\+1.*try 9 or 17") as info:
        ours.generate(prompt=PROMPT, num_frames=12, **base)
    assert info.value.param == "num_frames"
    with pytest.raises(InvalidRequestError, match="multiple of 32"):
        ours.generate(prompt=PROMPT, num_frames=9, **{**base, "height": 48})
    with pytest.raises(InvalidRequestError, match="height must be at least 64") as info:
        ours.generate(prompt=PROMPT, num_frames=9, **{**base, "height": 32})  # one latent row
    assert info.value.param == "height"
    with pytest.raises(InvalidRequestError, match="registers"):
        ours.generate(prompt=PROMPT, num_frames=9, **{**base, "max_sequence_length": 20})
    with pytest.raises(InvalidRequestError, match="stg_scal.*allowed"):
        ours.generate(prompt=PROMPT, num_frames=9, extra={"stg_scal": 1.0}, **base)
    # STG on without blocks: Diffusers' check_inputs refuses it (diffserve ran it without STG).
    with pytest.raises(
        InvalidRequestError, match=r"guidance_blocks'\] is empty while spatio-temporal guidance"
    ):
        ours.generate(prompt=PROMPT, num_frames=9, extra={"spatio_temporal_guidance_blocks": []}, **base)
    # No audio latent in the clip (round(1 / 50 * 25) = 0): Diffusers and the audio VAE fail deep inside.
    with pytest.raises(
        InvalidRequestError, match="too short for LTX-2's soundtrack.*fps of at most 49"
    ) as info:
        ours.generate(prompt=PROMPT, num_frames=1, fps=50, **base)
    assert info.value.param == "fps"


@pytest.mark.parametrize(
    ("dit_keys", "scheduler_keys", "named"),
    [
        ({"patch_size": 2}, {}, "patch_size=2"),
        ({"audio_patch_size_t": 2}, {}, "audio_patch_size_t=2"),
        (
            {"in_channels": 4, "out_channels": 4},
            {},
            r"in_channels=4 differs from the video VAE's latent_channels \(8\)",
        ),
        ({"audio_out_channels": 4}, {}, r"audio_out_channels=4 differs from the audio VAE's latent_channels"),
        ({}, {"invert_sigmas": True}, "invert_sigmas=True"),
    ],
)
def test_ltx2_refuses_a_folder_diffusers_cannot_run(t2v, dit_keys, scheduler_keys, named) -> None:
    """Configs on which Diffusers' pipelines fail mid-generation (shape errors) or return NaN (a schedule
    from sigma 0) are refused at load, naming the key; `audio_patch_size` (mel) is read by neither."""
    ours, _ = t2v
    stage = next(s for s in ours.pipeline.stages if type(s).__name__ == "LTX2DecodingStage")
    transformer = ours.pipeline.denoiser.transformer
    folder_scheduler = ours.pipeline.denoiser.scheduler.config
    check_ltx2_folder(transformer, stage.vae, stage.audio_vae, folder_scheduler)  # the test folder fits
    check_ltx2_folder(
        SimpleNamespace(config=replace(transformer.config, audio_patch_size=2)),
        stage.vae,
        stage.audio_vae,
        {},
    )
    changed = SimpleNamespace(config=replace(transformer.config, **dit_keys))
    with pytest.raises(ModelLoadError, match=named):
        check_ltx2_folder(changed, stage.vae, stage.audio_vae, {**folder_scheduler, **scheduler_keys})


@pytest.mark.parametrize(
    ("video", "audio", "multiple"),
    [(8, 8, 8), (8, 16, 16), (None, 8, 8), (8, None, 8), (6, 4, 12), (None, None, None)],
)
def test_ltx2_text_length_fits_both_connectors_registers(video, audio, multiple) -> None:
    """Each connector tiles the padding with its registers and fails on a length they do not divide (in
    Diffusers too): requests are checked against both connectors', not only the video one's."""
    config = SimpleNamespace(
        video_connector_num_learnable_registers=video, audio_connector_num_learnable_registers=audio
    )
    assert register_multiple(config) == multiple


def test_ltx2_timestep_conditioned_vae_decodes_as_diffusers(tmp_path) -> None:
    """A decoder that takes the decode timestep: noise mixed in at `decode_noise_scale` (default: the
    timestep), drawn from the request's generator after the denoising loop."""
    root = build_tiny_ltx2(tmp_path / "ltx2-tc", TinyLTX2Spec(timestep_conditioning=True))
    reference = LTX2Pipeline.from_pretrained(root, dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, batch_policy="throughput")
    extra = {"decode_timestep": 0.05, "decode_noise_scale": 0.025}
    kwargs = dict(height=64, width=96, num_frames=9, num_inference_steps=2, guidance_scale=3.0)
    out = ours.generate(prompt=PROMPT, seed=2, max_sequence_length=MSL, extra=extra, **kwargs)
    ref = reference(
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(2),
        output_type="np",
        frame_rate=24.0,
        max_sequence_length=MSL,
        **extra,
        **kwargs,
    )
    _compare(out, ref, 9, 64, 96, f"T2V decode {extra}")


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    root = build_tiny_ltx2(tmp_path_factory.mktemp("ltx2-i2v"), TinyLTX2Spec(image_to_video=True))
    return generator_and_reference(DiffGenerator, root, LTX2ImageToVideoPipeline)


def test_ltx2_i2v_matches_diffusers(i2v) -> None:
    ours, reference = i2v
    image = gradient_image(width=90, height=50)
    kwargs = dict(height=64, width=96, num_frames=9, num_inference_steps=3, guidance_scale=3.0)
    out = ours.generate(prompt=PROMPT, image=image, seed=4, max_sequence_length=MSL, extra=STG, **kwargs)
    ref = reference(
        image=image,
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(4),
        output_type="np",
        frame_rate=24.0,
        max_sequence_length=MSL,
        **STG,
        **kwargs,
    )
    _compare(out, ref, 9, 64, 96, "I2V")


def test_ltx2_i2v_refuses_an_image_too_small_to_recompress(i2v) -> None:
    """H.264 re-compression crops to even sides: a 1-pixel side leaves no frame (Diffusers fails in PyAV)."""
    ours, _ = i2v
    kwargs = dict(height=64, width=64, num_frames=9, num_inference_steps=1, max_sequence_length=MSL)
    with pytest.raises(InvalidRequestError, match=r"input image is 1x40.*image_crf 33") as info:
        ours.generate(prompt=PROMPT, image=gradient_image(width=1, height=40), **kwargs)
    assert info.value.param == "image"
    out = ours.generate(
        prompt=PROMPT, image=gradient_image(width=1, height=40), extra={"image_crf": 0}, **kwargs
    )
    assert len(out.frames) == 1
