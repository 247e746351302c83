"""Whole CogVideoX generations: diffserve against Diffusers' `CogVideoXPipeline` and
`CogVideoXImageToVideoPipeline`, same tiny folder and seed, fp32.

Each case compares the final latents (before decoding, the 1.5 padding frames included) in dB and the decoded
frames as uint8 PSNR, over the released kinds of folder: CogVideoX 1.0-2B (sin-cos positions, DDIM), 1.0-5B
(RoPE, the stochastic DPM sampler drawing from the request's generator), 1.5 (RoPE over temporal patches,
frame padding), 1.0-5B-I2V (RoPE and learned positions; another clip length falls back to sin-cos as in
Diffusers) and 1.5-I2V (ofs embedding, the VAE's inverted latent scale); CFG on and off, `use_dynamic_cfg`,
several sizes and frame counts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import CogVideoXImageToVideoPipeline as DiffusersI2V
from diffusers import CogVideoXPipeline as DiffusersT2V

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    assert_parity,
    generator_and_reference,
    smooth_random_image,
    to_uint8,
)
from diffserve.testing.video_parity import diffusers_latents_and_frames, final_latents_and_frames

LATENT_MIN_DB = 70.0
PSNR_BAR_DB = 40.0
PROMPT = "A red Fox running in the snow"
OTHER_PROMPT = "a blue bird on a branch"

FOLDERS = {
    "1.0": TinyCogVideoXSpec(variant="1.0"),
    "1.0-rope": TinyCogVideoXSpec(variant="1.0-rope"),
    "1.5": TinyCogVideoXSpec(variant="1.5"),
    "1.5-ddim": TinyCogVideoXSpec(variant="1.5", scheduler="ddim", seed=1),
    "1.0-i2v": TinyCogVideoXSpec(variant="1.0", image_to_video=True),
    "1.5-i2v": TinyCogVideoXSpec(variant="1.5", image_to_video=True),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache: dict[str, tuple[DiffGenerator, object]] = {}

    def get(name: str):
        if name not in cache:
            spec = FOLDERS[name]
            root = build_tiny_cogvideox(tmp_path_factory.mktemp(f"cogvideox-{name}"), spec)
            reference_cls = DiffusersI2V if spec.image_to_video else DiffusersT2V
            cache[name] = generator_and_reference(DiffGenerator, root, reference_cls)
        return cache[name]

    return get


def _ours(gen: DiffGenerator, params: SamplingParams) -> tuple[torch.Tensor, np.ndarray]:
    """diffserve's final latents in Diffusers' layout (batch, frames, channels, h, w) and its uint8 frames."""
    latents, frames = final_latents_and_frames(gen, params)
    return latents.transpose(1, 2), frames


_reference = diffusers_latents_and_frames


CASES = [
    # (folder, height, width, frames, steps, image, options)
    ("1.0", 64, 80, 9, 3, False, {"guidance_scale": 6.0, "negative_prompt": "blurry"}),
    ("1.0", 48, 64, 13, 2, False, {"guidance_scale": 5.0, "use_dynamic_cfg": True}),
    ("1.0", 32, 48, 5, 2, False, {"guidance_scale": 1.0}),
    ("1.0-rope", 48, 64, 9, 3, False, {"guidance_scale": 6.0}),
    ("1.0-rope", 64, 48, 5, 4, False, {"guidance_scale": 1.0}),
    ("1.5", 64, 80, 9, 3, False, {"guidance_scale": 6.0, "use_dynamic_cfg": True}),  # 3 latent frames + 1
    ("1.5", 48, 64, 13, 3, False, {"guidance_scale": 4.0, "negative_prompt": "ugly"}),  # 4: no padding
    ("1.5-ddim", 64, 64, 17, 2, False, {"guidance_scale": 6.0}),  # 5 latent frames + 1
    ("1.0-i2v", 64, 80, 9, 3, True, {"guidance_scale": 6.0, "use_dynamic_cfg": True}),  # learned positions
    ("1.0-i2v", 64, 80, 13, 2, True, {"guidance_scale": 6.0}),  # another length: sin-cos, as in Diffusers
    ("1.5-i2v", 64, 80, 9, 3, True, {"guidance_scale": 6.0}),
    ("1.5-i2v", 48, 64, 13, 2, True, {"guidance_scale": 1.0}),
]


@pytest.mark.parametrize(("folder", "height", "width", "frames", "steps", "image", "options"), CASES)
def test_cogvideox_matches_diffusers(folders, folder, height, width, frames, steps, image, options) -> None:
    ours, reference = folders(folder)
    options = dict(options)
    dynamic = options.pop("use_dynamic_cfg", False)
    seed = 3
    common = dict(height=height, width=width, num_inference_steps=steps, **options)
    inputs = {"image": smooth_random_image(96, 80, seed=7)} if image else {}
    params = SamplingParams(
        prompt=PROMPT,
        seed=seed,
        num_frames=frames,
        input_images=[inputs["image"]] if image else None,
        extra={"use_dynamic_cfg": True} if dynamic else {},
        **common,
    )
    got_latents, got = _ours(ours, params)
    want_latents, want = _reference(
        reference, seed, prompt=PROMPT, num_frames=frames, use_dynamic_cfg=dynamic, **inputs, **common
    )
    label = (
        f"CogVideoX {folder} {'I2V' if image else 'T2V'} {frames}x{height}x{width} {steps} steps {options}"
    )
    if dynamic:
        label += " dynamic CFG"
    db = assert_parity(got_latents, want_latents, f"{label} latents", min_db=LATENT_MIN_DB)
    control_params = SamplingParams(**{**params.__dict__, "prompt": OTHER_PROMPT})
    control = np.stack(ours.generate_from_params(control_params).frames)
    pixels = assert_images_match(got, want, label, min_db=PSNR_BAR_DB, control=control)
    print(f"{label}: latents {db} , frames {pixels:.1f} dB PSNR against Diffusers")


def test_text_encoding_matches_diffusers(folders) -> None:
    ours, reference = folders("1.0")
    stage = ours.pipeline.stages[1]
    for msl in (226, 7):
        want, _ = reference.encode_prompt(
            "A Red fox", do_classifier_free_guidance=False, max_sequence_length=msl
        )
        torch.testing.assert_close(stage.encode(["A Red fox"], msl), want, rtol=1e-4, atol=1e-5)


def test_positions_need_the_full_text_length(folders) -> None:
    """A DiT that adds positions over its 226 text slots refuses another max_sequence_length (Diffusers' fails
    on the shapes); a RoPE DiT takes a shorter one."""
    sincos, _ = folders("1.0")
    with pytest.raises(InvalidRequestError, match="max_sequence_length must be 226"):
        sincos.generate(prompt=PROMPT, num_frames=5, height=32, width=32, max_sequence_length=64)
    rope, reference = folders("1.0-rope")
    kwargs = dict(height=32, width=48, num_inference_steps=2, guidance_scale=6.0, max_sequence_length=40)
    got = np.stack(rope.generate(prompt=PROMPT, num_frames=5, seed=2, **kwargs).frames)
    want = to_uint8(
        reference(
            prompt=PROMPT,
            num_frames=5,
            generator=torch.Generator().manual_seed(2),
            output_type="np",
            **kwargs,
        ).frames
    )
    assert_images_match(got, want, "CogVideoX RoPE, 40 text tokens", min_db=PSNR_BAR_DB)


@pytest.mark.parametrize(
    ("folder", "height", "width", "param"),
    [("1.5", 80, 64, "height"), ("1.5", 64, 96, "width"), ("1.0-i2v", 48, 80, "height")],
)
def test_sizes_the_positions_do_not_cover_are_refused(folders, folder, height, width, param) -> None:
    """CogVideoX 1.5's rotary positions cover the sample size's patch grid (64 x 80 here), and 1.0-I2V's
    learned ones that size only: another size is a clear request error, not a failure inside the denoising
    step (Diffusers fails in its DiT or refuses it in its forward)."""
    ours, _ = folders(folder)
    image = [smooth_random_image(32, 32, seed=1)] if folder.endswith("i2v") else None
    params = SamplingParams(prompt=PROMPT, height=height, width=width, num_frames=5, input_images=image)
    with pytest.raises(InvalidRequestError, match="positions") as info:
        ours.pipeline.resolve_params(params)
    assert info.value.param == param
    ours.pipeline.resolve_params(SamplingParams(prompt=PROMPT, num_frames=5, input_images=image))  # default


def test_several_videos_per_prompt(folders) -> None:
    """Diffusers' CogVideoX pipelines set num_videos_per_prompt to 1 whatever is passed; diffserve makes the
    videos asked for, their noise drawn together, so that with DDIM (deterministic after the first draw) the
    first is Diffusers' one video."""
    ours, reference = folders("1.0")
    kwargs = dict(height=32, width=48, num_frames=9, num_inference_steps=2, guidance_scale=6.0)
    got = np.stack(ours.generate(prompt=PROMPT, seed=2, num_outputs_per_prompt=2, **kwargs).frames)
    want = to_uint8(
        reference(
            prompt=PROMPT, generator=torch.Generator().manual_seed(2), output_type="np", **kwargs
        ).frames
    )
    assert got.shape == (2, 9, 32, 48, 3)
    assert_images_match(got[:1], want, "CogVideoX 1.0 first of two videos", min_db=PSNR_BAR_DB)
    assert psnr_uint8(got[1:], want) < PSNR_BAR_DB, "the second video repeats the first"


def test_requests_share_steps_and_match_each_alone(folders) -> None:
    """A CFG request and a no-CFG one at different step counts share their DiT steps (the DPM sampler keeps
    each request's generator); each video is within 1 level of the one it gets alone."""
    ours, _ = folders("1.5")
    common = dict(height=48, width=64, num_frames=9)
    params = [
        SamplingParams(prompt="a cat", seed=5, num_inference_steps=3, guidance_scale=5.0, **common),
        SamplingParams(
            prompt="a boat on a lake", seed=6, num_inference_steps=2, guidance_scale=1.0, **common
        ),
    ]
    step_sizes = assert_batched_as_alone(ours, params, "CogVideoX", video=True)
    assert step_sizes[0] == 2


def test_image_to_video_needs_one_image(folders) -> None:
    ours, _ = folders("1.0-i2v")
    with pytest.raises(InvalidRequestError, match="needs an input image"):
        ours.generate(prompt=PROMPT, num_frames=9)
    t2v, _ = folders("1.0")
    with pytest.raises(InvalidRequestError, match="takes no input image"):
        t2v.generate(prompt=PROMPT, num_frames=9, input_images=[smooth_random_image(32, 32, seed=1)])


@pytest.mark.parametrize(("variant", "image"), [("1.0", False), ("1.5", True)])
def test_bfloat16_latents_match_diffusers(tmp_path, variant: str, image: bool) -> None:
    """In bfloat16 too: the latents stay in the model's dtype between steps and the samplers' coefficients are
    rounded to it where Diffusers' coefficient tensors are (DDIM for 1.0-2B, the stochastic DPM for 1.5-I2V)."""
    root = build_tiny_cogvideox(tmp_path, TinyCogVideoXSpec(variant=variant, image_to_video=image))
    reference_cls = DiffusersI2V if image else DiffusersT2V
    reference = reference_cls.from_pretrained(root, torch_dtype=torch.bfloat16)
    reference.set_progress_bar_config(disable=True)
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, dtype="bfloat16")
    picture = smooth_random_image(80, 64, seed=1) if image else None
    common = dict(height=64, width=80, num_inference_steps=4, guidance_scale=6.0)
    params = SamplingParams(
        prompt=PROMPT, seed=3, num_frames=9, input_images=[picture] if image else None, **common
    )
    pipeline = ours.pipeline
    req = pipeline.run_pre_denoise(pipeline.validate(Req(params=params)))
    while not req.is_denoised:
        pipeline.denoise_step([req])
    assert req.latents.dtype == torch.bfloat16
    inputs = {"image": picture} if image else {}
    want = reference(
        prompt=PROMPT,
        num_frames=9,
        generator=torch.Generator().manual_seed(3),
        output_type="latent",
        **inputs,
        **common,
    ).frames
    assert_parity(
        req.latents.transpose(1, 2).float(),
        want.float(),
        f"CogVideoX {variant} {'I2V' if image else 'T2V'} bfloat16 latents",
        min_db=LATENT_MIN_DB,
    )


@pytest.mark.parametrize("folder", ["1.0", "1.5-i2v"])
def test_previews_decode_the_predicted_first_frame(folders, folder) -> None:
    """A mid-denoising preview: the first real frame of the sampler's predicted clean sample (after 1.5's
    padding frame), at the output size; none before the first step."""
    ours, _ = folders(folder)
    image = [smooth_random_image(80, 64, seed=2)] if folder.endswith("i2v") else None
    params = SamplingParams(
        prompt=PROMPT, seed=4, num_frames=9, height=48, width=64, num_inference_steps=2, input_images=image
    )
    pipeline = ours.pipeline
    req = pipeline.run_pre_denoise(pipeline.validate(Req(params=params)))
    with pytest.raises(ValueError, match="nothing to preview"):
        pipeline.preview_images(req)
    previews = []
    while not req.is_denoised:
        pipeline.denoise_step([req])
        previews.append(pipeline.preview_images(req))
    assert [[p.size for p in step] for step in previews] == [[(64, 48)]] * 2
    final = np.stack(pipeline.run_post_denoise(req).outputs.frames)[0, 0]
    value = psnr_uint8(np.asarray(previews[-1][0]), final)
    print(f"CogVideoX {folder}: last preview vs the video's first frame {value:.1f} dB")
    assert value > 10.0


def test_text_to_video_with_an_ofs_dit_is_refused(tmp_path) -> None:
    """A DiT with an ofs embedding (CogVideoX 1.5 I2V's) under the text-to-video pipeline: Diffusers' passes it
    no ofs and fails; refused at load."""
    import json

    from diffserve.errors import ModelLoadError

    root = build_tiny_cogvideox(tmp_path, TinyCogVideoXSpec(variant="1.5", image_to_video=True))
    index = root / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "CogVideoXPipeline"}))
    with pytest.raises(ModelLoadError, match="ofs_embed_dim is set"):
        DiffGenerator.from_pretrained(root, device="cpu")
