"""Qwen-Image-Layered decompositions: diffserve against Diffusers' `QwenImageLayeredPipeline`, same tiny
random-weight folder and seed, every RGBA layer compared.

Diffusers resizes the input image to about 640x640 or 1024x1024 pixels (its `resolution` buckets); both
sides run here with small areas per bucket (Diffusers' `calculate_dimensions` is wrapped, diffserve's
config given the same areas), so the tiny checkpoint's test stays fast. Only the areas change: the
aspect rule, rounding, RoPE, schedule and decoding are the pipelines' own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImageLayeredPipeline as DiffusersLayered
from PIL import Image

from diffserve import DiffGenerator, SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.families.qwen_image import layered
from diffserve.families.qwen_image.tiny import build_tiny_qwen_image_layered, load_qwen_vl_processor
from diffserve.registry import resolve_family
from diffserve.request import Req
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.parity import assert_images_match, stack_uint8

PSNR_BAR_DB = 40.0
#: Diffusers' bucket areas (640**2, 1024**2) -> the small ones both sides use here.
AREAS = {640 * 640: 80 * 80, 1024 * 1024: 112 * 112}
PROMPT = "a red fox on a green meadow"


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = build_tiny_qwen_image_layered(tmp_path_factory.mktemp("qwen-image-layered"))
    patch = pytest.MonkeyPatch()
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as diffusers_layered

    full_area = diffusers_layered.calculate_dimensions
    patch.setattr(
        diffusers_layered, "calculate_dimensions", lambda area, ratio: full_area(AREAS[area], ratio)
    )
    small = layered.QwenImageLayeredPipelineConfig(
        resolution_areas=((640, AREAS[640**2]), (1024, AREAS[1024**2]))
    )
    patch.setattr(layered.QwenImageLayeredPipeline, "config", small)
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False)
    reference = DiffusersLayered.from_pretrained(
        root, torch_dtype=torch.float32, processor=load_qwen_vl_processor(root / "processor")
    )
    reference.set_progress_bar_config(disable=True)
    yield root, ours, reference
    patch.undo()


def _input_image(height: int, width: int, seed: int = 0, transparent: bool = False) -> Image.Image:
    """An RGBA image with structure (gradients plus blocks), so the VAE sees more than noise; opaque, or
    with `transparent` a left half fully and a band half transparent."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    blocks = (
        rng.integers(0, 55, (height // 8 + 1, width // 8 + 1, 3)).repeat(8, 0).repeat(8, 1)[:height, :width]
    )
    rgb = (base + blocks).astype(np.uint8)
    alpha = np.full((height, width, 1), 255, dtype=np.uint8)
    if transparent:
        alpha[:, : width // 2] = 0
        alpha[height // 3 : height // 2] = 128
    return Image.fromarray(np.concatenate([rgb, alpha], axis=-1), mode="RGBA")


def _reference_layers(reference, image: Image.Image, seed: int, **kwargs) -> np.ndarray:
    out = reference(image=image, generator=torch.Generator("cpu").manual_seed(seed), **kwargs)
    (layers,) = out.images  # one prompt: its list of layers
    return stack_uint8(layers)


def test_the_registry_serves_the_layered_folder(pipelines) -> None:
    root, ours, _ = pipelines
    family = resolve_family("QwenImageLayeredPipeline")
    assert family.name == "qwen-image-layered" and family.task == "image-edit"
    assert type(ours.pipeline).__name__ == "QwenImageLayeredPipeline"


@pytest.mark.parametrize(
    ("size", "options"),
    [
        # wide input, true CFG, 3 layers, the 640 bucket
        ((60, 90), {"true_cfg_scale": 4.0, "negative_prompt": "blurry", "layers": 3, "resolution": 640}),
        # tall input, no CFG, 2 layers, the 1024 bucket
        ((100, 70), {"true_cfg_scale": 1.0, "layers": 2, "resolution": 1024}),
        # square, CFG with its normalisation, 1 layer
        ((64, 64), {"true_cfg_scale": 2.5, "negative_prompt": " ", "layers": 1, "cfg_normalize": True}),
    ],
    ids=["wide-cfg-3-layers", "tall-no-cfg-1024", "square-cfg-normalize"],
)
def test_layers_match_diffusers(pipelines, size, options) -> None:
    _, ours, reference = pipelines
    image = _input_image(*size)
    common = {k: v for k, v in options.items() if k in ("true_cfg_scale", "negative_prompt")}
    extra = {k: v for k, v in options.items() if k not in common}
    out = ours.generate(
        prompt=PROMPT,
        image=image,
        seed=5,
        num_inference_steps=3,
        max_sequence_length=64,
        extra=extra,
        **common,
    )
    ref = _reference_layers(
        reference, image, seed=5, prompt=PROMPT, num_inference_steps=3, max_sequence_length=64, **options
    )
    ours_u8 = stack_uint8(out.images)
    layers = options["layers"]
    assert all(im.mode == "RGBA" for im in out.images)
    assert ours_u8.shape[0] == layers and ours_u8.shape[-1] == 4
    label = f"Qwen-Image-Layered input {size} -> {layers} x {ours_u8.shape[1]}x{ours_u8.shape[2]} {options}"
    assert_images_match(ours_u8, ref, label, min_db=PSNR_BAR_DB)
    for i in range(layers):  # every layer on its own, as well as all together
        assert_images_match(ours_u8[i], ref[i], f"{label} layer {i}", min_db=PSNR_BAR_DB)


def test_two_outputs_per_prompt_give_each_its_layers(pipelines) -> None:
    """Outputs follow each other, `layers` images each; the first output equals a one-output request's
    within one uint8 level, the project's batched-as-alone bar (the second draws its noise after the first,
    so only the first is compared)."""
    _, ours, _ = pipelines
    image = _input_image(64, 80)
    kwargs = dict(prompt=PROMPT, image=image, seed=7, num_inference_steps=2, true_cfg_scale=1.0)
    two = ours.generate(num_outputs_per_prompt=2, extra={"layers": 2}, **kwargs)
    assert len(two.images) == 4
    one = ours.generate(extra={"layers": 2}, **kwargs)
    first, alone = stack_uint8(two.images[:2]).astype(np.int16), stack_uint8(one.images).astype(np.int16)
    assert first.shape == alone.shape
    assert int(np.abs(first - alone).max()) <= 1


def test_a_request_may_set_the_layers_size(pipelines) -> None:
    """Beyond Diffusers: height and width resize the input image (and so the layers) to exactly that size;
    unset, the size follows the input's aspect ratio at the bucket's area (the parity test above)."""
    _, ours, _ = pipelines
    image = _input_image(60, 90)
    out = ours.generate(
        prompt=PROMPT, image=image, height=32, width=48, seed=1, num_inference_steps=2, extra={"layers": 2}
    )
    assert [im.size for im in out.images] == [(48, 32)] * 2
    with pytest.raises(InvalidRequestError) as info:
        ours.generate(prompt=PROMPT, image=image, height=40, width=48, num_inference_steps=1)
    assert info.value.param == "height"


@pytest.mark.parametrize(
    ("request_kwargs", "param", "message"),
    [
        ({}, "image", "needs an input image"),
        ({"extra": {"layers": 0}}, "extra", r"extra\['layers'\] must be an? integer in \[1, 16\]"),
        ({"extra": {"layers": 17}}, "extra", r"extra\['layers'\] must be an? integer in \[1, 16\]"),
        ({"extra": {"resolution": 800}}, "extra", r"extra\['resolution'\] must be one of 640, 1024"),
        ({"extra": {"layer": 2}}, "extra", "unknown setting"),
        ({"guidance_scale": 3.0}, "guidance_scale", "guidance_scale is not a parameter"),
        ({"output_format": "jpeg"}, "output_format", "output_format must be png"),
        ({"prompt": " "}, "prompt", "needs a prompt describing the input image"),
        # Resized to the bucket's area with sides rounded to 32 it would be 0 pixels tall (Diffusers fails in PIL)
        ({"image": _input_image(8, 200)}, "image", r"input image 1 \(200x8\) is too elongated"),
    ],
)
def test_bad_requests_are_refused_naming_the_parameter(pipelines, request_kwargs, param, message) -> None:
    _, ours, _ = pipelines
    kwargs = {"prompt": PROMPT, "num_inference_steps": 1, **request_kwargs}
    if param != "image":
        kwargs["image"] = _input_image(32, 32)
    with pytest.raises(InvalidRequestError, match=message) as info:
        ours.generate(**kwargs)
    assert info.value.param == param


def test_previews_are_the_layers(pipelines) -> None:
    """A mid-denoising preview (the server's `partial_images`) decodes every layer of every output."""
    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.request import Req

    _, ours, _ = pipelines
    pipeline = ours.pipeline
    params = SamplingParams(
        PROMPT,
        input_images=[_input_image(32, 48)],
        height=32,
        width=48,
        num_inference_steps=3,
        num_outputs_per_prompt=2,
        extra={"layers": 3},
    )
    req = pipeline.run_pre_denoise(pipeline.validate(Req(params=params)))
    pipeline.denoise_step([req])
    previews = pipeline.preview_images(req)
    assert len(previews) == 2 * 3 and all(p.mode == "RGBA" and p.size == (48, 32) for p in previews)


def test_requests_batched_in_one_step_equal_each_alone(pipelines) -> None:
    """The engine's step batching: two decompositions with prompts of other lengths (padded and masked in
    one DiT forward), one with CFG and one without, each as it is alone."""
    from diffserve.configs.sampling_params import SamplingParams
    from diffserve.testing.parity import assert_batched_as_alone

    _, ours, _ = pipelines
    common = dict(height=32, width=48, num_inference_steps=2, extra={"layers": 2})
    params = [
        SamplingParams(
            "a fox",
            input_images=[_input_image(32, 48)],
            seed=1,
            true_cfg_scale=3.0,
            negative_prompt="x",
            **common,
        ),
        SamplingParams(
            "a much longer prompt about a fox on a meadow",
            input_images=[_input_image(32, 48, seed=1)],
            seed=2,
            true_cfg_scale=1.0,
            **common,
        ),
    ]
    assert assert_batched_as_alone(ours, params, "Qwen-Image-Layered") == [2, 2]


def test_admission_counts_every_layer(pipelines) -> None:
    """The memory model and --max-batch-tokens count the composite and every layer: a full image of tokens
    each in every DiT step, each decoded (`Req.generated.images`)."""
    ours = pipelines[1]
    costs = {}
    for layers in (1, 4):
        params = SamplingParams(
            prompt="a cat", input_images=[Image.new("RGB", (64, 64), (90, 120, 30))], height=64, width=64,
            extra={"layers": layers},
        )  # fmt: skip
        costs[layers] = ours.engine.cost(ours.pipeline.validate(Req(params=params)))
    # (1 layer + the composite + the input) vs (4 + 1 + 1) images of tokens; 2 vs 5 latent images decoded
    assert costs[4].tokens == 2 * costs[1].tokens and (costs[1].frames, costs[4].frames) == (2, 5)


def test_a_transparent_input_is_read_with_its_alpha(pipelines, tmp_path) -> None:
    """Diffusers reads the input's alpha; so does `DiffGenerator`, given a PIL image or a PNG file through the
    shared loader (the CLI's and the server's keep transparency too). The tiny model barely reacts to alpha,
    so the bar here is exactness: an opaque copy of the input (the alpha dropped) lands far below it."""
    _, ours, reference = pipelines
    image = _input_image(48, 64, transparent=True)
    path = tmp_path / "transparent.png"
    image.save(path)
    call = {"prompt": PROMPT, "seed": 3, "num_inference_steps": 2, "max_sequence_length": 64}
    ref = _reference_layers(reference, image, true_cfg_scale=1.0, layers=2, **call)
    opaque = ours.generate(image=image.convert("RGB"), true_cfg_scale=1.0, extra={"layers": 2}, **call)
    opaque_db = psnr_uint8(stack_uint8(opaque.images), ref)
    for source in (image, path):
        out = ours.generate(image=source, true_cfg_scale=1.0, extra={"layers": 2}, **call)
        value = assert_images_match(stack_uint8(out.images), ref, f"transparent input ({type(source).__name__})", min_db=PSNR_BAR_DB)  # fmt: skip
        assert value >= 90.0 > opaque_db, (value, opaque_db)
