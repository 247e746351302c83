"""Whole HunyuanVideo image-to-video generations: diffserve against Diffusers'
`HunyuanVideoImageToVideoPipeline`, same tiny folder, image and seed, fp32.

Both DiT kinds: "token_replace" (guidance-distilled; the first latent frame is the image's) and
"latent_concat" (image latents and mask on channels; 4 decoded frames dropped). Each case compares the
final latents in dB and the decoded frames as uint8 PSNR, with a control (another prompt) that must fall
below the bar and another image that must move the latents far from it: embedded guidance alone, true CFG with a negative prompt (read with a black image and more
image tokens than the prompt under token_replace: the branches' texts are padded to one length),
non-square sizes and images, truncated prompts; the Llava text encoding alone; 2 outputs per prompt (each
Diffusers' video from that output's noise); two requests sharing steps equal each alone. The "latent_concat"
folder holds other checkpoint values than the released ones (`OTHER_CONFIG`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import HunyuanVideoImageToVideoPipeline as DiffusersHunyuanVideoI2V

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.hunyuan_video.folder_checks import check_hunyuan_video_folder
from diffserve.families.hunyuan_video.image_to_video_tiny import (
    TinyHunyuanVideoI2VSpec,
    build_tiny_hunyuan_video_i2v,
)
from diffserve.models.dits.hunyuan_video import HunyuanVideoTransformerConfig
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    assert_parity,
    diffusers_uint8,
    gradient_image,
    smooth_random_image,
    snr_db,
    to_uint8,
)
from diffserve.testing.video_parity import (
    diffusers_latents_and_frames,
    final_latents_and_frames,
    folder_pairs,
)

LATENT_MIN_DB = 80.0
PSNR_BAR_DB = 40.0
PROMPT = "A red Fox running in the snow"
OTHER_PROMPT = "a blue bird on a branch"
#: Another input image must leave the latents below this SNR to the request's own (a change far above
#: rounding; the tiny VAE's latents are small, so under latent_concat it moves the frames less than a prompt).
IMAGE_CONTROL_DB = 60.0
IMAGE = smooth_random_image(width=40, height=30, seed=1)
OTHER_IMAGE = gradient_image(width=40, height=30)


#: The "latent_concat" folder's other checkpoint values, all read by Diffusers: another latent width (so
#: DiT channels 2 * 8 + 1), a 3-level VAE of other scaling, groups and no mid-block attention, a DiT of
#: other heads, RoPE axes, MLP ratio, refiner and block counts, another scheduler shift and terminal sigma.
OTHER_CONFIG = {
    "latent_concat": dict(
        latent_channels=8,
        extra_dit_config={
            "num_attention_heads": 4,
            "attention_head_dim": 8,
            "rope_axes_dim": (2, 2, 4),
            "mlp_ratio": 2.5,
            "num_refiner_layers": 2,
            "num_layers": 2,
            "num_single_layers": 0,
        },
        extra_vae_config={
            "block_out_channels": (8, 16, 16),
            "norm_num_groups": 2,
            "mid_block_add_attention": False,
            "scaling_factor": 1.3,
        },
        extra_scheduler_config={"shift": 3.0, "shift_terminal": 0.05},
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return folder_pairs(
        lambda condition: tmp_path_factory.mktemp(f"hunyuan-video-i2v-{condition}"),
        lambda condition, root: build_tiny_hunyuan_video_i2v(
            root, TinyHunyuanVideoI2VSpec(image_condition_type=condition, **OTHER_CONFIG.get(condition, {}))
        ),
        DiffGenerator,
        DiffusersHunyuanVideoI2V,
    )


def _same_frames(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """diffserve's latents cut to the frames Diffusers returns."""
    return ours[:, :, ours.shape[2] - reference.shape[2] :]


CASES = [
    # (condition, height, width, frames, options)
    ("token_replace", 32, 48, 9, {"guidance_scale": 6.0, "max_sequence_length": 40}),
    (
        "token_replace",
        48,
        32,
        5,
        {
            "true_cfg_scale": 4.0,
            "negative_prompt": "blurry",
            "guidance_scale": 3.5,
            "max_sequence_length": 24,
        },
    ),
    # A prompt longer than its 6 tokens: the assistant header is truncated away.
    ("token_replace", 32, 32, 5, {"max_sequence_length": 6}),
    ("latent_concat", 32, 48, 9, {"max_sequence_length": 40}),
    ("latent_concat", 48, 32, 5, {"true_cfg_scale": 2.5, "negative_prompt": "", "max_sequence_length": 32}),
]


@pytest.mark.parametrize(("condition", "height", "width", "frames", "options"), CASES)
def test_hunyuan_video_i2v_matches_diffusers(folders, condition, height, width, frames, options) -> None:
    ours, reference = folders(condition)
    seed = 3
    common = dict(height=height, width=width, num_inference_steps=2, num_frames=frames, **options)
    params = SamplingParams(prompt=PROMPT, input_images=[IMAGE], seed=seed, **common)
    got_latents, got = final_latents_and_frames(ours, params)
    want_latents, want = diffusers_latents_and_frames(reference, seed, image=IMAGE, prompt=PROMPT, **common)
    label = f"HunyuanVideo I2V {condition} {frames}x{height}x{width} {options}"
    db = assert_parity(
        _same_frames(got_latents, want_latents), want_latents, f"{label} latents", min_db=LATENT_MIN_DB
    )
    control = np.stack(ours.generate_from_params(replace(params, prompt=OTHER_PROMPT)).frames)
    pixels = assert_images_match(got, want, label, min_db=PSNR_BAR_DB, control=control)
    image_control = snr_db(
        final_latents_and_frames(ours, replace(params, input_images=[OTHER_IMAGE]))[0], got_latents
    )
    assert image_control < IMAGE_CONTROL_DB, (
        f"{label}: another image leaves the latents at {image_control:.1f} dB"
    )
    print(
        f"{label}: latents {db}, frames {pixels:.1f} dB PSNR against Diffusers; other image {image_control:.1f} dB"
    )


def test_image_embed_interleave_matches_diffusers(folders) -> None:
    """Diffusers' `image_embed_interleave` as `extra`: every image token (1) for the prompt, while the
    negative prompt keeps its interleave of 2 under true CFG; bad values are refused naming `extra`."""
    ours, reference = folders("token_replace")
    common = dict(
        height=32, width=32, num_inference_steps=1, num_frames=5, max_sequence_length=16,
        true_cfg_scale=2.0, negative_prompt="dark",
    )  # fmt: skip
    extra = {"image_embed_interleave": 1}
    got = np.stack(ours.generate(prompt=PROMPT, image=IMAGE, seed=1, extra=extra, **common).frames)
    want = diffusers_uint8(
        reference, seed=1, video=True, image=IMAGE, prompt=PROMPT, image_embed_interleave=1, **common
    )
    default = np.stack(ours.generate(prompt=PROMPT, image=IMAGE, seed=1, **common).frames)
    assert_images_match(
        got, want, "HunyuanVideo I2V image_embed_interleave=1", min_db=PSNR_BAR_DB, control=default
    )
    for bad in ({"image_embed_interleave": -1}, {"image_embed_interleave": 2.5}, {"interleave": 2}):
        with pytest.raises(InvalidRequestError, match="extra"):
            ours.generate(prompt=PROMPT, image=IMAGE, extra=bad, **common)


@pytest.mark.parametrize("interleave", [2, 4])
def test_text_encoding_matches_diffusers(folders, interleave) -> None:
    ours, reference = folders("token_replace")
    stage = ours.pipeline.stages[1]
    for prompt, msl in (("A Red fox", 256), ("A Red fox jumps over the lazy dog", 7), ("", 16)):
        want, want_pooled, want_mask = reference.encode_prompt(
            image=IMAGE, prompt=prompt, max_sequence_length=msl, image_embed_interleave=interleave
        )
        got, mask, pooled = stage.encode_with_image(prompt, IMAGE, msl, interleave)
        assert got.shape[1] == 576 // interleave + msl - 4
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(pooled, want_pooled, rtol=0, atol=0)
        assert torch.equal(mask, want_mask.bool())
    other, _, _ = stage.encode_with_image("A Red fox", OTHER_IMAGE, 256, interleave)
    assert (other - stage.encode_with_image("A Red fox", IMAGE, 256, interleave)[0]).abs().max() > 1e-3


def test_two_outputs_per_prompt_match(folders) -> None:
    """Diffusers' pipeline makes one video per call; each of diffserve's two is the one Diffusers makes
    from that output's rows of the noise (drawn together, as diffserve draws them)."""
    ours, reference = folders("token_replace")
    common = dict(height=32, width=48, num_inference_steps=2, num_frames=5, max_sequence_length=20)
    params = SamplingParams(prompt=PROMPT, input_images=[IMAGE], num_outputs_per_prompt=2, seed=2, **common)
    got_latents, got = final_latents_and_frames(ours, params)
    noise = torch.randn(2, 4, 2, 4, 6, generator=torch.Generator("cpu").manual_seed(2))
    for i in range(2):
        out = reference(image=IMAGE, prompt=PROMPT, latents=noise[i : i + 1], output_type="latent", **common)
        assert_parity(
            got_latents[i : i + 1], out.frames, f"HunyuanVideo I2V output {i}", min_db=LATENT_MIN_DB
        )
        frames = to_uint8(
            reference(image=IMAGE, prompt=PROMPT, latents=noise[i : i + 1], output_type="np", **common).frames
        )
        assert_images_match(got[i : i + 1], frames, f"HunyuanVideo I2V output {i} frames", min_db=PSNR_BAR_DB)


def test_requests_share_steps_and_match_each_alone(folders) -> None:
    ours, _ = folders("token_replace")
    common = dict(height=32, width=48, num_frames=5, max_sequence_length=20)
    params = [
        SamplingParams(
            prompt="a cat",
            input_images=[IMAGE],
            seed=5,
            num_inference_steps=3,
            true_cfg_scale=3.0,
            negative_prompt="dark",
            **common,
        ),
        SamplingParams(
            prompt="a boat on a lake",
            input_images=[OTHER_IMAGE],
            seed=6,
            num_inference_steps=2,
            guidance_scale=4.0,
            **common,
        ),
    ]
    step_sizes = assert_batched_as_alone(ours, params, "HunyuanVideo I2V", video=True)
    assert step_sizes[0] == 2


def test_requests_without_an_image_or_frames_are_refused(folders) -> None:
    ours, _ = folders("latent_concat")
    with pytest.raises(InvalidRequestError, match="image"):
        ours.generate(prompt=PROMPT, num_frames=5, height=32, width=32)
    with pytest.raises(InvalidRequestError, match="num_frames"):
        ours.generate(prompt=PROMPT, image=IMAGE, num_frames=1, height=32, width=32)


def test_folder_check_reads_the_condition_type() -> None:
    """The load-time check: "latent_concat" feeds the DiT 2 * latent + 1 channels, "token_replace" the
    latents' own; a text-to-video pipeline feeds the latents' own to either."""
    concat = HunyuanVideoTransformerConfig(
        in_channels=9, out_channels=4, text_embed_dim=32, pooled_projection_dim=16,
        image_condition_type="latent_concat",
    )  # fmt: skip
    check_hunyuan_video_folder(concat, {"latent_channels": 4}, 32, 16, image_to_video=True)
    with pytest.raises(ModelLoadError, match="in_channels=9.*4 channels"):
        check_hunyuan_video_folder(concat, {"latent_channels": 4}, 32, 16, image_to_video=False)
    replace_ = HunyuanVideoTransformerConfig(
        in_channels=4, out_channels=4, text_embed_dim=32, pooled_projection_dim=16,
        image_condition_type="token_replace",
    )  # fmt: skip
    check_hunyuan_video_folder(replace_, {"latent_channels": 4}, 32, 16, image_to_video=True)
    with pytest.raises(ModelLoadError, match="text_embed_dim=32 differs.*pooled_projection_dim=16 differs"):
        check_hunyuan_video_folder(replace_, {"latent_channels": 4}, 48, 24, image_to_video=True)
