"""Whole HunyuanVideo generations: diffserve against Diffusers' `HunyuanVideoPipeline`, same tiny folder and
seed, fp32.

Each case compares the final latents (before decoding) in dB and the decoded frames as uint8 PSNR, with a
control (another prompt) that must fall below the bar: embedded guidance alone (true CFG off, and off
without a negative prompt even at true_cfg_scale > 1), true CFG with a negative prompt, non-square sizes,
a shorter text length, a clip long enough for the VAE's frame chunks, 2 outputs per prompt; the text encoding (states, mask, pooled) alone; two requests
at different steps and CFG sharing steps equal each alone; a folder of other checkpoint values (no guidance
embedding, other DiT, VAE, scheduler and text-encoder shapes); a folder whose components disagree refused
at load.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import HunyuanVideoPipeline as DiffusersHunyuanVideo
from video_case_checks import VideoBars

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.hunyuan_video.tiny import TinyHunyuanVideoSpec, build_tiny_hunyuan_video
from diffserve.testing.parity import assert_batched_as_alone, assert_images_match, assert_parity
from diffserve.testing.video_parity import (
    diffusers_latents_and_frames,
    final_latents_and_frames,
    folder_pairs,
)

LATENT_MIN_DB = 80.0
PSNR_BAR_DB = 40.0
BARS = VideoBars(LATENT_MIN_DB, PSNR_BAR_DB)
PROMPT = "A red Fox running in the snow"
OTHER_PROMPT = "a blue bird on a branch"

#: Values a checkpoint may hold besides the released ones, all read by Diffusers: no guidance embedding,
#: 1x1 patches, other heads, RoPE axes and theta, MLP ratio and refiner depth; a 16x VAE of other latent
#: width, depth, groups and scaling, without mid-block attention; another scheduler shift with a terminal
#: sigma; wider text encoders with another layer.
OTHER_CONFIG = TinyHunyuanVideoSpec(
    guidance_embeds=False,
    latent_channels=8,
    text_dim=48,
    text_layers=4,
    pooled_dim=24,
    seed=1,
    extra_dit_config={
        "patch_size": 1,
        "num_attention_heads": 4,
        "attention_head_dim": 8,
        "rope_axes_dim": (2, 2, 4),
        "rope_theta": 1000.0,
        "mlp_ratio": 2.5,
        "num_refiner_layers": 2,
    },
    extra_vae_config={
        "block_out_channels": (8, 16, 16),
        "spatial_compression_ratio": 16,
        "layers_per_block": 2,
        "norm_num_groups": 8,
        "mid_block_add_attention": False,
        "scaling_factor": 1.3,
    },
    extra_scheduler_config={"shift": 2.0, "shift_terminal": 0.1},
)

FOLDERS = {"default": TinyHunyuanVideoSpec(), "other-config": OTHER_CONFIG}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return folder_pairs(
        lambda name: tmp_path_factory.mktemp(f"hunyuan-video-{name}"),
        lambda name, root: build_tiny_hunyuan_video(root, FOLDERS[name]),
        DiffGenerator,
        DiffusersHunyuanVideo,
    )


CASES = [
    # (folder, height, width, frames, steps, options)
    ("default", 32, 48, 5, 2, {"guidance_scale": 6.0}),
    ("default", 48, 32, 9, 2, {"true_cfg_scale": 4.0, "negative_prompt": "blurry", "guidance_scale": 3.5}),
    ("default", 32, 32, 1, 2, {"true_cfg_scale": 4.0, "max_sequence_length": 24}),
    # 6 latent frames: the VAE decodes in Diffusers' overlapping frame chunks.
    ("default", 32, 32, 21, 2, {"guidance_scale": 6.0}),
    ("other-config", 32, 48, 5, 2, {"true_cfg_scale": 2.5, "negative_prompt": ""}),
]


@pytest.mark.parametrize(("folder", "height", "width", "frames", "steps", "options"), CASES)
def test_hunyuan_video_matches_diffusers(folders, folder, height, width, frames, steps, options) -> None:
    ours, reference = folders(folder)
    common = dict(height=height, width=width, num_inference_steps=steps, num_frames=frames, **options)
    label = f"HunyuanVideo {folder} {frames}x{height}x{width} {steps} steps {options}"
    db, pixels = BARS.assert_video_matches(ours, reference, label, PROMPT, OTHER_PROMPT, 3, **common)
    print(f"{label}: latents {db}, frames {pixels:.1f} dB PSNR against Diffusers")


def test_two_outputs_per_prompt_match(folders) -> None:
    ours, reference = folders("default")
    common = dict(height=32, width=48, num_inference_steps=2, num_frames=5, true_cfg_scale=3.0)
    BARS.assert_two_outputs_match(ours, reference, "HunyuanVideo", PROMPT, "ugly", 2, **common)


def test_text_encoding_matches_diffusers(folders) -> None:
    ours, reference = folders("default")
    stage = ours.pipeline.stages[1]
    for prompt, msl in (("A Red fox", 256), ("A Red fox jumps", 7), ("", 16)):
        want, want_pooled, want_mask = reference.encode_prompt(prompt, max_sequence_length=msl)
        ((got, mask, pooled),) = stage.encode([prompt], msl)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pooled, want_pooled, rtol=1e-5, atol=1e-6)
        assert torch.equal(mask, want_mask.bool())


def test_requests_share_steps_and_match_each_alone(folders) -> None:
    ours, _ = folders("default")
    common = dict(height=32, width=48, num_frames=5)
    params = [
        SamplingParams(
            prompt="a cat",
            seed=5,
            num_inference_steps=3,
            true_cfg_scale=3.0,
            negative_prompt="dark",
            **common,
        ),
        SamplingParams(
            prompt="a boat on a lake", seed=6, num_inference_steps=2, guidance_scale=4.0, **common
        ),
    ]
    step_sizes = assert_batched_as_alone(ours, params, "HunyuanVideo", video=True)
    assert step_sizes[0] == 2


def test_frame_count_is_checked(folders) -> None:
    ours, _ = folders("default")
    with pytest.raises(InvalidRequestError, match="num_frames"):
        ours.generate(prompt=PROMPT, num_frames=6, height=32, width=32)


def test_bfloat16_matches_diffusers(tmp_path) -> None:
    """In bfloat16 too: the guidance rounded in the DiT's dtype, the timesteps in the latents' (float32 at
    the first step, bfloat16 after it), the Euler step in float32 leaving bfloat16 latents. The latents are
    held to 30 dB only: one bf16 DiT forward is ~70 dB from Diffusers' (CPU kernels round differently), and
    diffserve runs the CFG branches as one batch of two where Diffusers runs two forwards (another CPU
    rounding), which true CFG (x3) and three steps of a random tiny DiT amplify; the frames meet the bar."""
    root = build_tiny_hunyuan_video(tmp_path, TinyHunyuanVideoSpec())
    reference = DiffusersHunyuanVideo.from_pretrained(root, dtype=torch.bfloat16)
    reference.set_progress_bar_config(disable=True)
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, dtype="bfloat16")
    common = dict(
        height=32, width=48, num_inference_steps=3, num_frames=5, true_cfg_scale=3.0, negative_prompt="dark"
    )
    got_latents, got = final_latents_and_frames(ours, SamplingParams(prompt=PROMPT, seed=3, **common))
    assert got_latents.dtype == torch.bfloat16
    want_latents, want = diffusers_latents_and_frames(reference, 3, prompt=PROMPT, **common)
    db = assert_parity(got_latents.float(), want_latents.float(), "HunyuanVideo bf16 latents", min_db=30.0)
    pixels = assert_images_match(got, want, "HunyuanVideo bf16 frames", min_db=PSNR_BAR_DB)
    print(f"HunyuanVideo bf16: latents {db}, frames {pixels:.1f} dB")


def test_folder_whose_components_disagree_is_refused(tmp_path) -> None:
    """A DiT whose channels are not the VAE's latent channels (Diffusers fails mid-generation on a shape)."""
    root = build_tiny_hunyuan_video(tmp_path, TinyHunyuanVideoSpec(extra_vae_config={"latent_channels": 8}))
    with pytest.raises(ModelLoadError, match="in_channels=4.*latent_channels=8"):
        DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
