"""Whole HunyuanVideo 1.5 generations: diffserve against Diffusers' HunyuanVideo15Pipeline and
HunyuanVideo15ImageToVideoPipeline on the same tiny folder and seed, every frame compared as uint8
(PSNR >= 40 dB): CFG on (the folder guider's default scale, a negative prompt, quoted text for the glyph
encoder) and off, non-square sizes, image-to-video (a MeanFlow DiT) from a non-square image at its default
bucket size, its folder of other checkpoint values than the released ones (`I2V_OTHER_CONFIG`). Also: the
text encoders' outputs against Diffusers' `encode_prompt`, the guider's arithmetic against Diffusers'
`ClassifierFreeGuidance`, two requests sharing denoising steps, the preview, the default sizes, the 4k+1
frame rule and a folder whose components disagree refused at load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance as DiffusersCFG

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.hunyuan_video15.folder_checks import check_hunyuan_video15_folder
from diffserve.families.hunyuan_video15.text_encoding import HunyuanVideo15TextEncodingStage
from diffserve.families.hunyuan_video15.tiny import TinyHunyuanVideo15Spec, build_tiny_hunyuan_video15
from diffserve.models.dits.hunyuan_video15 import HunyuanVideo15TransformerConfig
from diffserve.models.guiders.classifier_free_guidance import ClassifierFreeGuidance
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8 as psnr
from diffserve.testing.parity import (
    assert_images_match,
    generator_and_reference,
    gradient_image,
    max_pixel_diff,
    to_uint8,
)

PSNR_BAR_DB = 40.0
PROMPT = 'a neon sign that says "OPEN" above a door'


def _compare(ours: list[np.ndarray], ref: np.ndarray, shape: tuple[int, ...], what: str) -> None:
    label = f"HunyuanVideo 1.5 {what}"
    assert_images_match(np.stack(ours), to_uint8(ref), label, min_db=PSNR_BAR_DB, shape=shape)


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    root = build_tiny_hunyuan_video15(tmp_path_factory.mktemp("hv15-t2v"))
    return generator_and_reference(DiffGenerator, root, HunyuanVideo15Pipeline)


#: The CFG request of the T2V parity test, also one of the two requests of the batching test.
CFG_PARAMS = SamplingParams(
    prompt=PROMPT,
    seed=3,
    height=48,
    width=80,
    num_frames=5,
    num_inference_steps=2,
    negative_prompt="blurry, dark",
)

#: A one-step request without CFG: the other request of the batching test, and the preview test's.
PLAIN_PARAMS = SamplingParams(
    prompt="a quiet lake",
    seed=8,
    height=48,
    width=80,
    num_frames=5,
    num_inference_steps=1,
    guidance_scale=1.0,
)


@pytest.fixture(scope="module")
def cfg_frames(t2v) -> np.ndarray:
    """diffserve's video for CFG_PARAMS, generated alone."""
    ours, _ = t2v
    out = ours.generate_many([CFG_PARAMS])[0]
    assert out.params.guidance_scale == 6.0  # the folder guider's scale: CFG on
    return np.stack(out.frames)


def test_t2v_with_cfg_matches_diffusers(t2v, cfg_frames) -> None:
    _, reference = t2v
    p = CFG_PARAMS
    ref = reference(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        height=p.height,
        width=p.width,
        num_frames=p.num_frames,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        output_type="np",
    )
    _compare(list(cfg_frames), ref.frames, (1, 5, 48, 80, 3), "T2V CFG 48x80")


def test_t2v_without_cfg_matches_diffusers(t2v) -> None:
    ours, reference = t2v
    kwargs = dict(height=64, width=32, num_frames=5, num_inference_steps=1)
    out = ours.generate(prompt="a “quiet” lake at dawn", seed=5, guidance_scale=1.0, **kwargs)
    guider = reference.guider
    reference.guider = guider.new(guidance_scale=1.0)  # Diffusers' pipelines take the scale from the guider
    try:
        ref = reference(
            prompt="a “quiet” lake at dawn",
            generator=torch.Generator("cpu").manual_seed(5),
            output_type="np",
            **kwargs,
        )
    finally:
        reference.guider = guider
    _compare(out.frames, ref.frames, (1, 5, 64, 32, 3), "T2V no CFG 64x32")


def test_t2v_two_outputs_per_prompt_match_diffusers(t2v) -> None:
    """Diffusers' text-to-video pipeline fails on several videos per prompt (its zero image states have one
    row per prompt); each of diffserve's two is the video Diffusers makes from that output's rows of the
    noise (drawn together, as diffserve draws them)."""
    ours, reference = t2v
    kwargs = dict(height=16, width=32, num_frames=1, num_inference_steps=1, negative_prompt="dark")
    out = ours.generate(prompt=PROMPT, seed=6, num_outputs_per_prompt=2, **kwargs)
    noise = torch.randn(2, 8, 1, 1, 2, generator=torch.Generator("cpu").manual_seed(6))
    ref = np.concatenate(
        [
            reference(prompt=PROMPT, latents=noise[i : i + 1], output_type="np", **kwargs).frames
            for i in range(2)
        ]
    )
    _compare(out.frames, ref, (2, 1, 16, 32, 3), "T2V 2 per prompt")


def test_text_encoding_matches_diffusers_encode_prompt(t2v) -> None:
    ours, reference = t2v
    stage = next(s for s in ours.pipeline.stages if isinstance(s, HunyuanVideo15TextEncodingStage))
    prompts = [PROMPT, 'say "hi" and "hi" and “bye”', "", "no quotes at all"]
    got = stage.encode(prompts)
    for prompt, mine in zip(prompts, got, strict=True):
        # Diffusers encodes a missing negative prompt as "" (read as " ").
        theirs = reference.encode_prompt(prompt=prompt or None, device="cpu", dtype=torch.float32)
        for name, a, b in zip(("states", "mask", "glyph states", "glyph mask"), mine, theirs, strict=True):
            assert a.shape == b.shape, (prompt, name)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name} of {prompt!r}")
    assert (
        got[1].glyph_mask.sum() > 0 and got[3].glyph_mask.sum() == 0 and got[3].glyph_states.abs().sum() == 0
    )


@pytest.mark.parametrize(
    "config",
    [
        {"guidance_scale": 6.0},
        {"guidance_scale": 4.0, "guidance_rescale": 0.7},
        {"guidance_scale": 3.0, "use_original_formulation": True},
        {"guidance_scale": 1.0, "guidance_rescale": 0.5},  # no CFG, rescaled anyway
        {"guidance_scale": 5.0, "enabled": False},
    ],
)
def test_guider_matches_diffusers(config) -> None:
    ours, theirs = ClassifierFreeGuidance.from_config(config), DiffusersCFG(**config)
    gen = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(2, 8, 3, 4, 5, generator=gen), torch.randn(2, 8, 3, 4, 5, generator=gen)
    theirs.set_state(step=0, num_inference_steps=4, timestep=torch.tensor(999.0))
    assert ours.runs_cfg(config["guidance_scale"]) == (theirs.num_conditions == 2)
    expected = theirs.forward(cond, uncond if theirs.num_conditions == 2 else None).pred
    if ours.runs_cfg(config["guidance_scale"]):
        got = ours.guide(cond, uncond, config["guidance_scale"])
    else:
        got = ours.rescaled(cond, cond)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_guider_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="start=0.2"):
        ClassifierFreeGuidance.from_config({"guidance_scale": 6.0, "start": 0.2})
    with pytest.raises(ValueError, match="unknown keys"):
        ClassifierFreeGuidance.from_config({"guidance_scale": 6.0, "adaptive": True})


def test_two_requests_sharing_steps_equal_each_alone(t2v, cfg_frames) -> None:
    """A CFG request of two steps and a request without CFG of one step share the first step."""
    ours, _ = t2v
    plain = PLAIN_PARAMS
    alone = [cfg_frames, np.stack(ours.generate_many([plain])[0].frames)]
    counts = ours.engine.scheduler.batch_size_counts
    shared_before = sum(n for size, n in counts.items() if size >= 2)
    together = [np.stack(out.frames) for out in ours.generate_many([CFG_PARAMS, plain])]
    assert sum(n for size, n in counts.items() if size >= 2) > shared_before, (
        "the requests never shared a step"
    )
    for a, b in zip(alone, together, strict=True):
        diff = max_pixel_diff(a, b)
        print(f"batched vs alone: max diff {diff}, PSNR {psnr(a, b):.1f} dB")
        assert diff <= 1


def test_preview_after_the_last_step_is_the_first_frame(t2v) -> None:
    """After the last step the predicted clean latents are the final ones: the preview (first latent frame
    decoded alone, which the causal VAE allows) is the video's first frame."""
    pipeline = t2v[0].pipeline
    req = pipeline.run_pre_denoise(pipeline.validate(Req(params=PLAIN_PARAMS)))
    pipeline.denoise_step([req])
    preview = pipeline.preview_images(req)
    first_frame = pipeline.run_post_denoise(req).outputs.frames[0][0]
    assert len(preview) == 1 and preview[0].size == (80, 48)
    diff = max_pixel_diff(np.asarray(preview[0]), first_frame)
    assert diff <= 1, diff


def test_bad_frame_counts_and_params_are_refused(t2v) -> None:
    ours, _ = t2v
    with pytest.raises(InvalidRequestError, match=r"num_frames must be 4k\+1.*try 5 or 9") as info:
        ours.generate(prompt=PROMPT, num_frames=8, height=32, width=32, num_inference_steps=1)
    assert info.value.param == "num_frames"
    for bad in ({"true_cfg_scale": 3.0}, {"max_sequence_length": 64}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            ours.generate(prompt=PROMPT, num_frames=5, height=32, width=32, num_inference_steps=1, **bad)
    # One side alone: Diffusers refuses it too (the default size is a bucket of both sides).
    for side, missing in (({"height": 32}, "width"), ({"width": 32}, "height")):
        with pytest.raises(InvalidRequestError, match="height and width together") as info:
            ours.generate(prompt=PROMPT, num_frames=5, num_inference_steps=1, **side)
        assert info.value.param == missing


def test_t2v_default_size_is_the_16_9_bucket(t2v) -> None:
    ours, reference = t2v
    params = ours.pipeline.resolve_params(SamplingParams(prompt=PROMPT))
    expected = reference.video_processor.calculate_default_height_width(9, 16, reference.target_size)
    assert (params.height, params.width) == tuple(expected) == (48, 80)
    assert (params.num_frames, params.num_inference_steps, params.fps) == (121, 50, 24)


#: The image-to-video folder's values besides the released ones, all read by Diffusers: 16 latent channels
#: (DiT channels 2 * 16 + 1), a DiT of other heads, RoPE axes and MLP ratio, other glyph and image encoder
#: widths, another scheduler shift with a terminal sigma, a guider that rescales. (The Qwen2.5-VL text
#: encoder, which reads 1108 tokens per prompt and is most of the test's time, keeps its tiny shape.)
I2V_OTHER_CONFIG = TinyHunyuanVideo15Spec(
    image_to_video=True,
    use_meanflow=True,
    seed=1,
    latent_channels=16,
    num_attention_heads=4,
    attention_head_dim=8,
    rope_axes_dim=(2, 2, 4),
    glyph_hidden_size=24,
    image_hidden_size=24,
    extra_dit_config={"mlp_ratio": 2.5},
    extra_scheduler_config={"shift": 3.0, "shift_terminal": 0.1},
    extra_guider_config={"guidance_rescale": 0.5},
)


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    root = build_tiny_hunyuan_video15(tmp_path_factory.mktemp("hv15-i2v"), I2V_OTHER_CONFIG)
    return generator_and_reference(DiffGenerator, root, HunyuanVideo15ImageToVideoPipeline)


def test_i2v_matches_diffusers(i2v) -> None:
    """A MeanFlow DiT (as the step-distilled I2V checkpoints): every step also reads the next timestep. Two
    videos of one prompt share the image conditioning and draw their noise together."""
    ours, reference = i2v
    assert ours.pipeline.denoiser.meanflow
    image = gradient_image(
        width=60, height=40
    )  # its bucket at the tiny DiT's target size: 48x64, a crop of the image
    kwargs = dict(num_frames=5, num_inference_steps=2, negative_prompt="static")
    out = ours.generate(prompt=PROMPT, image=image, seed=4, num_outputs_per_prompt=2, **kwargs)
    assert (out.params.height, out.params.width) == (48, 64)
    latents = reference(
        image=image,
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(4),
        output_type="latent",
        num_videos_per_prompt=2,
        **kwargs,
    ).frames
    # Diffusers' VAE decodes one video at a time (its mid-block attention mask breaks on a batch of two);
    # this is the pipeline's own decoding, row by row.
    with torch.no_grad():
        videos = [
            reference.vae.decode(row[None] / reference.vae.config.scaling_factor, return_dict=False)[0]
            for row in latents
        ]
    ref = np.concatenate([reference.video_processor.postprocess_video(v, output_type="np") for v in videos])
    _compare(out.frames, ref, (2, 5, 48, 64, 3), "I2V MeanFlow CFG 40x60 image -> 2x 48x64")


def test_i2v_takes_an_explicit_size(i2v) -> None:
    """Unlike Diffusers' pipeline, a request may set the size: the image is cropped to it."""
    ours, _ = i2v
    kwargs = dict(height=32, width=64, num_frames=5, num_inference_steps=1, guidance_scale=1.0)
    out = ours.generate(prompt=PROMPT, image=gradient_image(width=60, height=40), seed=1, **kwargs)
    assert np.stack(out.frames).shape == (1, 5, 32, 64, 3)


def test_folder_whose_components_disagree_is_refused() -> None:
    """The load-time check the pipelines run on their DiT, VAE and encoder widths (Diffusers fails
    mid-generation on a shape): a DiT whose output is not the VAE's latent channels (`out_channels` None:
    its 17 input channels), encoder widths other than the DiT's."""
    dit = HunyuanVideo15TransformerConfig(in_channels=17, out_channels=None, text_embed_dim=32)
    with pytest.raises(ModelLoadError, match="out_channels=17 differs from the VAE's latent_channels=8"):
        check_hunyuan_video15_folder(dit, {"latent_channels": 8}, 32, 1472, None)
    dit = HunyuanVideo15TransformerConfig(in_channels=17, out_channels=8, text_embed_dim=32)
    check_hunyuan_video15_folder(dit, {"latent_channels": 8}, 32, 1472, None)
    with pytest.raises(ModelLoadError, match="in_channels=17.*33 channels.*image_embed_dim=1152 differs"):
        check_hunyuan_video15_folder(dit, {"latent_channels": 16}, 32, 1472, 24)
