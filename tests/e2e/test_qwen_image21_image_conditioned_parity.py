"""Image-conditioned Qwen-Image 2.1 generations (`image=`): diffserve against Diffusers' `QwenImage21Pipeline`,
same tiny folder and seed, fp32: one condition image with the output size taken from its aspect ratio
(CFG off), one image with CFG at a size of its own, two images of different aspect ratios (CFG on); a
conditioned request batched with a text-only one gives what each gives alone; the prompt states with
images in their vision slots; Diffusers' `output_resolution` as the request's `extra` setting; too many
images, and images the encoders cannot read at their resized size, are refused. Every generation also runs
with another condition image (the control), which must fall well below the bar.

Condition images are resized to about `output_resolution`² pixels (1024² by default); both sides use 64 here
(diffserve's `QwenImage21PipelineConfig.default_resolution`, Diffusers' `output_resolution`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline as DiffusersQwenImage21
from PIL import Image

from diffserve import SamplingParams
from diffserve.api import DiffGenerator
from diffserve.errors import InvalidRequestError
from diffserve.families.qwen_image21 import pipeline as qwen21_pipeline
from diffserve.families.qwen_image21.conditioning import condition_size, over_white
from diffserve.families.qwen_image21.config import QwenImage21PipelineConfig
from diffserve.families.qwen_image21.text_encoding import QwenImage21TextEncodingStage
from diffserve.families.qwen_image21.tiny import TinyQwenImage21Spec, build_tiny_qwen_image21
from diffserve.loader.processors import load_image_text_processor
from diffserve.testing.parity import (
    assert_batched_as_alone,
    assert_images_match,
    diffusers_uint8,
    stack_uint8,
)

PSNR_BAR_DB = 40.0
RESOLUTION = 64
PROMPT = "make the fox red"


def _image(height: int, width: int, seed: int) -> Image.Image:
    """A smooth image with blocks, so the VAE and the vision tower see structure."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    blocks = rng.integers(0, 55, (height // 8 + 1, width // 8 + 1, 3)).repeat(8, 0).repeat(8, 1)
    return Image.fromarray((base + blocks[:height, :width]).astype(np.uint8))


WIDE = _image(40, 120, 0)  # -> 96x32 pixels: a 2x6 latent grid, 3 vision slots
#: -> 32x96 pixels; RGBA with a transparent band: the text encoder reads it over white, the VAE its alpha.
TALL = _image(100, 50, 1).convert("RGBA")
TALL.putalpha(Image.fromarray(np.where(np.arange(100)[:, None] < 30, 0, 255).repeat(50, 1).astype(np.uint8)))
#: The control: another wide image (random pixels, so it differs everywhere).
OTHER = Image.fromarray(np.random.default_rng(7).integers(0, 256, (40, 120, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = build_tiny_qwen_image21(
        tmp_path_factory.mktemp("qwen-image-2.1-ti2i"), TinyQwenImage21Spec(dit_weight_noise=0.5)
    )
    patch = pytest.MonkeyPatch()
    patch.setattr(
        qwen21_pipeline.QwenImage21Pipeline,
        "config",
        QwenImage21PipelineConfig(default_resolution=RESOLUTION),
    )
    ours = DiffGenerator.from_pretrained(root, device="cpu", show_progress=False, batch_policy="throughput")
    patch.undo()
    processor = load_image_text_processor("Qwen3VLProcessor", root / "processor")
    processor.chat_template = (root / "processor" / "chat_template.jinja").read_text()
    reference = DiffusersQwenImage21.from_pretrained(root, processor=processor, dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    return ours, reference


CASES = [
    ("one wide image, default size, no cfg", [WIDE], {}, (32, 96)),
    (
        "one wide image, 64x32, cfg, two outputs",
        [WIDE],
        {"height": 64, "width": 32, "true_cfg_scale": 4.0, "negative_prompt": "blurry", "outputs": 2},
        (64, 32),
    ),
    ("two images, cfg", [WIDE, TALL], {"true_cfg_scale": 3.0, "negative_prompt": " "}, (96, 32)),
]


@pytest.mark.parametrize(("label", "images", "kwargs", "size"), CASES, ids=[c[0] for c in CASES])
def test_matches_diffusers(pair, label, images, kwargs, size) -> None:
    ours, reference = pair
    kwargs = dict(kwargs)
    n = kwargs.pop("outputs", 1)
    common = dict(prompt=PROMPT, seed=3, num_inference_steps=2, **kwargs)
    got = stack_uint8(ours.generate(image=images, num_outputs_per_prompt=n, **common).images)
    want = diffusers_uint8(
        reference, image=images, output_resolution=RESOLUTION, num_images_per_prompt=n, **common
    )
    other = [OTHER, *images[1:]]
    control = stack_uint8(ours.generate(image=other, num_outputs_per_prompt=n, **common).images)
    assert_images_match(
        got, want, f"Qwen-Image 2.1 {label}", min_db=PSNR_BAR_DB, shape=(n, *size, 4), control=control
    )


@pytest.mark.parametrize(
    ("label", "images", "resolution", "size"),
    [
        ("one wide image", [WIDE], 96, (64, 160)),  # resized to about 96x96 pixels (at 64: 32x96)
        ("text only", [], 48, (32, 32)),  # the default square (at 64: 64x64), floored to 32 as Diffusers does
    ],
)
def test_output_resolution_matches_diffusers(pair, label, images, resolution, size) -> None:
    """Diffusers' `output_resolution` (the condition images' area and the default size) as `extra`; the
    size differs from the pipeline's resolution's, so a pass shows the setting is used."""
    ours, reference = pair
    common = dict(prompt=PROMPT, seed=4, num_inference_steps=2)
    condition = {"image": images} if images else {}
    got = stack_uint8(ours.generate(**condition, extra={"output_resolution": resolution}, **common).images)
    want = diffusers_uint8(reference, **condition, output_resolution=resolution, **common)
    label = f"Qwen-Image 2.1 output_resolution {resolution}, {label}"
    assert_images_match(got, want, label, min_db=PSNR_BAR_DB, shape=(1, *size, 4))


@pytest.mark.parametrize(
    ("images", "extra", "message"),
    [
        # Resized to about 64x64 pixels with sides rounded to 32, one side would be 0 (Diffusers fails in PIL).
        ([WIDE, _image(4, 200, 2)], {}, r"input image 2 \(200x4\).* too elongated"),
        # 288x96 pixels: above the tiny processor's 16384, which would resize it and break its vision slots.
        ([WIDE], {"output_resolution": 160}, r"input image 1 .*27648 pixels, outside the 1024\.\.16384"),
        ([WIDE], {"output_resolution": 16}, r"extra\['output_resolution'\] must be"),
        ([WIDE], {"resolution": 64}, "unknown setting"),
    ],
)
def test_condition_images_the_encoders_cannot_read_are_refused(pair, images, extra, message) -> None:
    """Refused before any model work (Diffusers fails deep inside PIL, the processor or the DiT)."""
    ours, _ = pair
    with pytest.raises(InvalidRequestError, match=message) as info:
        ours.generate(prompt=PROMPT, image=images, height=32, width=32, num_inference_steps=1, extra=extra)
    assert info.value.param in ("image", "extra")


def test_conditioned_and_text_only_requests_share_steps(pair) -> None:
    ours, _ = pair
    common = dict(height=32, width=64, num_inference_steps=2)
    params = [
        SamplingParams(
            prompt="a cat", seed=5, input_images=[WIDE], true_cfg_scale=4.0, negative_prompt="ugly", **common
        ),  # fmt: skip
        SamplingParams(prompt="a boat on a lake at dawn, oil painting", seed=6, **common),
    ]
    assert assert_batched_as_alone(ours, params, "Qwen-Image 2.1 image-conditioned")[0] == 2


def test_prompt_states_with_images_match_diffusers(pair) -> None:
    """The states of a prompt with two images in its vision slots, and where each image's slots are."""
    ours, reference = pair
    stage = next(s for s in ours.pipeline.stages if isinstance(s, QwenImage21TextEncodingStage))
    resized = [
        image.convert("RGBA").resize(condition_size(image, RESOLUTION), Image.Resampling.LANCZOS)
        for image in (WIDE, TALL)
    ]
    want, mask, slots = reference.encode_prompt(PROMPT, image=resized)
    got, runs = stage.encode_with_images(PROMPT, [over_white(image) for image in resized])
    assert mask is None
    torch.testing.assert_close(got[None], want, rtol=1e-5, atol=1e-6)
    marked = torch.zeros(got.shape[0], dtype=torch.bool)
    for start, count in runs:
        marked[start : start + count] = True
    assert runs[0][1] == 3 and torch.equal(marked, slots[0])


def test_too_many_images_are_refused(pair) -> None:
    ours, _ = pair
    limit = qwen21_pipeline.QwenImage21Pipeline.max_input_images
    with pytest.raises(InvalidRequestError, match="at most"):
        ours.generate(prompt=PROMPT, image=[WIDE] * (limit + 1), num_inference_steps=1)
